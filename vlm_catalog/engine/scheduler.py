"""Continuous batching with chunked prefill and preemption by recompute.

Each step the scheduler picks, within `max_num_batched_tokens` and
`max_num_seqs`, how many uncomputed tokens of which requests to run:

1. Running requests first, in admission order. A decode takes one token; an
   unfinished prefill takes as much of its remaining prompt as the budget
   leaves (chunked prefill: long prompts spread over steps while decodes keep
   running). If the KV pool cannot hold a request's new tokens, the most
   recently admitted running request is preempted (its blocks freed, its
   computed tokens forgotten, its generated tokens kept) and goes back to the
   front of the queue; when rescheduled it recomputes everything it had.
2. Then waiting requests, in policy order (FCFS, or shortest prompt first),
   reusing prefix-cache hits, while the budget, the sequence limit and the
   pool allow. Nothing new is admitted in a step that preempted.

The output is plain data (`SchedulerOutput`); the model runner reads it and
never touches the allocator.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from vlm_catalog.engine.block_manager import BlockManager
from vlm_catalog.engine.request import FinishReason, Request, RequestStatus
from vlm_catalog.engine.waiting_queue import WaitingQueue
from vlm_catalog.preprocess.image import ImageProbe


@dataclass
class ScheduledChunk:
    """Compute `num_tokens` tokens of `request`, from token index `start`."""

    request: Request
    start: int
    num_tokens: int
    # the request's blocks, covering start + num_tokens tokens: the block manager's own list
    # (no per-step copy; `BlockTableRows` knows a request's rows by it), valid for this step
    block_table: list[int]
    samples: bool  # the chunk reaches the request's last token: a new token is sampled

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def past_prompt(self) -> bool:
        """Only generated tokens (a decode, or outputs recomputed after a preemption): no prompt
        position or image in reach."""
        return self.start >= self.request.num_prompt_tokens

    @property
    def is_decode(self) -> bool:
        """One generated token that samples the next: the runner gives every decode a logits row.
        A one-token chunk of the prompt, or of a preempted request's recomputed outputs that stops
        short of its last token (the token budget cut it), is a prefill chunk: it samples nothing."""
        return self.num_tokens == 1 and self.past_prompt and self.samples


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # running requests first
    preempted: list[str] = field(default_factory=list)  # request ids preempted this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue(policy)  # in policy order (engine/waiting_queue.py)
        self.running: list[Request] = []
        self.finished: list[Request] = []  # finished since the last `drain_finished`

    # ------------------------------------------------------------- admission
    def add(self, request: Request) -> None:
        self.waiting.add(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def drain_finished(self) -> list[Request]:
        finished, self.finished = self.finished, []
        return finished

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = min(request.num_uncomputed_tokens, budget)
            if request.has_placeholder and request.num_tokens >= request.max_total_tokens:
                num_tokens = 0  # its last token is sampled (async scheduling): it ends when the host reads it
            if num_tokens <= 0:
                index += 1
                continue
            while not self.block_manager.allocate(request.request_id, request.num_computed_tokens + num_tokens):
                if len(self.running) == 1:  # alone and still too big: the pool can never hold it
                    self._fail_too_large(request, request.num_computed_tokens + num_tokens)
                    break
                victim = self.running[-1]
                self._preempt(victim)
                output.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                output.chunks.append(self._chunk(request, num_tokens))
                scheduled.add(request.request_id)
                budget -= num_tokens
                index += 1
                continue
            break  # the request itself was preempted: it was the last running one

        if not output.preempted:
            self._admit_waiting(output, budget)
        return output

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in policy order while budget, sequences and blocks last.

        With prefix caching on, a request whose next uncached block is one that
        a running request is about to compute (the shared system prompt, when
        many requests arrive together) waits for it instead of computing a
        private copy: it is admitted a step later with that block as a cache
        hit. It keeps its place in the queue, and the wait ends once the block
        is computed (or its producer leaves the running set).
        """
        skipped: list[tuple[Request, tuple]] = []  # taken from the queue, not admitted: put back after
        in_flight = self._blocks_in_flight() if self.waiting and self.block_manager.enable_prefix_caching else set()
        # only the front of the queue is looked at: the walk ends when nothing more can be admitted
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request, key = self.waiting.pop()
            if self.block_manager.blocks_needed(request.num_tokens) > self.block_manager.num_blocks:
                self._fail_too_large(request, request.num_tokens)
                continue
            hits: list[int] = []
            if request.num_computed_tokens == 0 and self.block_manager.enable_prefix_caching:
                reusable = self._reusable_hashes(request)
                hits = self._prefix_hits(reusable)
                if len(hits) < len(reusable) and reusable[len(hits)] in in_flight:
                    skipped.append((request, key))  # its next block is being computed: reuse it next step
                    continue
            computed = len(hits) * self.block_manager.block_size
            num_tokens = min(request.num_tokens - computed, budget)
            if not self.block_manager.allocate(request.request_id, computed + num_tokens, hits):
                skipped.append((request, key))
                break  # the pool is full: admit nothing else this step (keeps FCFS fair)
            request.num_computed_tokens = computed
            request.metrics.num_cached_tokens = max(request.metrics.num_cached_tokens, computed)
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.perf_counter()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.chunks.append(self._chunk(request, num_tokens))
            budget -= num_tokens
            if self.block_manager.enable_prefix_caching:
                in_flight.update(request.block_hashes(self.block_manager.block_size)[len(hits):])
        for request, key in skipped:
            self.waiting.put_back(request, key)

    def _blocks_in_flight(self) -> set[bytes]:
        """Hashes of the full blocks running requests have yet to compute."""
        block_size = self.block_manager.block_size
        in_flight: set[bytes] = set()
        for request in self.running:
            if request.num_uncomputed_tokens >= block_size:
                in_flight.update(request.block_hashes(block_size)[request.num_computed_tokens // block_size:])
        return in_flight

    def _reusable_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the full blocks a new request could take from the prefix cache: all but a
        block ending at the last prompt token (that token is computed: its logits are needed)."""
        block_size = self.block_manager.block_size
        return request.block_hashes(block_size)[: (request.num_tokens - 1) // block_size]

    def _prefix_hits(self, reusable: list[bytes]) -> list[int]:
        hits = self.block_manager.cached_prefix(reusable)
        self.block_manager.record_lookup(len(reusable), len(hits))
        return hits

    def _chunk(self, request: Request, num_tokens: int) -> ScheduledChunk:
        return ScheduledChunk(
            request=request,
            start=request.num_computed_tokens,
            num_tokens=num_tokens,
            block_table=self.block_manager.block_table(request.request_id),  # its own list, not a copy
            samples=request.num_computed_tokens + num_tokens == request.num_tokens,
        )

    def _fail_too_large(self, request: Request, num_tokens: int) -> None:
        pool = self.block_manager.num_blocks * self.block_manager.block_size
        self.finish(
            request,
            FinishReason.ERROR,
            f"request needs {num_tokens} tokens of KV cache; the whole pool holds {pool}",
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.waiting.add_front(request)

    def upcoming_images(self) -> Iterator[ImageProbe]:
        """Images the next steps will likely need, soonest first (for prefetching their pixels):
        those of running requests not yet fully computed, then the waiting queue's, in its order."""
        for request in itertools.chain(self.running, self.waiting):
            for image, (start, length) in zip(request.prompt.images, request.prompt.image_spans):
                if start + length > request.num_computed_tokens:
                    yield image

    # --------------------------------------------------------- after a step
    def update_after_step(self, output: SchedulerOutput) -> None:
        """Account the computed tokens and register newly full blocks in the prefix cache."""
        block_size = self.block_manager.block_size
        for chunk in output.chunks:
            request = chunk.request
            if request.is_finished or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = chunk.end
            # only a chunk that fills a block has one to register (a decode does every block_size steps)
            if self.block_manager.enable_prefix_caching and chunk.end // block_size > chunk.start // block_size:
                self.block_manager.cache_full_blocks(
                    request.request_id, request.block_hashes(block_size), request.num_computed_tokens
                )

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """Finish a request (stop, length, abort or error) and release its blocks."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request.request_id)
        request.finish(reason, error)
        self.finished.append(request)
