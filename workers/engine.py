"""Runs the steps the scheduler plans: one forward over the step's prefill chunks, then one batched
decode over every sequence, all on a paged KV cache sized by REFLOW_KV_CACHE_MB.

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

import torch
from torch import Tensor

from reflow.errors import InvalidArgument, NotFound, Unavailable
from reflow.streaming import Mailbox
from workers.loading import LoadedModel
from workers.metrics import WorkerMetrics
from workers.models.kv_cache import BLOCK_SIZE, CacheView
from workers.models.lora import AdapterRows, AdapterSet
from workers.sampling import make_generator, sample
from workers.scheduler import Output, Request, Scheduler, hit_rate
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


class ModelRunner:
    """One loaded version: its KV block pool, scheduler, and batched decode step (compiled or eager),
    and the LoRA adapters served over its weights: their rows join the same steps and forwards."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig):
        self.loaded = loaded
        self.model = loaded.model
        self.adapters: dict[str, LoadedModel] = {}  # adapter version -> loaded: new requests go there
        self._set = AdapterSet()  # what the forwards apply: served adapters and retiring ones in use
        self._slots: list[str] = []  # adapter version of each slot of _set
        self._adapters_lock = threading.Lock()  # a request never joins an adapter being unstacked
        context = min(loaded.max_len, config.max_model_len or loaded.max_len)  # REFLOW_MAX_MODEL_LEN
        n_blocks = kv_blocks(self.model.kv_bytes_per_token, context, config)
        self.cache = self.model.new_cache(n_blocks)
        loaded.max_len = min(context, (n_blocks - 1) * BLOCK_SIZE)  # one sequence always fits the pool
        self.scheduler = Scheduler(
            config.max_batch_size, config.max_waiting, config.prefill_chunk, config.max_prefill_tokens,
            n_blocks, BLOCK_SIZE, config.prefix_cache,
        )  # fmt: skip
        self.banned = loaded.banned_tokens  # [V] bool
        # padded to the model's min_batch_rows, a forward gives every row the same bits in any
        # batch mix on the CPU (docs/batching.md)
        self.min_rows = self.model.min_batch_rows
        # Never inductor `freezing`: it bakes weights in, and in-place weight loads go silently wrong.
        self.decode_step: Callable[[Tensor, CacheView, AdapterRows | None], Tensor] = (
            torch.compile(self._decode_step, dynamic=True) if config.compile else self._decode_step
        )

    def _decode_step(self, tokens: Tensor, view: CacheView, adapters: AdapterRows | None) -> Tensor:
        return self.model(tokens, self.cache, view, adapters)[:, -1]  # [B, V]

    def add_adapter(self, loaded: LoadedModel) -> None:
        """Serves an adapter over this version's weights from the next step: its tensors are
        stacked beside the others', nothing is copied or recompiled. A version stacked already
        (served, or retiring with sequences still on it) is served again as it is: versions never
        change their files."""
        assert loaded.adapter is not None
        loaded.max_len = self.loaded.max_len
        with self._adapters_lock:
            if loaded.version not in self._slots:
                self._set.add(loaded.adapter)
                self._slots.append(loaded.version)
            self.adapters[loaded.version] = loaded

    def retire_adapter(self, version: str) -> bool:
        """Stops sending new requests through an adapter; its running ones finish on it."""
        with self._adapters_lock:
            return self.adapters.pop(version, None) is not None

    def submit(self, request: Request) -> None:
        """Queues a request for the base weights or one of the adapters served over them."""
        with self._adapters_lock:
            if request.adapter and request.adapter not in self.adapters:
                raise NotFound(f"adapter {self.loaded.name}/{request.adapter} was unloaded just now")
            self.scheduler.submit(request)

    def _prune_adapters(self) -> None:
        """Unstacks retired adapters no request goes through any more (on the engine thread)."""
        with self._adapters_lock:
            for slot in reversed(range(len(self._slots))):
                version = self._slots[slot]
                if version not in self.adapters and not self.scheduler.uses_adapter(version):
                    self._set.remove(slot)
                    del self._slots[slot]

    def _adapter_rows(self, requests: list[Request], rows: int) -> AdapterRows | None:
        """The adapters of a forward over `requests`, padded to `rows` rows of the base alone."""
        slots = [self._slots.index(r.adapter) if r.adapter else None for r in requests]
        return self._set.rows(slots + [None] * (rows - len(requests)))

    @torch.inference_mode()
    def warm_up(self, batch_sizes: tuple[int, ...]) -> None:
        """Runs the decode step at each batch size on the scratch block (compiles it when enabled)."""
        device = self.loaded.device
        for rows in batch_sizes:
            tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
            self.decode_step(tokens, self.cache.view([[]] * rows, [[-1]] * rows, device), None)

    @torch.inference_mode()
    def step(self, metrics: WorkerMetrics | None) -> list[Output]:
        """One engine step for this version; a failure fails the sequences of the forward it hit."""
        if len(self._slots) > len(self.adapters):
            self._prune_adapters()
        plan = self.scheduler.schedule()
        if metrics is not None and plan.decode:
            metrics.batch_size.observe(len(plan.decode))
        outputs: list[Output] = []
        ready: list[tuple[Request, Tensor]] = []  # requests with logits for their next token
        if plan.prefill:
            try:
                last = self._prefill(plan.prefill)  # [N, V]
            except Exception as error:
                for request, _, _ in plan.prefill:
                    self._fail(request, error, outputs)
            else:
                for (request, _, end), row in zip(plan.prefill, last, strict=True):
                    self.scheduler.prefilled(request, end)
                    if end == request.prompt_len:
                        ready.append((request, row))
        if plan.decode:
            try:
                ready += zip(plan.decode, self._decode(plan.decode), strict=True)
            except Exception as error:
                for request in plan.decode:
                    self._fail(request, error, outputs)
        if not ready:
            return outputs
        logits = torch.stack([row for _, row in ready]).masked_fill(self.banned, float("-inf"))  # [N, V]
        greedy = logits.argmax(dim=-1).tolist()  # [N]
        for i, (request, _) in enumerate(ready):
            try:
                delta = request.sequence.append(self._pick(request, logits[i], greedy[i]))
            except Exception as error:
                self._fail(request, error, outputs)
                continue
            request.next_input = delta.token_ids[-1]
            outputs.append((request, delta))
            if delta.finish_reason is not None:
                self.scheduler.finish(request)
        return outputs

    def _prefill(self, chunks: list[tuple[Request, int, int]]) -> Tensor:
        """Runs every chunk prompt[start:end] in one forward, rows padded to a common length:
        the logits of each chunk's last token, [N, V]."""
        device = self.loaded.device
        width = max(max(end - start for _, start, end in chunks), -(-self.min_rows // len(chunks)))
        tokens = [[*r.sequence.prompt_ids[s:e], *[0] * (width - e + s)] for r, s, e in chunks]
        positions = [[*range(s, e), *[-1] * (width - e + s)] for _, s, e in chunks]
        view = self.cache.view([r.blocks for r, _, _ in chunks], positions, device)
        adapters = self._adapter_rows([r for r, _, _ in chunks], len(chunks))
        logits = self.model(torch.tensor(tokens, device=device), self.cache, view, adapters)  # [N, T, V]
        last = torch.tensor([e - s - 1 for _, s, e in chunks], device=device)  # [N]
        return logits[torch.arange(len(chunks), device=device), last]

    def _decode(self, requests: list[Request]) -> Tensor:
        """Feeds each request's last token at its own position in one batch: logits [B, V]."""
        pad = max(len(requests), self.min_rows) - len(requests)
        tokens = [r.next_input for r in requests] + [0] * pad
        positions = [[r.sequence.total_len - 1] for r in requests] + [[-1]] * pad
        device = self.loaded.device
        view = self.cache.view([r.blocks for r in requests] + [[]] * pad, positions, device)
        adapters = self._adapter_rows(requests, len(requests) + pad)
        logits = self.decode_step(torch.tensor(tokens, device=device)[:, None], view, adapters)  # [B, V]
        return logits[: len(requests)]

    @staticmethod
    def _pick(request: Request, logits: Tensor, greedy: int) -> int:
        forced = request.sequence.forced_token()
        if forced is not None:
            return forced
        params = request.sequence.params.sampling
        return greedy if params.temperature <= 0 else sample(logits, params, request.generator)

    def _fail(self, request: Request, error: Exception, outputs: list[Output]) -> None:
        logger.exception("sequence failed in model=%s version=%s", self.loaded.name, self.loaded.version)
        self.scheduler.finish(request)
        outputs.append((request, error))


class Engine:
    """Holds loaded versions and runs all their sequences on one torch thread."""

    def __init__(self, config: EngineConfig | None = None, metrics: WorkerMetrics | None = None):
        self.config = config or EngineConfig()
        self.metrics = metrics
        self._runners: dict[tuple[str, str], ModelRunner] = {}
        # (name, version, variant) -> the runner of a variant of a loaded version (workers/variants.py)
        self._variants: dict[tuple[str, str, str], ModelRunner] = {}
        self._draining: list[ModelRunner] = []  # unloaded, still finishing their sequences
        self._lock = threading.Lock()  # guards _runners and _draining across threads
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

    def add(self, loaded: LoadedModel) -> None:
        """Makes a version servable (replacing the same version if it was loaded); its cache is
        allocated, and its decode step compiled when enabled, on the engine thread. An adapter
        joins the runner of its base version, which must be loaded; a variant runs beside its
        version's, which must be loaded, on a pool of its own."""
        if loaded.adapter is not None:
            base = self._base_runner(loaded.name, loaded.base_version)
            self.run(lambda: base.add_adapter(loaded))
            return
        runner = self.run(lambda: self._new_runner(loaded))
        with self._lock:
            if loaded.variant:
                self._base_runner(loaded.name, loaded.version)
                self._retire_runner(self._variants.pop((loaded.name, loaded.version, loaded.variant), None))
                self._variants[(loaded.name, loaded.version, loaded.variant)] = runner
            else:
                self._retire_locked((loaded.name, loaded.version))
                self._runners[(loaded.name, loaded.version)] = runner
        self._observe_capacity()

    def _new_runner(self, loaded: LoadedModel) -> ModelRunner:
        runner = ModelRunner(loaded, self.config)
        if self.config.compile:
            runner.warm_up((runner.min_rows, self.config.max_batch_size))
        return runner

    def remove(self, name: str, version: str) -> bool:
        """Stops serving a version (a base version's adapters with it); its running sequences
        finish on the weights they hold."""
        with self._lock:
            for runner in self._runners.values():
                if runner.loaded.name == name and runner.retire_adapter(version):
                    return True
            removed = self._retire_locked((name, version))
        if removed:
            self._observe_capacity()
            if self.metrics is not None:
                self.metrics.forget_version(name, version)
        return removed

    def _observe_capacity(self) -> None:
        if self.metrics is not None:
            self.metrics.observe_capacity(self.kv_slots, self.kv_blocks()[1])

    def _retire_locked(self, key: tuple[str, str]) -> bool:
        """Retires a version's runner and its variants' runners."""
        for variant in [k for k in self._variants if k[:2] == key]:
            self._retire_runner(self._variants.pop(variant))
        return self._retire_runner(self._runners.pop(key, None))

    def _retire_runner(self, runner: ModelRunner | None) -> bool:
        if runner is None:
            return False
        runner.scheduler.close()
        self._draining.append(runner)
        self._wake.set()
        return True

    def variants(self, name: str, version: str) -> list[tuple[LoadedModel, Scheduler]]:
        """A loaded version and its variants, each with the scheduler that holds its sequences (an
        adapter's is its base's, and it has no variants)."""
        runner, loaded = self._serving(name, version)
        if loaded.adapter is not None:
            return [(loaded, runner.scheduler)]
        with self._lock:
            others = [(r.loaded, r.scheduler) for k, r in self._variants.items() if k[:2] == (name, version)]
        return [(loaded, runner.scheduler), *others]

    def loaded(self) -> list[LoadedModel]:
        """Every servable version, adapters after the version they are served over."""
        return [m for r in list(self._runners.values()) for m in (r.loaded, *list(r.adapters.values()))]

    def find(self, name: str, version: str) -> LoadedModel | None:
        """The loaded version, or None."""
        found = self._lookup(name, version)
        return None if found is None else found[1]

    def get(self, name: str, version: str, variant: str = "") -> LoadedModel:
        """The loaded version (or its variant); NotFound names what is loaded instead."""
        return self._serving(name, version, variant)[1]

    def _lookup(self, name: str, version: str, variant: str = "") -> tuple[ModelRunner, LoadedModel] | None:
        """The runner that serves a version, and the version: a base one's, an adapter's, or a
        variant's."""
        if variant:
            runner = self._variants.get((name, version, variant))
            return None if runner is None else (runner, runner.loaded)
        runner = self._runners.get((name, version))
        if runner is not None:
            return runner, runner.loaded
        for runner in list(self._runners.values()):
            if runner.loaded.name == name and (adapter := runner.adapters.get(version)) is not None:
                return runner, adapter
        return None

    def _serving(self, name: str, version: str, variant: str = "") -> tuple[ModelRunner, LoadedModel]:
        found = self._lookup(name, version, variant)
        if found is None:
            have = ", ".join(f"{m.name}/{m.version}" for m in self.loaded()) or "nothing"
            what = f"{name}/{version}" + (f" variant {variant}" if variant else "")
            raise NotFound(f"{what} is not loaded on this worker (loaded: {have})")
        return found

    def _base_runner(self, name: str, version: str) -> ModelRunner:
        runner = self._runners.get((name, version))
        if runner is None:
            raise NotFound(f"{name}/{version}, the base of an adapter, is not loaded on this worker")
        return runner

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
            return [*self._runners.values(), *self._variants.values(), *self._draining]

    async def generate(
        self,
        name: str,
        version: str,
        prompt_ids: list[int],
        params: GenerationParams,
        variant: str = "",
        cache_salt: str = "",
    ) -> AsyncGenerator[Delta]:
        """Streams the deltas of one completion (on a variant of the version when `variant` names
        one), reusing the prompt blocks of earlier requests with the same `cache_salt`; leaving
        early frees its slot at the next step."""
        if not self._thread.is_alive():
            raise Unavailable("this worker's engine has stopped; restart the worker")
        runner, loaded = self._serving(name, version, variant)
        max_len = loaded.max_len
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty")
        if len(prompt_ids) >= max_len:
            raise InvalidArgument(
                f"the prompt is {len(prompt_ids)} tokens; model {name}/{version} takes at most {max_len - 1}"
            )
        mailbox: Mailbox[Delta] = Mailbox(Delta.merge)
        loop = asyncio.get_running_loop()
        sequence = Sequence(prompt_ids, params, runner.loaded.tokenizer, max_len)
        adapter = version if loaded.adapter is not None else ""
        request = Request(
            sequence, make_generator(params.sampling), (loop, mailbox), adapter=adapter, cache_salt=cache_salt
        )
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
            logger.exception("engine step failed for %s/%s", runner.loaded.name, runner.loaded.version)
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
