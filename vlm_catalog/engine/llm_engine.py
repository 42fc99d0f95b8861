"""The serving engine: admission, the step loop, sampling, constrained decoding, outputs.

One `step()`:
1. attach compiled grammars to waiting requests (compilation runs in a thread
   pool; a failed or timed-out compilation fails that request only);
2. the scheduler picks the chunks to run;
3. the runner encodes the images those chunks need (a picture that fails to
   decode fails the requests showing it) and runs the model on the rest;
4. one batched grammar bitmask masks the logits of constrained requests, the
   sampler picks a token per sampling request;
5. each request takes its token; with jump-forward on, tokens the grammar
   forces are appended at once (the next step computes them as one extend);
6. finished requests release their blocks; outputs are returned.

Bad input (an unreadable image, a prompt longer than `max_model_len`, too many
images, an invalid schema) fails that request alone with a clear message; the
engine keeps serving the others. Memory is bounded: a fixed KV pool, an
encoder cache bounded in tokens, a grammar cache bounded in entries.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels.tuned_configs import TunedTableError, describe_sources, device_name, tuned_configs
from vlm_catalog.device_upload import upload
from vlm_catalog.engine.block_manager import BlockManager
from vlm_catalog.engine.config import EngineConfig, EngineConfigError
from vlm_catalog.engine.cpu_allocator import keep_freed_memory, release_free_memory
from vlm_catalog.engine.cuda_graphs import DecodeGraphRunner
from vlm_catalog.engine.detokenizer import Detokenizer
from vlm_catalog.engine.encoder_cache import EncoderCache, encoder_cache_bytes
from vlm_catalog.engine.memory_profile import (
    CUDA_GRAPH_RESERVE_BYTES,
    CudaMemory,
    DeviceMemory,
    MemoryBudget,
    profile_memory,
    worst_case_step,
)
from vlm_catalog.engine.model_runner import ModelRunner, order_chunks
from vlm_catalog.engine.outputs import RequestOutput
from vlm_catalog.engine.paged_attention import allocate_kv_caches, kv_bytes_per_block
from vlm_catalog.engine.pending_tokens import PendingTokens
from vlm_catalog.engine.request import FinishReason, Request
from vlm_catalog.engine.sampler import sample, sample_tokens
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.engine.scheduler import Scheduler, SchedulerOutput
from vlm_catalog.engine.warmup import WarmupReport, warm_up
from vlm_catalog.model.config import ModelConfig, ModelConfigError
from vlm_catalog.model.loader import load_model
from vlm_catalog.model.qwen3_vl_moe import Qwen3VLMoeModel
from vlm_catalog.preprocess.processor import ProcessedPrompt, PromptProcessor

logger = logging.getLogger(__name__)
INVALID_CONSTRAINT = "invalid output constraint"  # begins the error of a request whose grammar did not compile

DEFAULT_CPU_KV_BYTES = 256 * 2**20


class EngineRequestError(ValueError):
    """A request the engine refuses; the message says what is wrong with it."""


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens run through the model (not served by the prefix cache)
    num_output_tokens_computed: int = 0  # generated tokens run through the model
    num_sampled_tokens: int = 0  # tokens chosen by a model step
    num_jump_forward_tokens: int = 0  # tokens appended by jump-forward, without a model step
    num_preemptions: int = 0
    num_finished: int = 0
    seconds_in_prefill_steps: float = 0.0  # steps with at least one prefill chunk
    seconds_in_decode_steps: float = 0.0  # steps where every sequence computed one token
    num_host_memory_releases: int = 0  # free heap pages handed back (release_host_memory_every_s)
    num_images_prefetched: int = 0  # images whose pixels were decoded ahead (engine/image_prefetch.py)
    seconds_waiting_for_images: float = 0.0  # steps waiting for image pixels to be decoded
    seconds_in_vision_encoder: float = 0.0  # the vision tower's device time (CUDA events on GPU)
    # device time (CUDA events on GPU, the host clock on CPU) of the text model's forward and logits,
    # in steps with a prefill chunk and in decode steps, and of whole steps, from the first image
    # encoded to the last token sampled: what is left of a run's time is the device waiting between steps
    seconds_device_forward_prefill_steps: float = 0.0
    seconds_device_forward_decode_steps: float = 0.0
    seconds_device_in_steps: float = 0.0
    # the host clock inside those forward calls: launching them (eager prefill) or replaying a graph;
    # device time about equal to it means the device waited for the launches
    seconds_host_forward_prefill_steps: float = 0.0
    seconds_host_forward_decode_steps: float = 0.0
    num_prefill_steps: int = 0  # steps with at least one prefill chunk
    num_decode_steps: int = 0  # steps where every sequence computed one token
    # host time of constrained requests' grammars: filling the next token masks (while the device
    # runs the forward pass) and advancing them over the taken tokens (after the step's tokens are read)
    seconds_filling_grammar_masks: float = 0.0
    seconds_advancing_grammars: float = 0.0
    seconds_masking_logits: float = 0.0  # host time of applying the masks (copy and launch; more if it syncs)
    num_grammars_attached: int = 0  # constrained requests queued for scheduling once their grammar compiled
    seconds_awaiting_grammars: float = 0.0  # summed over them: arrival to being queued (the compile's wait)
    # the host's own time in `step` besides the steps above: scheduling (compiled grammars attached,
    # then the scheduler), and the outputs built; and, within the steps, its wait for the previous
    # step's sampled tokens (async scheduling: the device getting there). Host time in `step` less
    # that wait is what the host spent working: where it is about the device's time in steps, the
    # device waited for the host
    seconds_scheduling: float = 0.0
    seconds_building_outputs: float = 0.0
    seconds_waiting_for_sampled_tokens_prefill_steps: float = 0.0
    seconds_waiting_for_sampled_tokens_decode_steps: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@contextlib.contextmanager
def _allocation_names_its_settings(kv_tokens: int):
    """The host or device memory for the KV pool and the per-sequence tables ran out: an
    `EngineConfigError` naming the settings that size them, not an allocator's traceback."""
    try:
        yield
    except (MemoryError, torch.OutOfMemoryError) as exc:
        raise EngineConfigError(_out_of_memory(kv_tokens, exc)) from None
    except RuntimeError as exc:
        if "allocate" not in str(exc):  # e.g. "DefaultCPUAllocator: can't allocate memory"
            raise
        raise EngineConfigError(_out_of_memory(kv_tokens, exc)) from None


def _out_of_memory(kv_tokens: int, exc: BaseException) -> str:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (f"not enough memory for the KV cache of {kv_tokens} tokens and the tables of max_num_seqs sequences "
            f"({reason}); lower kv_cache_memory_bytes (or gpu_memory_utilization) or max_num_seqs")


class LLMEngine:
    def __init__(
        self, config: EngineConfig | None = None, prebuilt_model: Qwen3VLMoeModel | None = None, **overrides: Any
    ) -> None:
        """`prebuilt_model`: an already built model to serve (benchmarks with random
        weights); otherwise the weights are loaded from `config.model`, which always
        provides the config, tokenizer, chat template and preprocessor settings."""
        config = config or EngineConfig(**overrides)
        check_device_present(config.torch_device)
        self.config = config
        self.tuned_tables = self._tuned_tables()  # read first: a broken table fails here, not mid-step
        if config.tune_cpu_allocator and config.torch_device.type == "cpu":
            keep_freed_memory()
        self.model_config = ModelConfig.from_pretrained(config.model)
        longest = self.model_config.text.max_position_embeddings
        if longest is not None and config.max_model_len > longest:  # as vLLM: the model never saw such positions
            raise EngineConfigError(
                f"max_model_len {config.max_model_len} is more than the model's max_position_embeddings "
                f"({longest}); set max_model_len to at most {longest}"
            )
        if prebuilt_model is None:
            prebuilt_model = load_model(config.model, dtype=config.torch_dtype, device=config.torch_device,
                                        quantization=config.quantization)
        elif prebuilt_model.config != self.model_config:
            raise EngineConfigError("the prebuilt model does not match the config.json of config.model")
        self.model = prebuilt_model
        self.processor = PromptProcessor.from_pretrained(
            config.model, image_token_id=self.model_config.image_token_id, vision=self.model_config.vision
        )
        self.tokenizer = self.processor.tokenizer
        self.eos_token_ids = self._eos_token_ids()
        text = self.model_config.text
        self.memory_budget: MemoryBudget | None = None  # set when the KV pool was sized by profiling
        self.num_blocks = self._num_kv_blocks()
        with _allocation_names_its_settings(self.num_blocks * config.block_size):
            self.kv_caches = allocate_kv_caches(
                text.num_layers, self.num_blocks, config.block_size, text.num_kv_heads, text.head_dim,
                config.torch_kv_cache_dtype, config.torch_device,
            )
            self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
            self.scheduler = Scheduler(
                self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy
            )
            self.encoder_cache = EncoderCache(config.encoder_cache_tokens)
            self.runner = ModelRunner(
                self.model, self.processor.image_processor, self.kv_caches, config.block_size,
                self.encoder_cache, config.image_workers, self._decode_graphs(), config.image_prefetch_bytes,
                config.max_num_seqs, config.max_model_len,
            )
        self.jump_forward = config.jump_forward(decode_graphs=self.runner.graph_runner is not None)
        self.generator = torch.Generator(device=config.torch_device).manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, Detokenizer] = {}
        self.stats = EngineStats()
        self._grammar_service = None
        self._bitmasks = None  # BitmaskBuffer, made on the first constrained step
        self._bitmask_filler = None  # BitmaskFiller, likewise
        self._ids = itertools.count()
        # constrained requests whose grammar is compiling (not yet in the scheduler's queue), in
        # arrival order, and those whose compile ended (appended by the compiler's threads)
        self._awaiting_grammar: dict[str, Request] = {}
        self._next_memory_release = time.monotonic() + config.release_host_memory_every_s
        self.async_scheduling = config.schedules_async()  # EngineConfig.async_scheduling, auto resolved
        self._pending: PendingTokens | None = None  # sampled tokens not yet read (async_scheduling)
        self.warmup_report: WarmupReport | None = warm_up(self) if config.warms_up() else None

    # ---------------------------------------------------------------- setup
    def _eos_token_ids(self) -> frozenset[int]:
        return eos_token_ids(self.config.model, self.tokenizer)

    def _num_kv_blocks(self) -> int:
        """Blocks in the KV pool: `kv_cache_memory_bytes` if set; on CUDA otherwise what the
        profiling pass leaves (engine/memory_profile.py); on CPU a fixed default."""
        config, text = self.config, self.model_config.text
        per_block = kv_bytes_per_block(
            text.num_layers, config.block_size, text.num_kv_heads, text.head_dim, config.torch_kv_cache_dtype
        )
        budget = config.kv_cache_memory_bytes
        if budget is None:
            memory = self._device_memory()
            if memory is not None:
                self.memory_budget = self._profile_memory(memory)
                self.memory_budget.check(per_block)
                budget = self.memory_budget.kv_cache_bytes
            else:
                budget = DEFAULT_CPU_KV_BYTES
        useful = -(-config.max_num_seqs * config.max_model_len // config.block_size)  # more could never be used
        num_blocks = min(budget // per_block, useful)
        if num_blocks < 1:
            raise EngineConfigError(f"the KV-cache budget ({budget} bytes) is smaller than one block ({per_block} bytes)")
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s)",
            num_blocks, config.block_size, num_blocks * config.block_size, num_blocks * per_block / 2**30,
            str(config.torch_kv_cache_dtype).removeprefix("torch."),
        )
        return int(num_blocks)

    def _tuned_tables(self) -> tuple[str, ...]:
        """The tables of tuned kernel launch settings this engine's device reads
        (`kernels.tuned_configs`: its GPU model's packaged one, then VLM_CATALOG_TUNED_CONFIGS)."""
        try:
            sources = tuned_configs(self.config.torch_device).sources
        except TunedTableError as error:
            raise EngineConfigError(str(error)) from error
        if sources:
            logger.info("tuned kernel launch settings: %s",
                        describe_sources(sources, device_name(self.config.torch_device)))
        return sources

    def _device_memory(self) -> DeviceMemory | None:
        """Memory queries of the device whose KV pool is sized by profiling (CUDA); None on CPU."""
        device = self.config.torch_device
        return CudaMemory(device) if device.type == "cuda" else None

    def _profile_memory(self, memory: DeviceMemory) -> MemoryBudget:
        """Run the worst-case step on the model and measure the KV budget on `memory`."""
        config = self.config
        step = worst_case_step(
            config.max_num_batched_tokens, config.max_num_seqs, self.processor.image_processor,
            max_images=config.max_images_per_prompt * config.max_num_seqs,
        )
        # the decode graphs' pool, and what two caches keep between steps when full: the image
        # embeddings (the encoder cache) and the vision tower's tables per grid shape
        reserve = ((0 if config.enforce_eager else CUDA_GRAPH_RESERVE_BYTES)
                   + encoder_cache_bytes(config.encoder_cache_tokens, self.model_config, self.model.dtype)
                   + self.model.visual.grid_tables_max_bytes())
        return profile_memory(
            self.model, step, memory, config.gpu_memory_utilization, config.block_size, reserve,
            kv_cache_dtype=config.torch_kv_cache_dtype,
        )

    def _decode_graphs(self) -> DecodeGraphRunner | None:
        """Capture decode CUDA graphs (CUDA only, unless enforce_eager); None where none are used."""
        config = self.config
        if config.enforce_eager or config.torch_device.type != "cuda":
            return None
        runner = DecodeGraphRunner(
            self.model,
            self.kv_caches,
            max_batch=min(config.cuda_graph_max_batch, config.max_num_seqs),
            max_blocks_per_sequence=-(-config.max_model_len // config.block_size),
            max_context_len=config.max_model_len,
        )
        return runner if runner.capture() else None  # a failed capture: decode eagerly (logged)

    @property
    def grammar_service(self):
        if self._grammar_service is None:
            from vlm_catalog.structured import GrammarCompilerService

            self._grammar_service = GrammarCompilerService(
                self.tokenizer,
                vocab_size=self.model_config.text.vocab_size,
                stop_token_ids=sorted(self.eos_token_ids),
                max_workers=self.config.grammar_workers(),
                cache_size=self.config.grammar_cache_size,
            )
        return self._grammar_service

    # ------------------------------------------------------------ admission
    def add_request(
        self,
        prompt: list[dict[str, Any]] | ProcessedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request (chat messages or an already processed prompt); raise `EngineRequestError` if refused."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"request-{next(self._ids)}"
        if request_id in self.requests:
            raise EngineRequestError(f"request id {request_id!r} is already in use")
        if not isinstance(prompt, ProcessedPrompt):
            try:
                prompt = self.processor.process(prompt)
            except ValueError as exc:  # PromptError, ImageDecodeError, template errors
                raise EngineRequestError(str(exc)) from None
        self._check_prompt(prompt, params)
        # everything that can fail comes before the request is registered anywhere
        request = Request(request_id, prompt, params, self.config.max_model_len, self.eos_token_ids)
        detokenizer = Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output, params.stop_token_ids)
        if params.constrained:  # queued for scheduling once its grammar is compiled (_attach_grammars)
            request.grammar_future = self._submit_grammar(params)
            self._awaiting_grammar[request_id] = request
        else:
            self.scheduler.add(request)
        self.requests[request_id] = request
        self.detokenizers[request_id] = detokenizer
        return request_id

    def answer_room(self, prompt: ProcessedPrompt) -> int | None:
        """The tokens the context (`max_model_len`) leaves for the output after `prompt`: a request's
        `max_tokens` beyond it is cut there. None when the prompt does not fit at all
        (`add_request` refuses it, saying so)."""
        room = self.config.max_model_len - prompt.num_tokens
        return room if room > 0 else None

    def _check_prompt(self, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        config = self.config
        if prompt.num_tokens == 0:
            raise EngineRequestError("the prompt is empty")
        if len(prompt.images) > config.max_images_per_prompt:
            raise EngineRequestError(
                f"the prompt has {len(prompt.images)} images; at most {config.max_images_per_prompt} are allowed"
            )
        if prompt.num_tokens >= config.max_model_len:
            raise EngineRequestError(
                f"the prompt has {prompt.num_tokens} tokens; max_model_len is {config.max_model_len} "
                "(prompt and output must fit)"
            )
        total = min(prompt.num_tokens + params.max_tokens, config.max_model_len)
        if self.block_manager.blocks_needed(total) > self.num_blocks:
            capacity = self.num_blocks * config.block_size
            raise EngineRequestError(
                f"prompt and output need up to {total} tokens of KV cache; the pool holds {capacity}"
            )
        vocab_size = self.model_config.text.vocab_size
        token_ids = np.frombuffer(prompt.token_ids, dtype=np.intc)  # the array("i") as is: 2.5 us for 5k ids, not 174
        if token_ids.min() < 0 or token_ids.max() >= vocab_size:
            raise EngineRequestError(f"the prompt holds token ids outside the vocabulary [0, {vocab_size})")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad_stop:
            raise EngineRequestError(f"stop_token_ids {bad_stop} are outside the vocabulary")
        cutting = sorted(set(params.stop_token_ids) - set(self.eos_token_ids))
        if params.constrained and cutting:
            raise EngineRequestError(
                f"stop_token_ids {cutting} cannot be combined with json_schema, regex or choice: they would end the "
                "answer before it matches (the constraint ends it, with the end-of-answer tokens)"
            )

    def _submit_grammar(self, params: SamplingParams):
        from vlm_catalog.structured import GrammarError, GrammarSpec

        try:
            spec = GrammarSpec.from_request(
                json_schema=params.json_schema,
                regex=params.regex,
                choice=tuple(params.choice) if params.choice is not None else None,
            )
        except GrammarError as exc:
            raise EngineRequestError(str(exc)) from None
        return self.grammar_service.submit(spec)

    def abort(self, request_id: str) -> bool:
        """Stop a request now (its blocks are freed); its final output comes with the next `step()`.

        Returns False if the request is unknown or already finished.
        """
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._awaiting_grammar.pop(request_id, None)
        self.scheduler.finish(request, FinishReason.ABORT)
        return True

    def abort_all(self) -> list[str]:
        """Drop every request in flight at once, with no final output: after a step that raised,
        whose requests' state is unknown. Their blocks are freed, and the engine takes new requests.
        Returns their ids."""
        dropped = list(self.requests)
        for request_id in dropped:
            self.abort(request_id)
        self.scheduler.drain_finished()
        self.requests.clear()
        self.detokenizers.clear()
        # their sampled tokens not yet read (async scheduling): reading them may be what failed, and
        # the next step would read them again, failing every step after it
        self._pending = None
        return dropped

    @property
    def num_waiting_requests(self) -> int:
        """Requests queued and not yet running: in the waiting queue, or waiting for their grammar."""
        return len(self.scheduler.waiting) + len(self._awaiting_grammar)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued, running, or finished with its output not yet returned
        (or sampled tokens are not yet read: async scheduling)."""
        return (self.scheduler.has_unfinished() or bool(self.scheduler.finished) or bool(self._awaiting_grammar)
                or self._pending is not None)

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; outputs for every request that progressed or finished.

        With `async_scheduling`, the tokens this step samples are read by the next
        call (after it has launched its own forward pass), so their outputs come then.
        """
        started = time.perf_counter()
        self._attach_grammars()
        output = self.scheduler.schedule()
        self.stats.seconds_scheduling += time.perf_counter() - started
        self.stats.num_preemptions += len(output.preempted)
        pending, self._pending = self._pending, None  # the previous step's tokens, still on the device
        try:
            touched = self._run_step(output, pending)
        except BaseException:
            if pending is not None and not pending.was_read and self._pending is None:
                self._pending = pending  # not read yet: the next step reads them
            raise
        started = time.perf_counter()
        self._release_host_memory_when_due()
        outputs = self._collect_outputs(list(dict.fromkeys(touched)))
        self.stats.seconds_building_outputs += time.perf_counter() - started
        return outputs

    def _run_step(self, output: SchedulerOutput, pending: PendingTokens | None) -> list[Request]:
        """Encode, run and sample the scheduled chunks, reading `pending` once this step's forward
        is launched; the requests that took tokens."""
        touched: list[Request] = []
        if not output.is_empty:
            self.stats.num_steps += 1
            started = time.perf_counter()
            waited = 0.0  # for the previous step's tokens, read in this one: counted for its kind
            with self.runner.step_timer:
                images, failures = self.runner.encode_images(output.chunks)
                chunks = order_chunks(self._drop_failed_image_chunks(output, failures))
                self.runner.prefetch_images(self.scheduler.upcoming_images())  # decoded while this step runs
                if chunks:
                    logits = self.runner.execute(chunks, images, pending)
                    if pending is not None:  # read while this step's forward runs, before its bookkeeping
                        touched, waited = self._take_pending(pending), pending.wait_seconds
                        pending = None
                    self._count_computed(chunks)
                    self.scheduler.update_after_step(SchedulerOutput(chunks))
                    try:
                        touched += self._sample_and_append(chunks, logits)
                    except BaseException:
                        self._compute_unsampled_tokens_again(chunks)
                        raise
            elapsed = time.perf_counter() - started
            self._copy_runner_stats()
            if all(chunk.is_decode for chunk in chunks):
                self.stats.seconds_in_decode_steps += elapsed
                self.stats.seconds_waiting_for_sampled_tokens_decode_steps += waited
                self.stats.num_decode_steps += 1
            else:
                self.stats.seconds_in_prefill_steps += elapsed
                self.stats.seconds_waiting_for_sampled_tokens_prefill_steps += waited
                self.stats.num_prefill_steps += 1
        if pending is not None:  # nothing ran this step
            touched = self._take_pending(pending)
        return touched

    def _copy_runner_stats(self) -> None:
        """The runner's image counters and device timers, as of this step (its sampling synced
        the device; with async scheduling the last step's pairs count once a later step reads them)."""
        images = self.runner.images
        self.stats.num_images_prefetched = images.num_prefetch_hits
        self.stats.seconds_waiting_for_images = images.seconds_waiting
        self.stats.seconds_in_vision_encoder = self.runner.vision_timer.seconds
        self.stats.seconds_device_forward_prefill_steps = self.runner.forward_timers["prefill"].seconds
        self.stats.seconds_device_forward_decode_steps = self.runner.forward_timers["decode"].seconds
        self.stats.seconds_device_in_steps = self.runner.step_timer.seconds
        self.stats.seconds_host_forward_prefill_steps = self.runner.forward_timers["prefill"].host_seconds
        self.stats.seconds_host_forward_decode_steps = self.runner.forward_timers["decode"].host_seconds

    def _release_host_memory_when_due(self) -> None:
        interval = self.config.release_host_memory_every_s
        if interval > 0 and time.monotonic() >= self._next_memory_release:
            release_free_memory()
            self.stats.num_host_memory_releases += 1
            self._next_memory_release = time.monotonic() + interval

    def _attach_grammars(self) -> None:
        from vlm_catalog.structured import GrammarError, GrammarState
        from vlm_catalog.structured.compiler import compile_started

        # polled, in arrival order: a done-callback kept its request alive in the cached future
        # after the request ended, and one of an aborted request could take a reused id's entry
        deadline = time.perf_counter() - self.config.grammar_compile_timeout_s
        for request in list(self._awaiting_grammar.values()):
            future = request.grammar_future
            if request.is_finished:
                del self._awaiting_grammar[request.request_id]
            elif future.done():
                del self._awaiting_grammar[request.request_id]
                try:
                    request.grammar = GrammarState(future.result())
                except GrammarError as exc:
                    self.scheduler.finish(request, FinishReason.ERROR, f"{INVALID_CONSTRAINT}: {exc}")
                else:
                    self.scheduler.add(request)
                    self.stats.num_grammars_attached += 1
                    self.stats.seconds_awaiting_grammars += time.perf_counter() - request.metrics.arrival_time
            else:  # compiling, or waiting for a compile thread: the timeout counts from the compile's start
                started = compile_started(future, otherwise=request.metrics.arrival_time)
                if started is not None and started < deadline:
                    del self._awaiting_grammar[request.request_id]
                    self.scheduler.finish(request, FinishReason.ERROR, "compiling the output constraint timed out")

    def _drop_failed_image_chunks(self, output: SchedulerOutput, failures: dict[str, str]):
        if not failures:
            return output.chunks
        kept = []
        for chunk in output.chunks:
            failed = [failures[h] for h in chunk.request.image_hashes if h in failures]
            if failed:
                self.scheduler.finish(chunk.request, FinishReason.ERROR, failed[0])
            else:
                kept.append(chunk)
        return kept

    def _count_computed(self, chunks) -> None:
        for chunk in chunks:
            if chunk.past_prompt:  # its positions were released when its prompt ended
                self.stats.num_output_tokens_computed += chunk.num_tokens
                continue
            prompt_end = chunk.request.num_prompt_tokens
            prompt_part = min(chunk.end, prompt_end) - chunk.start
            self.stats.num_prompt_tokens_computed += prompt_part
            self.stats.num_output_tokens_computed += chunk.num_tokens - prompt_part
            if chunk.end >= prompt_end:
                chunk.request.prompt.release_positions()

    def _compute_unsampled_tokens_again(self, chunks) -> None:
        """Sampling raised: each request whose chunk was to sample and took no token has its last
        token counted as not computed, so a later step computes it again and samples. Before, such a
        request had nothing left to compute and no token, and waited for ever (so did a loop on
        `has_unfinished_requests`). The stats count that token once, when it is computed again."""
        for chunk in chunks:
            request = chunk.request
            if chunk.samples and not request.is_finished and request.num_computed_tokens == chunk.end == request.num_tokens:
                request.num_computed_tokens -= 1
                if chunk.end <= request.num_prompt_tokens:
                    self.stats.num_prompt_tokens_computed -= 1
                else:
                    self.stats.num_output_tokens_computed -= 1

    def _sample_and_append(self, chunks, logits: torch.Tensor) -> list[Request]:
        """Sample a token for each sampling chunk and take it; with `async_scheduling`, leave
        the tokens on the device as `self._pending` instead (returns the requests that took one).

        A chunk scheduled before the previous step's tokens were read may have lost its
        sample meanwhile: its request finished, or took forced tokens after the one this
        step computed. Its row is dropped."""
        sampling = [chunk for chunk in chunks if chunk.samples]
        kept = [row for row, chunk in enumerate(sampling)
                if not chunk.request.is_finished and chunk.end == chunk.request.num_tokens]
        if len(kept) < len(sampling):
            logits = logits.index_select(0, upload(kept, logits.device, torch.int64))
        requests = [sampling[row].request for row in kept]
        if not requests:
            return []
        constrained = [row for row, request in enumerate(requests) if request.grammar is not None]
        if constrained:
            from vlm_catalog.structured import BitmaskBuffer, BitmaskFiller, apply_bitmask

            if self._bitmasks is None:  # once: pinned host rows and their device copy, the fill threads
                self._bitmasks = BitmaskBuffer(self.config.max_num_seqs, self.grammar_service.vocabulary.mask_size,
                                               logits.device)
                self._bitmask_filler = BitmaskFiller()
            # filled on the CPU while the device still runs this step's forward pass
            # (the runner returns logits without waiting for them), all rows in parallel threads;
            # force_canonical: where the grammar forces a string, only its canonical
            # tokens are allowed, so jump-forward on and off produce the same tokens
            started = time.perf_counter()
            bitmask = self._bitmasks.host(len(requests))
            grammars = [requests[row].grammar for row in constrained]
            self._bitmask_filler.fill(grammars, constrained, bitmask, force_canonical=True)
            filled = time.perf_counter()
            self.stats.seconds_filling_grammar_masks += filled - started
            apply_bitmask(logits, self._bitmasks.device(len(requests)), constrained)
            self.stats.seconds_masking_logits += time.perf_counter() - filled
        params = [request.params for request in requests]
        positions = [request.num_output_tokens for request in requests]
        if self.async_scheduling and all(p.logprobs is None for p in params):
            self._pending = PendingTokens(requests, sample_tokens(logits, params, positions, self.generator))
            for request in requests:
                request.append_placeholder()
            return []
        result = sample(logits, params, positions, self.generator)
        for request, token, logprobs in zip(requests, result.token_ids, result.logprobs):
            self._take_sampled(request, token, logprobs)
        return requests

    def _take_pending(self, pending: PendingTokens) -> list[Request]:
        """Put the previous step's sampled tokens in place of their placeholders and take them."""
        taken = []
        for request, token in zip(pending.requests, pending.read()):
            if request.is_finished:  # aborted meanwhile
                request.resolve_placeholder(None)
                continue
            request.resolve_placeholder(token)
            self._take_sampled(request, token, None, appended=True)
            taken.append(request)
        return taken

    def _take_sampled(self, request: Request, token: int, logprobs: dict | None, appended: bool = False) -> None:
        """Take a sampled token (already in `token_ids` if `appended`), then any the grammar forces."""
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.perf_counter()
        request.metrics.num_model_steps += 1
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        self.stats.num_sampled_tokens += 1
        self._take_tokens(request, [token], appended)
        # a request that reports logprobs samples every token, so each has its entry (forced ones too)
        if not request.is_finished and self.jump_forward and request.grammar is not None and request.params.logprobs is None:
            forced = request.grammar.forced_tokens()[: request.max_total_tokens - request.num_tokens]
            if forced:
                request.metrics.num_jump_forward_tokens += len(forced)
                self.stats.num_jump_forward_tokens += len(forced)
                self._take_tokens(request, forced)

    def _take_tokens(self, request: Request, tokens: list[int], appended: bool = False) -> None:
        """Append tokens (sampled or forced; `appended`: they already are) and finish the request
        if they end it."""
        if not appended:
            request.append_tokens(tokens)
        grammar_finished = False
        if request.grammar is not None:
            started = time.perf_counter()
            request.grammar.accept(tokens)
            grammar_finished = request.grammar.is_finished()
            self.stats.seconds_advancing_grammars += time.perf_counter() - started
        params = request.params
        last = tokens[-1]
        reason = None
        if grammar_finished:
            reason = FinishReason.STOP
        elif last in self.eos_token_ids and not params.ignore_eos:
            reason = FinishReason.STOP
        elif last in params.stop_token_ids:
            reason = FinishReason.STOP
        elif params.stop and self.detokenizers[request.request_id].update(request.output_token_ids):
            reason = FinishReason.STOP
        elif request.num_tokens >= request.max_total_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(request, reason)

    # -------------------------------------------------------------- outputs
    def _collect_outputs(self, touched: list[Request]) -> list[RequestOutput]:
        outputs = [
            self._output(request)
            for request in touched
            if not request.is_finished and request.params.output_kind == "cumulative"
        ]
        finished = self.scheduler.drain_finished()
        outputs.extend(self._output(request) for request in finished)
        # forgotten only once every output is built: where building one raised, a finished request
        # forgotten before it was in no one's hands (`abort_all` did not drop it, no output carried it)
        for request in finished:
            del self.detokenizers[request.request_id]
            self.requests.pop(request.request_id, None)
        self.stats.num_finished += len(finished)
        return outputs

    def _output(self, request: Request) -> RequestOutput:
        """The request's output so far; a finished request's last one."""
        finished = request.is_finished
        detokenizer = self.detokenizers[request.request_id]
        token_ids = request.output_token_ids  # a copy: the output keeps it
        if finished:
            detokenizer.finish(token_ids)
        elif not request.params.stop:  # with stop strings the text is kept current (and cut) as tokens come
            detokenizer.update(token_ids)
        delta_text = detokenizer.delta(final=finished)
        output = RequestOutput(
            request_id=request.request_id,
            text=detokenizer.text if finished else detokenizer.shown,  # not what may yet be cut
            token_ids=token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            finished=finished,
            delta_text=delta_text,
        )
        if finished:
            output.finish_reason = request.finish_reason.value if request.finish_reason else None
            output.error = request.error
            output.logprobs = request.output_logprobs or None
            output.metrics = request.metrics.as_dict()
        return output

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self.runner.close()
        if self._grammar_service is not None:
            self._grammar_service.close()

    def load_stats(self) -> dict[str, float]:
        """Current load, read-only (for metrics): requests running and waiting, KV blocks held by
        live requests over all blocks, and the prefix cache's hit ratio over all lookups so far."""
        manager = self.block_manager
        queried = manager.stats["queried_blocks"]
        used = self.num_blocks - manager.num_free_blocks  # blocks with a reference count > 0
        return {
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting) + len(self._awaiting_grammar),
            "kv_blocks_used": used,
            "kv_blocks_total": self.num_blocks,
            "kv_capacity_tokens": self.num_blocks * self.config.block_size,
            "kv_cache_usage_ratio": used / self.num_blocks,
            "prefix_cache_hit_ratio": manager.stats["hit_blocks"] / queried if queried else 0.0,
        }

    def cache_stats(self) -> dict[str, Any]:
        manager = self.block_manager
        return {
            "prefix_cache_hit_blocks": manager.stats["hit_blocks"],
            "prefix_cache_queried_blocks": manager.stats["queried_blocks"],
            "kv_blocks_total": self.num_blocks,
            "kv_capacity_tokens": self.num_blocks * self.config.block_size,
            "kv_cache_dtype": str(self.config.torch_kv_cache_dtype).removeprefix("torch."),
            "kv_blocks_free": manager.num_free_blocks,
            "encoder_cache_hits": self.encoder_cache.hits,
            "encoder_cache_misses": self.encoder_cache.misses,
            "images_encoded": self.runner.num_images_encoded,
            # the profiling pass that sized the KV pool (CUDA); None when it was not profiled
            "memory_profile": self.memory_budget.as_dict() if self.memory_budget is not None else None,
            # the start-up warm-up (engine/warmup.py); None when it did not run
            "warmup": asdict(self.warmup_report) if self.warmup_report is not None else None,
        }


def check_device_present(device: torch.device) -> None:
    """`EngineConfigError` for a CUDA device this process cannot use (a CPU-only torch build, no GPU
    visible, an index past the last GPU), before anything touches it."""
    if device.type != "cuda":
        return
    if torch.version.cuda is None:
        raise EngineConfigError(
            f"device {device}: this torch {torch.__version__} is a CPU-only build; install a CUDA build "
            "of torch (README: on a GPU machine) or use the cpu device"
        )
    if not torch.cuda.is_available():
        raise EngineConfigError(f"device {device}: no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise EngineConfigError(f"device {device}: this machine shows {count} GPU(s), cuda:0 to cuda:{count - 1}")


def eos_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """The tokens that end an answer: generation_config.json's `eos_token_id` plus the tokenizer's."""
    ids = set()
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.is_file():
        try:
            eos = json.loads(generation_config.read_bytes()).get("eos_token_id")
        except (ValueError, AttributeError) as exc:  # not JSON (a download cut short), or not an object
            raise ModelConfigError(f"{generation_config}: not a JSON object ({exc})") from None
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
