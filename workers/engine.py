"""The engine core: asks the worker's catalog (workers/residency.py) which copy of a version runs a
request, queues it on that copy's runner (workers/runner.py), and steps every runner on one thread.

A dedicated thread does all torch work, step after step, while any sequence is active; new
requests join at the next step and finished or cancelled ones leave at once. Deltas cross to
the event loop once per step, into each request's coalescing mailbox.

All torch work means building versions too (`Engine.run`): libgomp keeps one team of threads per
thread that runs parallel kernels, and once those outnumber the cores it cuts every thread's
spinning to 100 iterations, so each of a step's ~1,000 kernels waits for sleeping threads to wake.
A version built on a second thread doubled SmolLM2-135M's decode step on 2 cores (38 -> 72 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from reflow.errors import InvalidArgument, NotFound, Unavailable
from reflow.streaming import Mailbox
from workers.batch_scheduler import SPECULATIVE_ROWS, BatchScheduler, Output, Request, hit_rate
from workers.metrics import WorkerMetrics
from workers.models.kv_cache import BLOCK_SIZE
from workers.residency import Copy, Residency, Resident, ResidentAdapter, ResidentVersion, Route
from workers.runner import ModelRunner
from workers.sampling import make_generator
from workers.sequence import Delta, GenerationParams, Sequence

logger = logging.getLogger(__name__)
T = TypeVar("T")

# REFLOW_KV_CACHE_MB=0: room for every batch row at the full context, but never more than this.
AUTO_KV_CACHE_MB = 1024


@dataclass(frozen=True)
class EngineConfig:
    """Batching limits and compilation; see the worker settings in docs/configuration.md."""

    max_batch_size: int = 64
    max_waiting: int = 256
    prefill_chunk: int = 64
    max_prefill_tokens: int = 256
    compile: bool = False
    kv_cache_mb: int = 0  # per loaded version; 0 = auto (see AUTO_KV_CACHE_MB)
    max_model_len: int = 0  # 0 = the model's own context
    prefix_cache: bool = True  # reuse the KV blocks of prompt prefixes (workers/block_pool.py)
    speculative_tokens: int = 5  # most tokens drafted by prompt lookup per sequence and step


class Engine:
    """Holds the worker's residents and runs all their sequences on one torch thread."""

    def __init__(self, config: EngineConfig | None = None, metrics: WorkerMetrics | None = None):
        self.config = config or EngineConfig()
        self.metrics = metrics
        self.residency = Residency()  # what is loaded, and where each request runs
        self._runners: dict[Copy, ModelRunner] = {}  # the runner of each resident copy
        self._draining: list[ModelRunner] = []  # unloaded, still finishing their sequences
        self._lock = threading.Lock()  # guards the catalog's changes, _runners and _draining
        self._wake = threading.Event()
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def run(self, work: Callable[[], T]) -> T:
        """Runs `work` on the engine thread between two steps and returns what it returns (or
        raises what it raised); sequences pause meanwhile. For torch work outside the steps:
        loading a version's weights, allocating its cache (see the module's docstring)."""
        if threading.current_thread() is self._thread:
            return work()
        if not self._thread.is_alive():
            raise Unavailable("this worker's engine has stopped; restart the worker")
        done: Future[object] = Future()
        self._calls.put((work, done))
        self._wake.set()
        while True:
            try:
                return done.result(timeout=1.0)  # type: ignore[return-value]  # what `work` returned
            except TimeoutError:
                if not self._thread.is_alive():  # stopped before it took the call
                    raise Unavailable("this worker's engine has stopped; restart the worker") from None

    def add(self, resident: Resident) -> None:
        """Makes a version or an adapter servable. A version (replacing the same version if it was
        loaded, adapters and all) gets a runner for its reference copy: its cache allocated, and
        its decode step compiled when enabled, on the engine thread. An adapter attaches to its
        base version, which must be loaded, and runs in its reference copy's steps."""
        if isinstance(resident, ResidentAdapter):
            self._attach(resident)
            return
        runner = self.run(lambda: self._new_runner(resident, resident.reference))
        with self._lock:
            self._retire(self.residency.admit(resident))
            self._runners[resident.reference] = runner
        self._observe_capacity()

    def add_variant(self, version: ResidentVersion, copy: Copy) -> None:
        """Serves a variant of a loaded version beside its reference, on a runner and a KV pool of its
        own (replacing the variant of the same name)."""
        runner = self.run(lambda: self._new_runner(version, copy))
        with self._lock:
            if self.residency.get(version.name, version.version) is not version:
                raise NotFound(f"{version.name}/{version.version}, a variant's version, is not loaded")
            replaced = self.residency.add_variant(version, copy)
            if replaced is not None:
                self._retire_copy(replaced)
            self._runners[copy] = runner
        self._observe_capacity()

    def _attach(self, adapter: ResidentAdapter) -> None:
        """Opens an adapter's slot on its base's reference runner, then routes requests to it."""
        with self._lock:
            base = self.residency.get(adapter.name, adapter.base_version)
            runner = self._runners.get(base.reference) if isinstance(base, ResidentVersion) else None
        if runner is None or not isinstance(base, ResidentVersion):
            where = f"{adapter.name}/{adapter.base_version}"
            raise NotFound(f"{where}, the base of an adapter, is not loaded on this worker")
        adapter.base = base  # the version loaded now (it may have been loaded again since)
        self.run(lambda: runner.open_slot(adapter.slot, adapter.adapter))
        with self._lock:
            self.residency.attach(adapter)

    def _new_runner(self, version: ResidentVersion, copy: Copy) -> ModelRunner:
        """A runner for a copy, on a KV pool sized by the config (caps the copy's max_len to it)."""
        config = self.config
        context = min(copy.max_len, config.max_model_len or copy.max_len)  # REFLOW_MAX_MODEL_LEN
        n_blocks = kv_blocks(copy.model.kv_bytes_per_token, context, config)
        copy.max_len = min(context, (n_blocks - 1) * BLOCK_SIZE)  # one sequence always fits the pool
        scheduler = BatchScheduler(
            max_running=config.max_batch_size, max_waiting=config.max_waiting,
            prefill_chunk=config.prefill_chunk, max_prefill_tokens=config.max_prefill_tokens,
            n_blocks=n_blocks, block_size=BLOCK_SIZE, prefix_cache=config.prefix_cache,
            speculative_tokens=config.speculative_tokens,
        )  # fmt: skip
        runner = ModelRunner(version, copy, n_blocks, scheduler, config.compile)
        if config.compile:
            # the largest batch first: compiled at sizes that differ from the blocks read (2), its
            # graph takes every batch; at equal sizes torch would tie them and compile again. Drafts
            # may fill a forward up to SPECULATIVE_ROWS rows, more than a small max_batch_size.
            largest = max(config.max_batch_size, SPECULATIVE_ROWS if config.speculative_tokens else 0)
            runner.warm_up((largest, runner.min_rows))
        return runner

    def remove(self, name: str, version: str) -> bool:
        """Stops serving a version (its variants and adapters with it) or an adapter; its running
        sequences finish on the weights they hold."""
        with self._lock:
            removed = self.residency.remove(name, version)
            if isinstance(removed, ResidentAdapter):
                if (runner := self._runners.get(removed.reference)) is not None:
                    runner.close_slot(removed.slot)
                return True
            self._retire(removed)
        if removed is None:
            return False
        self._observe_capacity()
        if self.metrics is not None:
            self.metrics.forget_version(name, version)
        return True

    def _observe_capacity(self) -> None:
        if self.metrics is not None:
            self.metrics.observe_capacity(self.kv_slots, self.kv_blocks()[1])

    def _retire(self, resident: Resident | None) -> None:
        """Retires the runners of a version taken out of the catalog (under the lock)."""
        if isinstance(resident, ResidentVersion):
            for copy in resident.copies.values():
                self._retire_copy(copy)

    def _retire_copy(self, copy: Copy) -> None:
        runner = self._runners.pop(copy, None)
        if runner is not None:
            runner.scheduler.close()
            self._draining.append(runner)
            self._wake.set()

    def copies(self, name: str, version: str) -> list[tuple[Copy, BatchScheduler]]:
        """The copies a loaded version or adapter runs on, the reference first, each with the
        scheduler of its pool (an adapter's one copy is its base's reference)."""
        resident = self.get(name, version)
        with self._lock:
            return [
                (c, r.scheduler) for c in resident.copies.values() if (r := self._runners.get(c)) is not None
            ]

    def loaded(self) -> list[Resident]:
        """Every servable version, adapters after the version they are served over."""
        return self.residency.residents()

    def find(self, name: str, version: str) -> Resident | None:
        """The loaded version or adapter, or None."""
        return self.residency.get(name, version)

    def get(self, name: str, version: str) -> Resident:
        """The loaded version or adapter; NotFound names what is loaded instead."""
        resident = self.residency.get(name, version)
        if resident is None:
            raise self._not_found(name, version)
        return resident

    def lookup(self, name: str, version: str, copy: str = "") -> Route:
        """The copy a request runs on, and the adapter slot on it (see Residency.lookup); NotFound
        names what is loaded instead."""
        route = self.residency.lookup(name, version, copy)
        if route is None:
            raise self._not_found(name, version, copy)
        return route

    def _serving(self, name: str, version: str, copy: str) -> tuple[ModelRunner, Route]:
        """The runner of the copy a request runs on, and its route; NotFound when either is gone."""
        route = self.lookup(name, version, copy)
        with self._lock:
            runner = self._runners.get(route.copy)
        if runner is None:  # unloaded between the two
            raise NotFound(f"{name}/{version} was unloaded from this worker just now")
        return runner, route

    def _not_found(self, name: str, version: str, copy: str = "") -> NotFound:
        have = ", ".join(f"{m.name}/{m.version}" for m in self.loaded()) or "nothing"
        what = f"{name}/{version}" + (f" variant {copy}" if copy else "")
        return NotFound(f"{what} is not loaded on this worker (loaded: {have})")

    @property
    def running(self) -> int:
        """Sequences holding a KV slot."""
        return self.occupancy()[0]

    @property
    def waiting(self) -> int:
        """Sequences queued for a slot."""
        return self.occupancy()[1]

    def occupancy(self) -> tuple[int, int]:
        """(running, waiting) over every runner, from one snapshot."""
        runners = self._all_runners()
        return sum(r.scheduler.running for r in runners), sum(r.scheduler.waiting for r in runners)

    @property
    def kv_slots(self) -> int:
        """Batch rows over loaded versions (max_batch_size each), draining versions included."""
        return self.config.max_batch_size * len(self._all_runners())

    def kv_blocks(self) -> tuple[int, int]:
        """(held, total) KV blocks over every version's pool, draining versions included."""
        runners = self._all_runners()
        return sum(r.scheduler.blocks_used for r in runners), sum(r.scheduler.n_blocks for r in runners)

    def prefix_cache(self) -> tuple[int, float]:
        """(cached KV blocks, prefix cache hit rate) over every version's pool, draining ones included."""
        pools = [r.scheduler for r in self._all_runners()]
        rate = hit_rate(sum(p.cached_tokens for p in pools), sum(p.prompt_tokens for p in pools))
        return sum(p.blocks_cached for p in pools), rate

    def _all_runners(self) -> list[ModelRunner]:
        with self._lock:
            return [*self._runners.values(), *self._draining]

    async def generate(
        self,
        name: str,
        version: str,
        prompt_ids: list[int],
        params: GenerationParams,
        copy: str = "",
        cache_salt: str = "",
    ) -> AsyncGenerator[Delta]:
        """Streams the deltas of one completion on the copy of the version that `copy` names (its
        reference for ""), reusing the prompt blocks of earlier requests with the same
        `cache_salt`; leaving early frees its slot at the next step."""
        if not self._thread.is_alive():
            raise Unavailable("this worker's engine has stopped; restart the worker")
        runner, route = self._serving(name, version, copy)
        max_len, adapter = route.copy.max_len, route.adapter
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty")
        if len(prompt_ids) >= max_len:
            raise InvalidArgument(
                f"the prompt is {len(prompt_ids)} tokens; model {name}/{version} takes at most {max_len - 1}"
            )
        mailbox: Mailbox[Delta] = Mailbox(Delta.merge)
        loop = asyncio.get_running_loop()
        sequence = Sequence(prompt_ids, params, runner.tokenizer, max_len)
        request = Request(
            sequence, make_generator(params.sampling), (loop, mailbox), adapter=adapter, cache_salt=cache_salt
        )
        if params.grammar is not None:  # compiled off the event loop and the engine thread (it frees the GIL)
            request.constraint = await asyncio.to_thread(runner.grammars.constraint, params.grammar)
        runner.submit(request)
        self._wake.set()
        finished = False
        try:
            while not finished:
                delta = await mailbox.get()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                request.cancelled = True
                self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                self._run_calls()
                with self._lock:
                    self._draining = [r for r in self._draining if r.scheduler.has_work()]
                busy = [r for r in self._all_runners() if r.scheduler.has_work()]
                if not busy:
                    self._wake.wait()
                    continue
                for runner in busy:
                    self._step(runner)
        finally:  # only a bug gets here while serving: nobody may wait for ever
            stopped = Unavailable("this worker's engine has stopped; retry on another worker")
            for runner in self._all_runners():
                _publish([(r, stopped) for r in runner.scheduler.take_all()])
            while not self._calls.empty():
                self._calls.get()[1].set_exception(stopped)

    def _run_calls(self) -> None:
        while not self._calls.empty():
            work, done = self._calls.get()
            try:
                done.set_result(work())
            except BaseException as error:  # the caller gets it
                done.set_exception(error)

    def _step(self, runner: ModelRunner) -> None:
        started = time.perf_counter()
        try:
            outputs = runner.step(self.metrics)
        except Exception as error:  # outside any one sequence: fail this version's sequences, go on
            logger.exception("engine step failed for %s/%s", runner.name, runner.version)
            outputs = [(r, error) for r in runner.scheduler.take_all()]
        if self.metrics is not None:
            self.metrics.observe_outputs(outputs, time.perf_counter() - started)
            self.metrics.observe_occupancy(*self.occupancy(), *self.kv_blocks(), self.prefix_cache()[0])
        _publish(outputs)

    def close(self) -> None:
        """Stops the engine thread after the current step."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)


def _publish(outputs: list[Output]) -> None:
    """Hands each output to its request's mailbox, with one wake-up per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Mailbox[Delta], Delta | BaseException]]]
    by_loop = defaultdict(list)
    for request, output in outputs:
        loop, mailbox = request.deliver
        by_loop[loop].append((mailbox, output))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting there
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[Mailbox[Delta], Delta | BaseException]]) -> None:
    for mailbox, output in items:
        if isinstance(output, BaseException):
            mailbox.fail(output)
        else:
            mailbox.put(output)


def kv_blocks(bytes_per_token: int, context: int, config: EngineConfig) -> int:
    """Blocks in a version's pool, the scratch block included: REFLOW_KV_CACHE_MB's worth, or with
    0 room for every batch row at the full `context`, at most AUTO_KV_CACHE_MB."""
    block_bytes = bytes_per_token * BLOCK_SIZE
    if config.kv_cache_mb:
        usable = config.kv_cache_mb * 2**20 // block_bytes
        if usable < 1:
            raise ValueError(
                f"REFLOW_KV_CACHE_MB={config.kv_cache_mb} holds no {BLOCK_SIZE}-token block of this "
                f"model ({block_bytes / 2**20:.2f} MiB each)"
            )
    else:
        full = config.max_batch_size * -(-context // BLOCK_SIZE)
        usable = min(full, AUTO_KV_CACHE_MB * 2**20 // block_bytes)
    return usable + 1
