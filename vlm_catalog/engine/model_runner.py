"""Turn a scheduled step into model inputs, run the model, return the logits that sample.

For the chunks of one step the runner builds a flat batch: token ids, MRoPE
positions [3, T], each token's KV slot, padded block tables and per-sequence
lengths. Image placeholder tokens get their features from the encoder cache;
images the step needs that are not cached are decoded (most of them already,
in the background: `prefetch_images`, engine/image_prefetch.py) and encoded
together in one vision-tower call first (`encode_images`). A chunk may cover part of an
image: it takes the matching rows of that image's features, so prefill chunks
may split an image anywhere. Only the last token of a chunk that completes a
request's tokens produces logits.

The runner reads requests and block tables but never changes them or the
allocator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from kernels.arrival_counters import check_last_program_kernels
from vlm_catalog.device_upload import upload
from vlm_catalog.engine.block_table_rows import BlockTableRows
from vlm_catalog.engine.cuda_graphs import DecodeGraphRunner
from vlm_catalog.engine.device_timer import DeviceTimer
from vlm_catalog.engine.encoder_cache import EncoderCache
from vlm_catalog.engine.image_prefetch import ImagePrefetcher
from vlm_catalog.engine.paged_attention import (
    DecodeBatch,
    PagedAttention,
    PagedAttentionMetadata,
    PrefillBatch,
)
from vlm_catalog.engine.pending_tokens import PendingTokens
from vlm_catalog.engine.request import PLACEHOLDER_TOKEN
from vlm_catalog.engine.scheduler import ScheduledChunk
from vlm_catalog.model.qwen3_vl_moe import ImageEmbedding, Qwen3VLMoeModel
from vlm_catalog.model.text import MultimodalEmbeddings
from vlm_catalog.preprocess.image import ImageProbe, ImageProcessor, normalise_patch_bytes


def order_chunks(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """Decodes first, prefill chunks after; stable otherwise."""
    return sorted(chunks, key=lambda chunk: not chunk.is_decode)


def _count_leading_decodes(chunks: list[ScheduledChunk]) -> int:
    count = 0
    while count < len(chunks) and chunks[count].is_decode:
        count += 1
    if any(chunk.is_decode for chunk in chunks[count:]):
        raise ValueError("decode chunks must come first (see order_chunks)")
    return count


class ModelRunner:
    def __init__(
        self,
        model: Qwen3VLMoeModel,
        image_processor: ImageProcessor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        encoder_cache: EncoderCache,
        image_workers: int | None = None,
        graph_runner: DecodeGraphRunner | None = None,
        image_prefetch_bytes: int = 0,
        max_num_seqs: int = 256,
        max_model_len: int = 32768,
    ) -> None:
        self.model = model
        self.graph_runner = graph_runner
        self.image_processor = image_processor
        self.kv_caches = kv_caches
        self.block_size = block_size
        # a row per running request, and spare rows so that those of requests left out of a step are kept
        self.block_tables = BlockTableRows(max_num_seqs + max_num_seqs // 4, -(-max_model_len // block_size))
        self.encoder_cache = encoder_cache
        self.device = model.device
        self.image_token_id = model.config.image_token_id
        self.pixel_dtype = model.visual.patch_embed.pixel_dtype
        # the per-channel normalisation, on the device once: pixels cross as uint8 and are normalised there
        self._pixel_scale, self._pixel_offset = (upload(t, self.device) for t in image_processor.normalisation)
        self.images = ImagePrefetcher(self._decode, self._staged_bytes, image_prefetch_bytes, image_workers)
        self.num_images_encoded = 0
        # the counters of the kernels whose last program finishes the work (the decode merge, the
        # routing after the norm): made now, so that no step allocates them (256 KiB), and those
        # kernels checked once on this device against their two-launch paths
        check_last_program_kernels(self.device)
        self._new_timers()

    def _new_timers(self) -> None:
        """The device timers at zero, each labelled for torch.profiler (`DeviceTimer`)."""
        self.vision_timer = DeviceTimer(self.device, "vlm.vision_encoder")  # the vision tower's device time
        # the text model's device time (forward and logits), by the kind of step: "prefill" (with a
        # prefill chunk) or "decode" (every chunk one token; a CUDA graph's replay where one is captured)
        self.forward_timers = {kind: DeviceTimer(self.device, f"vlm.text_forward.{kind}") for kind in ("prefill", "decode")}
        # whole steps, timed by the engine (encode, forward, sample): the rest of a step's kernels are marked as its
        self.step_timer = DeviceTimer(self.device, "vlm.step")

    def close(self) -> None:
        self.images.close()

    def reset_counters(self) -> None:
        """Images encoded, the device timers and the image decoder's counts, at zero."""
        self.num_images_encoded = 0
        self._new_timers()
        self.images.reset_counters()

    # ------------------------------------------------------------ vision
    def encode_images(self, chunks: list[ScheduledChunk]) -> tuple[dict[str, ImageEmbedding], dict[str, str]]:
        """Features of every image the chunks touch ({content hash: embedding}), and failures.

        Images not in the encoder cache are decoded (or taken from a prefetch) and
        encoded in one batch. An image that fails to decode is reported (hash -> error)
        so the engine can fail the requests showing it; the others go on.
        """
        needed: dict[str, ImageProbe] = {}
        for chunk in chunks:
            if chunk.past_prompt:
                continue
            for image, (span_start, span_length) in zip(chunk.request.prompt.images, chunk.request.prompt.image_spans):
                if span_start < chunk.end and chunk.start < span_start + span_length:
                    needed.setdefault(image.content_hash, image)
        found: dict[str, ImageEmbedding] = {}
        missing: list[ImageProbe] = []
        for content_hash, image in needed.items():
            embedding = self.encoder_cache.get(content_hash)
            if embedding is None:
                missing.append(image)
            else:
                found[content_hash] = embedding
        failures: dict[str, str] = {}
        if missing:
            decoded = self.images.take(missing)
            ready = [(image, pixels) for image, pixels in zip(missing, decoded) if not isinstance(pixels, str)]
            for image, pixels in zip(missing, decoded):
                if isinstance(pixels, str):
                    failures[image.content_hash] = pixels
            if ready:
                # pinned uint8 rows copy without blocking the host; grids stay on the host (the tower
                # reads them as ints)
                pixel_bytes = torch.cat([pixels.to(self.device, non_blocking=True) for _, pixels in ready])
                grids = torch.tensor([image.grid_thw for image, _ in ready])  # [images, 3]
                with self.vision_timer:
                    pixel_values = self.normalised(pixel_bytes)  # [N, C*T*P*P]
                    embeddings = self.model.encode_images(pixel_values, grids)
                for (image, _), embedding in zip(ready, embeddings):
                    # its own rows only: the cache's bound in tokens is then a bound in bytes
                    # (`encoder_cache_bytes`, which the memory profile reserves)
                    self.encoder_cache.put(image.content_hash, embedding.owning())
                    found[image.content_hash] = embedding
                    self.num_images_encoded += 1
        return found, failures

    def prefetch_images(self, upcoming: Iterable[ImageProbe]) -> None:
        """Decode, in the background, the images of `upcoming` (soonest first) not in the encoder cache."""
        self.images.prefetch(image for image in upcoming if image.content_hash not in self.encoder_cache)

    def _attention_metadata(
        self, chunks: list[ScheduledChunk], slots: torch.Tensor, cu_seqlens: list[int], context_lens: list[int]
    ) -> PagedAttentionMetadata:
        device = self.device
        num_decodes = _count_leading_decodes(chunks)

        def tables(part: list[ScheduledChunk]) -> torch.Tensor:  # [B, max blocks in part] int32
            return upload(self.block_tables.gather([(chunk.request.request_id, chunk.block_table) for chunk in part]), device)

        decode = prefill = None
        if num_decodes:
            decode = DecodeBatch(
                slot_mapping=upload(slots[:num_decodes], device),
                block_tables=tables(chunks[:num_decodes]),
                context_lens=upload(context_lens[:num_decodes], device, torch.int32),
                max_context_len=max(context_lens[:num_decodes]),
            )
        if num_decodes < len(chunks):
            rest = chunks[num_decodes:]
            prefill = PrefillBatch(
                slot_mapping=upload(slots[num_decodes:], device),
                block_tables=tables(rest),
                cu_seqlens_q=upload([c - num_decodes for c in cu_seqlens[num_decodes:]], device, torch.int32),
                context_lens=upload(context_lens[num_decodes:], device, torch.int32),
                max_query_len=max(chunk.num_tokens for chunk in rest),
                host_lens=([chunk.num_tokens for chunk in rest], context_lens[num_decodes:]),
            )
        return PagedAttentionMetadata(decode, prefill)

    def normalised(self, pixel_bytes: torch.Tensor) -> torch.Tensor:
        """Decoded uint8 patch rows on the device -> the patch embedding's input: exactly the
        preprocessor's float32 pixels (`normalise_patch_bytes`), in the embedding's dtype."""
        return normalise_patch_bytes(pixel_bytes, self._pixel_scale, self._pixel_offset).to(self.pixel_dtype)

    def _decode(self, image: ImageProbe) -> torch.Tensor | str:
        try:
            processed = self.image_processor.process_bytes(image.source)
        except Exception as exc:  # noqa: BLE001 - any decoder failure fails only its requests
            return f"image could not be decoded: {exc}"
        if tuple(processed.grid_thw) != tuple(image.grid_thw):
            return f"image decoded to grid {processed.grid_thw}, its header said {image.grid_thw}"
        return self._staged(processed.pixel_values)

    def _staged(self, pixel_bytes: torch.Tensor) -> torch.Tensor:
        """uint8 patch rows as the device takes them (a quarter of float32's bytes, half of
        bf16's; `normalised` finishes them there): on CUDA in pinned memory, so the copy to the
        device does not block the host."""
        if self.device.type == "cuda":
            try:
                return torch.empty(pixel_bytes.shape, dtype=torch.uint8, pin_memory=True).copy_(pixel_bytes)
            except RuntimeError:  # no pinned memory to be had: a pageable copy works, it only blocks
                pass
        return pixel_bytes

    def _staged_bytes(self, image: ImageProbe) -> int:
        """What `_staged` will hold for an image, from its header's grid: a byte per pixel value."""
        return math.prod(image.grid_thw) * self.model.config.vision.patch_dim

    # -------------------------------------------------------------- text
    @torch.inference_mode()
    def execute(
        self, chunks: list[ScheduledChunk], images: dict[str, ImageEmbedding], pending: PendingTokens | None = None
    ) -> torch.Tensor:
        """Run one step; logits [number of sampling chunks, V] in float32, in chunk order.

        Decode chunks must come first (`order_chunks`). A decode whose token is still a
        placeholder (async scheduling) takes it from `pending.tokens`, on the device.
        """
        device = self.device
        block_size = self.block_size
        num_decodes = _count_leading_decodes(chunks)
        # decode chunks (one token each, first in the step): plain Python ints, one tensor each
        decodes = chunks[:num_decodes]
        decode_ids = [chunk.request.token_ids[chunk.start] for chunk in decodes]
        decode_positions = [chunk.start + chunk.request.prompt.mrope_delta for chunk in decodes]
        decode_slots = [
            chunk.block_table[chunk.start // block_size] * block_size + chunk.start % block_size for chunk in decodes
        ]
        token_ids = [torch.tensor(decode_ids, dtype=torch.int32)]
        # dtype explicit: torch.tensor([]) would be float32, and concatenating it with the
        # prefill positions would promote them all to float (the Triton MRoPE kernel refuses that)
        positions = [torch.tensor(decode_positions, dtype=torch.int64).unsqueeze(0).expand(3, -1)]  # [3, D]
        slots = [torch.tensor(decode_slots, dtype=torch.int64)]
        sample_rows = list(range(num_decodes))  # a decode always samples
        cu_seqlens = list(range(num_decodes + 1))
        context_lens = [chunk.end for chunk in decodes]
        multimodal_rows: list[torch.Tensor] = []
        multimodal_parts: list[ImageEmbedding] = []
        offset = num_decodes
        for chunk in chunks[num_decodes:]:  # prefill chunks
            request = chunk.request
            chunk_ids = request.token_ids[chunk.start : chunk.end]
            if request.has_placeholder and chunk.end == request.num_tokens:
                raise RuntimeError(f"request {request.request_id}: a prefill chunk reached a token not yet sampled")
            token_ids.append(torch.frombuffer(chunk_ids, dtype=torch.int32))
            positions.append(request.positions(chunk.start, chunk.end))
            table = torch.tensor(chunk.block_table, dtype=torch.int64)
            indices = torch.arange(chunk.start, chunk.end)
            slots.append(table[indices // block_size] * block_size + indices % block_size)
            for image, (span_start, span_length) in zip(request.prompt.images, request.prompt.image_spans):
                first, last = max(chunk.start, span_start), min(chunk.end, span_start + span_length)
                if first < last:
                    multimodal_parts.append(images[image.content_hash].slice(first - span_start, last - span_start))
                    multimodal_rows.append(torch.arange(first - chunk.start, last - chunk.start) + offset)
            offset += chunk.num_tokens
            cu_seqlens.append(offset)
            context_lens.append(chunk.end)
            if chunk.samples:
                sample_rows.append(offset - 1)

        input_ids = upload(torch.cat(token_ids), device, torch.int64)
        waiting = [row for row, token in enumerate(decode_ids) if token == PLACEHOLDER_TOKEN]
        if waiting:  # decodes of tokens sampled by the previous step, not yet read by the host
            if pending is None:
                raise RuntimeError("a decode's token is a placeholder, and no pending tokens were given")
            sources = [pending.rows[decodes[row].request.request_id] for row in waiting]
            input_ids[upload(waiting, device, torch.int64)] = pending.tokens[upload(sources, device, torch.int64)]
        metadata = self._attention_metadata(chunks, torch.cat(slots), cu_seqlens, context_lens)
        multimodal = None
        if multimodal_parts:
            multimodal = MultimodalEmbeddings(
                rows=upload(torch.cat(multimodal_rows), device),  # [M] ascending, in the order of the parts
                embeddings=torch.cat([part.embeddings for part in multimodal_parts]),
                deepstack=[
                    torch.cat([part.deepstack[j] for part in multimodal_parts])
                    for j in range(len(multimodal_parts[0].deepstack))
                ],
            )
        positions = upload(torch.cat(positions, dim=1), device)  # [3, T] int64
        # every host-to-device copy is queued without waiting (pinned, `upload`) and before the
        # forward is launched; the engine fills grammar bitmasks while it runs
        rows = upload(sample_rows, device, torch.int64) if sample_rows else None
        graphs = self.graph_runner
        with self.forward_timers["decode" if num_decodes == len(chunks) else "prefill"]:
            if (graphs is not None and metadata.prefill is None and multimodal is None
                    and len(chunks) <= graphs.max_batch):
                decode = metadata.decode
                hidden = graphs.run(input_ids, positions, decode.slot_mapping, decode.block_tables, decode.context_lens)
            else:
                hidden = self.model(input_ids, positions, PagedAttention(self.kv_caches, metadata), multimodal)
            if rows is None:
                return hidden.new_zeros((0, self.model.config.text.vocab_size), dtype=torch.float32)
            return self.model.compute_logits(hidden.index_select(0, rows)).float()
