"""Decides each engine step: which sequences prefill (in chunks), which decode (and the tokens drafted
for each to check, workers/speculation.py), which leave, and which KV blocks each holds.

A request is admitted, first come first served, when a batch row is free and the pool can cover
the blocks it could ever need (prompt plus `max_tokens`, within the context); it takes them one at
a time as it grows and gives them all back when it ends. Reserving the worst case means a running
sequence never has to be preempted and recomputed (vLLM's way when its blocks run out): outputs
stay bit-exact, and the price is that a request asking for far more tokens than it will produce
may wait while blocks sit unused.

A request whose prompt starts with blocks another prompt prefilled maps them (workers/block_pool.py)
and prefills only the rest. Prefill chunks end at multiples of the chunk size, counted from the
prompt's start, so a prompt that reuses a multiple of the chunk runs the very forwards it would have
run without the cache.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from reflow.errors import NotFound, ResourceExhausted
from workers.block_pool import BlockPool, block_hashes
from workers.grammar import Constraint
from workers.sampling import TokenLogprob
from workers.sequence import Delta, Sequence
from workers.speculation import PromptLookup

# The most rows a step's decode forward takes drafts up to. Drafts are for a few streams, whose step
# is mostly reading the weights: on 2 cores of an AMD EPYC a SmolLM2-135M step took 61 ms at 1 row
# and 73 at 8 in float32, 13.7 and 28 ms in int4. With 8 sequences decoding the batch fills the
# forward itself and a draft row would take the place of another sequence's.
SPECULATIVE_ROWS = 8


@dataclass(eq=False)
class Request:
    """One sequence in the engine: its decoding state, KV blocks and progress through the prompt."""

    sequence: Sequence
    generator: torch.Generator
    deliver: Any  # where its deltas go; opaque to the scheduler
    adapter: str = ""  # the adapter version its rows go through; "" = the base weights alone
    cache_salt: str = ""  # it reuses only the cached blocks of requests with the same salt
    blocks: list[int] = field(default_factory=list)  # its block table: KV blocks in token order
    prefilled: int = 0  # prompt tokens already in the KV cache
    prefix: list[bytes] = field(default_factory=list)  # hashes of its prompt's full blocks
    next_input: int | None = None  # the sampled token the next decode step feeds in
    draft: list[int] = field(default_factory=list)  # tokens the step's decode checks after next_input
    lookup: PromptLookup | None = None  # where its drafts come from (made when it first may draft)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # as its prompt is prefilled, if asked
    constraint: Constraint | None = None  # where its answer is in the grammar it is held to, if any
    cancelled: bool = False
    enqueued_at: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0
    last_token_at: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.sequence.prompt_ids)

    @property
    def most_tokens(self) -> int:
        """The most tokens its keys and values may ever take: prompt plus completion, in context."""
        s = self.sequence
        return min(self.prompt_len + s.params.max_tokens, s.max_len)


Output = tuple[Request, Delta | BaseException]  # what a step gives one request: a delta or its failure


def hit_rate(cached_tokens: int, prompt_tokens: int) -> float:
    """The share of prompt tokens the prefix cache held; 0 before any prompt."""
    return cached_tokens / prompt_tokens if prompt_tokens else 0.0


@dataclass
class StepPlan:
    """What one step runs: prompt chunks to prefill and sequences to decode, each by one token and
    the tokens drafted for it (`Request.draft`) that the model picks too."""

    prefill: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, start, end)
    decode: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class BatchScheduler:
    """FIFO admission into a pool of KV blocks and batch rows, with a bounded waiting queue.

    Thread-safe: requests arrive from the event loop, steps are planned on the engine thread.
    """

    def __init__(
        self,
        *,
        max_running: int,
        max_waiting: int,
        prefill_chunk: int,
        max_prefill_tokens: int,
        n_blocks: int,
        block_size: int,
        prefix_cache: bool = True,
        speculative_tokens: int = 0,
    ):
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens
        self.block_size = block_size
        self.n_blocks = n_blocks - 1  # usable: the scratch block is never handed out
        self.prefix_cache = prefix_cache
        self.speculative_tokens = speculative_tokens  # most tokens drafted per sequence and step
        self._pool = BlockPool(n_blocks)
        self.prompt_tokens = 0  # over admitted requests
        self.cached_tokens = 0  # of those, reused from the prefix cache
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._closed = False  # the version was unloaded: running ones finish, nothing new joins
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        """Requests not yet admitted."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests admitted (prefilling or decoding)."""
        return len(self._running)

    @property
    def blocks_used(self) -> int:
        """KV blocks sequences hold now (cached ones nobody holds are free to take)."""
        return self.n_blocks - self._pool.available

    @property
    def blocks_cached(self) -> int:
        """KV blocks holding a prompt prefix for reuse, held or not."""
        return self._pool.cached

    @property
    def hit_rate(self) -> float:
        """Prompt tokens reused from the prefix cache / prompt tokens, over admitted requests."""
        return hit_rate(self.cached_tokens, self.prompt_tokens)

    def has_work(self) -> bool:
        """True when a step would do something."""
        return bool(self._waiting or self._running)

    def uses_adapter(self, version: str) -> bool:
        """True while a running or waiting request goes through adapter `version`."""
        with self._lock:
            return any(r.adapter == version for r in (*self._running, *self._waiting))

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def submit(self, request: Request) -> None:
        """Queues a request; ResourceExhausted with a retry hint when the queue is full."""
        # the keys differ through an adapter: never shared with the base; a prompt whose log
        # probabilities are asked for is computed whole
        if self.prefix_cache and not request.sequence.params.prompt_logprobs:
            salt = f"{request.adapter}\0{request.cache_salt}"
            request.prefix = block_hashes(request.sequence.prompt_ids, self.block_size, salt)
        with self._lock:
            if self._closed:
                raise NotFound("the version was unloaded from this worker just now")
            if len(self._waiting) >= self.max_waiting:
                self._waiting = deque(r for r in self._waiting if not r.cancelled)
            if len(self._waiting) >= self.max_waiting:
                raise ResourceExhausted(
                    f"this worker has {len(self._waiting)} requests waiting, its limit; retry shortly "
                    "or add workers",
                    retry_after_ms=250,
                )
            self._waiting.append(request)

    def schedule(self) -> StepPlan:
        """Retires cancelled requests, admits waiting ones the pool can cover, plans the step and
        gives each planned sequence the blocks its new tokens go to."""
        with self._lock:
            self._waiting = deque(r for r in self._waiting if not r.cancelled)
            for request in [r for r in self._running if r.cancelled]:
                self._release(request)
            while self._waiting and len(self._running) < self.max_running:
                head = self._waiting[0]
                promised = sum(self.blocks_for(r.most_tokens) - len(r.blocks) for r in self._running)
                # the last prompt token is always computed: its logits give the first output token
                hits = self._pool.match(head.prefix[: (head.prompt_len - 1) // self.block_size])
                needed = self.blocks_for(head.most_tokens) - len(hits) + self._pool.idle_among(hits)
                if needed > self._pool.available - promised:
                    break  # first come, first served: the head waits for blocks to come back
                self._admit(self._waiting.popleft(), hits)
            plan = StepPlan()
            budget = self.max_prefill_tokens
            for request in self._running:
                if request.prefilled < request.prompt_len:
                    # Chunk boundaries depend on the request alone (never on the budget left),
                    # so a prompt prefills the same way in any batch mix and stays bit-exact.
                    chunk_end = (request.prefilled // self.prefill_chunk + 1) * self.prefill_chunk
                    end = min(request.prompt_len, chunk_end)
                    if end - request.prefilled > budget and plan.prefill:
                        continue  # next step; the first chunk of a step always runs
                    self._grow(request, end)
                    plan.prefill.append((request, request.prefilled, end))
                    budget -= end - request.prefilled
                elif request.next_input is not None:
                    plan.decode.append(request)
            rows_left = SPECULATIVE_ROWS - len(plan.decode)
            for request in plan.decode:
                request.draft = self._draft(request, rows_left)
                rows_left -= len(request.draft)
                self._grow(request, request.sequence.total_len + len(request.draft))
            return plan

    def _draft(self, request: Request, rows_left: int) -> list[int]:
        """The tokens a decoding request's step checks after its next input (workers/speculation.py):
        within the step's rows left and the tokens its blocks were reserved for, so that even with
        all of them kept (one more comes from the last row) it ends within `most_tokens`."""
        sequence = request.sequence
        most = min(self.speculative_tokens, rows_left, request.most_tokens - sequence.total_len - 1)
        if most <= 0:
            return []
        if request.lookup is None:
            request.lookup = PromptLookup(sequence.prompt_ids, request.most_tokens)
        draft = request.lookup.draft(sequence.output_ids, most)
        return draft if request.constraint is None else request.constraint.usable_draft(sequence, draft)

    def _admit(self, request: Request, hits: list[int]) -> None:
        """Runs a request, its prompt's cached prefix (`hits`) mapped."""
        self._pool.hold(hits)
        request.admitted_at = time.perf_counter()
        request.blocks = hits
        request.prefilled = request.sequence.cached_tokens = len(hits) * self.block_size
        self.prompt_tokens += request.prompt_len
        self.cached_tokens += request.prefilled
        self._running.append(request)

    def _grow(self, request: Request, tokens: int) -> None:
        """Takes blocks until `request` holds room for `tokens` tokens (reserved at admission)."""
        while len(request.blocks) * self.block_size < tokens:
            request.blocks.append(self._pool.take())

    def prefilled(self, request: Request, end: int) -> None:
        """After a forward wrote the keys and values of `request`'s prompt up to `end`: its full
        blocks among them are cached for the prompts that start the same way."""
        with self._lock:
            for index in range(
                request.prefilled // self.block_size, min(end // self.block_size, len(request.prefix))
            ):
                self._pool.register(request.blocks[index], request.prefix[index])
            request.prefilled = end

    def close(self) -> None:
        """Refuses new requests; the ones already here run to their end."""
        with self._lock:
            self._closed = True

    def take_all(self) -> list[Request]:
        """Removes every request (running and waiting), for failing them after an engine error,
        and empties the prefix cache (on CUDA a forward's error can surface steps later)."""
        with self._lock:
            requests = [*self._running, *self._waiting]
            for request in list(self._running):
                self._release(request)
            self._waiting.clear()
            self._pool.forget()
            return requests

    def finish(self, request: Request) -> None:
        """Gives a finished request's blocks back."""
        with self._lock:
            if request in self._running:
                self._release(request)

    def _release(self, request: Request) -> None:
        self._running.remove(request)
        self._pool.release(request.blocks)
        request.blocks = []
