"""CUDA graphs for decode steps at bucketed batch sizes.

A decode step (every sequence computes one token) has the same shapes for a
given batch size, so its whole model forward (one launch per kernel per layer,
hundreds of launches) can be captured once and replayed. Batch sizes are
rounded up to a bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, ...); padding rows get
context length 0 (zero attention output) and KV slot -1 (no cache write), so
they change nothing. Inputs are copied into static buffers before each replay.

The decode kernel is captured with `max_context_len = max_model_len`, a static
upper bound (its split count is fixed at capture). Steps with any prefill
chunk, or more sequences than the largest bucket, run eagerly. Set
`EngineConfig.enforce_eager=True` to turn graphs off (debugging, profiling).

A capture that fails (an op that syncs with the host, e.g. a torch reference
named in `VLM_CATALOG_KERNELS_OFF`, or any kernel error) keeps no graph: the
engine logs why and runs every decode step eagerly rather than not starting.

On CPU (tests) the runner works without capture: `run` executes the same
padded static-buffer forward eagerly, which checks the padding logic.
"""

from __future__ import annotations

import logging

import torch

from kernels.arrival_counters import check_last_program_kernels
from vlm_catalog.engine.paged_attention import DecodeBatch, PagedAttention, PagedAttentionMetadata
from vlm_catalog.model.qwen3_vl_moe import Qwen3VLMoeModel

logger = logging.getLogger(__name__)


def default_buckets(max_batch: int) -> list[int]:
    buckets = [1, 2, 4, 8] + list(range(16, 64, 8)) + list(range(64, 256, 32)) + list(range(256, 4097, 64))
    return [b for b in buckets if b < max_batch] + [max_batch]


class DecodeGraphRunner:
    def __init__(
        self,
        model: Qwen3VLMoeModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_blocks_per_sequence: int,
        max_context_len: int,
        capture: bool | None = None,
        buckets: list[int] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = sorted(buckets or default_buckets(max_batch))
        self.max_context_len = max_context_len
        device = model.device
        self.capture_enabled = device.type == "cuda" if capture is None else capture
        largest = self.buckets[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(3, largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_sequence, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_failure: str | None = None  # why the capture failed, if it did

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, batch: int) -> int:
        return next(size for size in self.buckets if size >= batch)

    def _forward(self, batch: int) -> torch.Tensor:
        metadata = PagedAttentionMetadata(
            decode=DecodeBatch(
                slot_mapping=self.slot_mapping[:batch],
                block_tables=self.block_tables[:batch],
                context_lens=self.context_lens[:batch],
                max_context_len=self.max_context_len,
            ),
            prefill=None,
        )
        return self.model(self.input_ids[:batch], self.positions[:, :batch], PagedAttention(self.kv_caches, metadata))

    def capture(self) -> bool:
        """Capture one graph per bucket (largest first, one shared memory pool). False when the
        capture failed: then no graph is kept (`capture_failure` says why, and it is logged)."""
        if not self.capture_enabled:
            return True
        # the graphs keep whatever their kernels chose at capture: the kernels finishing in their
        # last program must have passed their start-up check before then, or a failed check would
        # reach only the eager steps (kernels/arrival_counters.py; the verdict is kept per device)
        check_last_program_kernels(self.model.device)
        try:
            self._capture()
        except Exception as exc:  # noqa: BLE001 - any failure means: decode eagerly, and say why
            self.graphs.clear()
            self.outputs.clear()
            self.capture_failure = f"{type(exc).__name__}: {exc}"
            logger.warning("CUDA-graph capture of the decode step failed (%s); decode steps run eagerly. "
                           "enforce_eager=True skips the capture.", self.capture_failure)
            return False
        return True

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in reversed(self.buckets):
                self._forward(batch)  # warm-up: Triton compiles and autotunes outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[batch] = self._forward(batch)
                self.graphs[batch] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states [B, H] of a decode step of B sequences (B <= max_batch)."""
        batch = input_ids.shape[0]
        size = self.bucket(batch)
        self.input_ids[:batch].copy_(input_ids)
        self.input_ids[batch:size].zero_()
        self.positions[:, :batch].copy_(positions)
        self.positions[:, batch:size].zero_()
        self.slot_mapping[:batch].copy_(slot_mapping)
        self.slot_mapping[batch:size].fill_(-1)  # padding rows write no KV
        self.block_tables[:batch].zero_()
        self.block_tables[:batch, : block_tables.shape[1]].copy_(block_tables)
        self.block_tables[batch:size].zero_()
        self.context_lens[:batch].copy_(context_lens)
        self.context_lens[batch:size].zero_()  # padding rows attend to nothing
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:batch]
        return self._forward(size)[:batch]
