"""Decides each engine step: which sequences prefill (in chunks), which decode, which leave."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from reflow.errors import NotFound, ResourceExhausted
from workers.sequence import Delta, Sequence


@dataclass(eq=False)
class Request:
    """One sequence in the engine: its decoding state, KV slot and progress through the prompt."""

    sequence: Sequence
    generator: torch.Generator
    deliver: Any  # where its deltas go; opaque to the scheduler
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the KV cache
    next_input: int | None = None  # the sampled token the next decode step feeds in
    cancelled: bool = False
    enqueued_at: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0
    last_token_at: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.sequence.prompt_ids)


Output = tuple[Request, Delta | BaseException]  # what a step gives one request: a delta or its failure


@dataclass
class StepPlan:
    """What one step runs: prompt chunks to prefill and sequences to decode by one token."""

    prefill: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, start, end)
    decode: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    """FIFO admission into a fixed pool of KV slots, with a bounded waiting queue.

    Thread-safe: requests arrive from the event loop, steps are planned on the engine thread.
    """

    def __init__(self, n_slots: int, max_waiting: int, prefill_chunk: int, max_prefill_tokens: int):
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens
        self._free_slots = list(range(n_slots - 1, -1, -1))
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._closed = False  # the version was unloaded: running ones finish, nothing new joins
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        """Requests not yet holding a slot."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return len(self._running)

    def has_work(self) -> bool:
        """True when a step would do something."""
        return bool(self._waiting or self._running)

    def submit(self, request: Request) -> None:
        """Queues a request; ResourceExhausted with a retry hint when the queue is full."""
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
        """Retires cancelled requests, admits waiting ones into free slots, plans the step."""
        with self._lock:
            self._waiting = deque(r for r in self._waiting if not r.cancelled)
            for request in [r for r in self._running if r.cancelled]:
                self._release(request)
            while self._waiting and self._free_slots:
                request = self._waiting.popleft()
                request.slot = self._free_slots.pop()
                request.admitted_at = time.perf_counter()
                self._running.append(request)
            plan = StepPlan()
            budget = self.max_prefill_tokens
            for request in self._running:
                if request.prefilled < request.prompt_len:
                    # Chunk boundaries depend on the request alone (never on the budget left),
                    # so a prompt prefills the same way in any batch mix and stays bit-exact.
                    end = min(request.prompt_len, request.prefilled + self.prefill_chunk)
                    if end - request.prefilled > budget and plan.prefill:
                        continue  # next step; the first chunk of a step always runs
                    plan.prefill.append((request, request.prefilled, end))
                    budget -= end - request.prefilled
                elif request.next_input is not None:
                    plan.decode.append(request)
            return plan

    def close(self) -> None:
        """Refuses new requests; the ones already here run to their end."""
        with self._lock:
            self._closed = True

    def take_all(self) -> list[Request]:
        """Removes every request (running and waiting), for failing them after an engine error."""
        with self._lock:
            requests = [*self._running, *self._waiting]
            for request in self._running:
                self._free_slots.append(request.slot)
                request.slot = -1
            self._running.clear()
            self._waiting.clear()
            return requests

    def finish(self, request: Request) -> None:
        """Frees a finished request's slot."""
        with self._lock:
            if request in self._running:
                self._release(request)

    def _release(self, request: Request) -> None:
        self._running.remove(request)
        self._free_slots.append(request.slot)
        request.slot = -1
