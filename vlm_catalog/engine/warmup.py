"""Start-up warm-up: run dummy requests through the step loop before serving.

On CUDA the first step at a new shape pays for Triton compiling (and
autotuning) each kernel variant it needs: the fused MoE has a config per
token-count bucket (`kernels/moe/configs.py`), and Triton specialises integer
arguments by whether they are 1 or multiples of 16. On the H100 the first
engine run of a process took 38.7 s against 30.2 s warm (docs/benchmarks.md),
and a service would otherwise show that as slow first requests.

`warm_up` sends, one at a time, a text-only request per step size a serving
step can take (`warmup_token_counts`: each token bucket up to
`max_num_batched_tokens`, at a multiple of 16 and one below it), then a few
requests together (a prefill with decodes in the same step, an image, seeded
sampling with the top-k/top-p filters, a constrained one). Each generates two
or four tokens, so decode steps (graph replays or eager) run too.

Where FlashAttention 2 is the varlen call (`kernels/flash_varlen.py`), a step's attention
leaves its long sequences to SDPA and the short ones of the same call to a Triton kernel:
images of `SDPA_MIN_SEGMENT_LEN` patches or more beside smaller ones in the vision tower, whole
prompts of `SDPA_MIN_PREFILL_LEN` tokens or more beside shorter ones in the decoder. Those
kernels run in no other step, so a large image joins the requests together, and a long
prompt arrives with a short one (under 32 tokens: the kernel's smaller tile). On an engine
whose steps or KV pool are too small for them they are left out.

Afterwards the engine is as if it had just started: the requests are finished
and their blocks free, the prefix cache and encoder cache are empty, the
counters are zero and the engine's generator is re-seeded, so greedy and seeded
answers are the same with or without the warm-up.
"""

from __future__ import annotations

import io
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from PIL import Image

from kernels.moe.configs import TOKEN_BUCKETS
from kernels.paged_prefill_attention import SDPA_MIN_PREFILL_LEN
from kernels.varlen_attention import SDPA_MIN_SEGMENT_LEN
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.preprocess.processor import ProcessedPrompt

if TYPE_CHECKING:
    from vlm_catalog.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

WARMUP_ID_PREFIX = "warmup-"
WARMUP_IMAGE_SIZE = (640, 480)  # (width, height): a catalogue-photo size, a few hundred image tokens
# 4800 patches of 16 px, past SDPA_MIN_SEGMENT_LEN (module doc); about 1200 image tokens
WARMUP_LARGE_IMAGE_SIZE = (1280, 960)
SHORT_PROMPT_TOKENS = 16  # beside a long prompt: the prefill kernel's tile for queries of up to 32 rows
# tokens each single request generates: the prefill samples one, a decode step the other
SINGLE_MAX_TOKENS = 2
MIXED_MAX_TOKENS = 4


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    token_counts: tuple[int, ...]  # the single-request prefill sizes run
    num_requests: int
    num_steps: int
    num_images_encoded: int


def warmup_token_counts(max_num_batched_tokens: int, max_prompt_tokens: int) -> list[int]:
    """Prompt lengths, one request each, that make prefill steps of every token bucket up to
    the largest step: per bucket b its multiple-of-16 variant (b, or the largest multiple of 16
    in the bucket) and one not a multiple of 16, when the bucket holds them. `max_prompt_tokens`
    caps them (the model length and the KV pool). Ascending, no duplicates."""
    largest = min(max_num_batched_tokens, max_prompt_tokens)
    counts: set[int] = set()
    previous = 0
    # past the table the last bucket's config runs: the step's own size closes the list
    for bucket in (*TOKEN_BUCKETS, largest):
        low, high = previous + 1, min(bucket, largest)  # the token counts that use this bucket's config
        previous = bucket
        if low > high:
            break
        aligned = high - high % 16
        counts.add(aligned if aligned >= low else high)
        unaligned = high if high % 16 else high - 1
        if unaligned >= low:
            counts.add(unaligned)
    return sorted(counts)


def warm_up(engine: LLMEngine) -> WarmupReport:
    """Run the warm-up requests on `engine` (module doc) and leave it as if just started."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up runs on an idle engine; requests are queued or running")
    started = time.perf_counter()
    config = engine.config
    # a request needs room for its prompt and outputs, in the model length and in the KV pool
    room = min(config.max_model_len, engine.num_blocks * config.block_size) - MIXED_MAX_TOKENS
    counts = warmup_token_counts(config.max_num_batched_tokens, room)
    prompts = _PromptMaker(engine)
    greedy = SamplingParams(max_tokens=SINGLE_MAX_TOKENS, ignore_eos=True, output_kind="final_only")
    num_requests = 0
    for count in counts:
        engine.add_request(prompts.text(count), greedy, request_id=f"{WARMUP_ID_PREFIX}{num_requests}")
        num_requests += 1
        _run_until_idle(engine)
    num_requests = _warm_up_mixed(engine, prompts, num_requests, room)
    num_requests = _warm_up_long_beside_short(engine, prompts, num_requests, room)
    num_steps = engine.stats.num_steps  # model steps (not the empty ones waiting for the grammar)
    num_images = engine.runner.num_images_encoded
    _forget(engine)
    report = WarmupReport(time.perf_counter() - started, tuple(counts), num_requests, num_steps, num_images)
    logger.info(
        "warm-up: %d requests, %d steps in %.1f s (prefill sizes %s)",
        report.num_requests, report.num_steps, report.seconds, list(report.token_counts),
    )
    return report


def _warm_up_mixed(engine: LLMEngine, prompts: _PromptMaker, num_requests: int, room: int) -> int:
    """Requests that share steps: one is decoding when the others arrive, so a step holds a
    decode and prefills; one shows an image, one samples (seeded, top-k/top-p), one is
    constrained. Returns the request count so far."""
    length = max(1, min(64, room))
    decoding = SamplingParams(max_tokens=MIXED_MAX_TOKENS, ignore_eos=True, output_kind="final_only")
    engine.add_request(prompts.text(length), decoding, request_id=f"{WARMUP_ID_PREFIX}{num_requests}")
    num_requests += 1
    engine.step()  # its prefill: it decodes in the next steps
    arrivals: list[tuple[list[dict] | ProcessedPrompt, SamplingParams]] = [
        (prompts.text(min(length + 37, room)), decoding),
        (prompts.text(length), SamplingParams(max_tokens=MIXED_MAX_TOKENS, ignore_eos=True, temperature=0.7,
                                              top_k=20, top_p=0.8, seed=0, output_kind="final_only")),
        (prompts.text(length), SamplingParams(max_tokens=MIXED_MAX_TOKENS, choice=["yes", "no"],
                                              output_kind="final_only")),
    ]
    image = prompts.image(WARMUP_IMAGE_SIZE)
    if image is not None and image.num_tokens + MIXED_MAX_TOKENS <= room:
        arrivals.append((image, decoding))
        large = prompts.image(WARMUP_LARGE_IMAGE_SIZE)
        # only where the processor leaves it past SDPA's threshold, and one step holds it with the rest
        if (large is not None and _patches(large) >= SDPA_MIN_SEGMENT_LEN and large.num_tokens + MIXED_MAX_TOKENS <= room
                and sum(p.num_tokens for p, _ in arrivals) + large.num_tokens <= engine.config.max_num_batched_tokens):
            arrivals.append((large, decoding))
    for prompt, params in arrivals:
        engine.add_request(prompt, params, request_id=f"{WARMUP_ID_PREFIX}{num_requests}")
        num_requests += 1
    _run_until_idle(engine)
    return num_requests


def _warm_up_long_beside_short(engine: LLMEngine, prompts: _PromptMaker, num_requests: int, room: int) -> int:
    """A prompt of `SDPA_MIN_PREFILL_LEN` tokens and one of `SHORT_PROMPT_TOKENS` in the same step
    (module doc), where the step and the pool have room for both. Returns the request count so far."""
    length = SDPA_MIN_PREFILL_LEN
    if length + SHORT_PROMPT_TOKENS > min(room, engine.config.max_num_batched_tokens):
        return num_requests
    greedy = SamplingParams(max_tokens=SINGLE_MAX_TOKENS, ignore_eos=True, output_kind="final_only")
    for prompt_length in (length, SHORT_PROMPT_TOKENS):
        engine.add_request(prompts.text(prompt_length), greedy, request_id=f"{WARMUP_ID_PREFIX}{num_requests}")
        num_requests += 1
    _run_until_idle(engine)
    return num_requests


def _patches(prompt: ProcessedPrompt) -> int:
    """The vision tower's rows (patches) for the prompt's images: t x h x w of each grid."""
    return sum(math.prod(image.grid_thw) for image in prompt.images)


def _run_until_idle(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        steps_before = engine.stats.num_steps
        for output in engine.step():
            if output.finished and output.error:  # a warm-up request must not fail: the engine would not serve
                raise RuntimeError(f"warm-up request {output.request_id} failed: {output.error} "
                                   "(EngineConfig(warmup=False), --warmup off, starts without the warm-up)")
        if engine.stats.num_steps == steps_before:  # only a grammar still compiling: let its thread run
            time.sleep(0.001)


class _PromptMaker:
    """Text prompts of exact lengths from ordinary tokens (random, so no two share a cached
    prefix), and a chat prompt with one synthetic image."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        special = set(getattr(engine.tokenizer, "all_special_ids", []))
        config = engine.model_config
        special.update(t for t in (config.image_token_id, getattr(config, "video_token_id", None)) if t is not None)
        vocab = min(config.text.vocab_size, len(engine.tokenizer))
        self.ordinary = torch.tensor([t for t in range(vocab) if t not in special])  # [n] int64
        self.generator = torch.Generator().manual_seed(0)

    def text(self, length: int) -> ProcessedPrompt:
        picks = torch.randint(0, len(self.ordinary), (length,), generator=self.generator)
        return ProcessedPrompt(token_ids=self.ordinary[picks].tolist(), images=[], image_spans=[])

    def image(self, size: tuple[int, int]) -> ProcessedPrompt | None:
        """A chat prompt with a noise JPEG of `size` (width, height); None if the processor cannot
        make one."""
        width, height = size
        pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=self.generator)
        buffer = io.BytesIO()
        Image.fromarray(pixels.numpy()).save(buffer, format="JPEG")
        messages = [{"role": "user", "content": [
            {"type": "image", "image": buffer.getvalue()},
            {"type": "text", "text": "Describe the product."},
        ]}]
        try:
            return self.engine.processor.process(messages)
        except ValueError as exc:  # e.g. a chat template without images
            logger.warning("warm-up: no image request (%s)", exc)
            return None


def _forget(engine: LLMEngine) -> None:
    """Leave the engine as if it had just started (module doc)."""
    from vlm_catalog.engine.llm_engine import EngineStats

    engine.stats = EngineStats()
    engine.block_manager.reset_prefix_cache()
    engine.block_manager.reset_stats()
    engine.encoder_cache.reset()
    engine.runner.reset_counters()
    engine.generator.manual_seed(engine.config.seed)
