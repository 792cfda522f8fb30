"""Runs the steps the scheduler plans: chunked prefills, then one batched decode over every sequence.

A dedicated thread does all torch work, step after step, while any sequence is active; new
requests join at the next step and finished or cancelled ones leave at once. Deltas cross to
the event loop once per step, into each request's coalescing mailbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from reflow.errors import InvalidArgument, NotFound, Unavailable
from reflow.streaming import Mailbox
from workers.loading import LoadedModel
from workers.metrics import WorkerMetrics
from workers.sampling import make_generator, sample
from workers.scheduler import Output, Request, Scheduler
from workers.sequence import Delta, GenerationParams, Sequence

logger = logging.getLogger(__name__)

# CPU GEMM kernels are chosen by the number of rows; from 4 rows on, every row's result is
# bit-identical whatever the batch (measured for 1..64 rows on all presets; 2 rows differ),
# so decode batches are padded to 4: a sequence's greedy tokens are then the same alone or
# in any batch mix.
MIN_DECODE_ROWS = 4


@dataclass(frozen=True)
class EngineConfig:
    """Batching limits and compilation; see the worker settings in docs/configuration.md."""

    max_batch_size: int = 64
    max_waiting: int = 256
    prefill_chunk: int = 64
    max_prefill_tokens: int = 256
    compile: bool = False


class ModelRunner:
    """One loaded version: its KV slots, scheduler, and batched decode step (compiled or eager)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig):
        self.loaded = loaded
        self.model = loaded.model
        self.cache = self.model.new_cache(config.max_batch_size + 1)
        self.scratch_slot = config.max_batch_size  # padding rows write here; nothing reads it
        self.scheduler = Scheduler(
            config.max_batch_size, config.max_waiting, config.prefill_chunk, config.max_prefill_tokens
        )
        self.banned = loaded.banned_tokens  # [V] bool
        # Never inductor `freezing`: it bakes weights in, and in-place weight loads go silently wrong.
        self.decode_step: Callable[[Tensor, Tensor, Tensor], Tensor] = (
            torch.compile(self._decode_step, dynamic=True) if config.compile else self._decode_step
        )

    def _decode_step(self, tokens: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        return self.model(tokens, positions, self.cache, slots)[:, -1]  # [B, V]

    @torch.inference_mode()
    def warm_up(self, batch_sizes: tuple[int, ...]) -> None:
        """Runs the decode step at each batch size on the scratch slot (compiles it when enabled)."""
        device = self.loaded.device
        for rows in batch_sizes:
            tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
            slots = torch.full((rows,), self.scratch_slot, device=device)
            self.decode_step(tokens, torch.zeros(rows, 1, dtype=torch.long, device=device), slots)

    @torch.inference_mode()
    def step(self, metrics: WorkerMetrics | None) -> list[Output]:
        """One engine step for this version; each request's failure stays its own."""
        plan = self.scheduler.schedule()
        if metrics is not None and plan.decode:
            metrics.batch_size.observe(len(plan.decode))
        outputs: list[Output] = []
        ready: list[tuple[Request, Tensor]] = []  # requests with logits for their next token
        for request, start, end in plan.prefill:
            try:
                logits = self._prefill(request, start, end)  # [V]
            except Exception as error:
                self._fail(request, error, outputs)
                continue
            request.prefilled = end
            if end == request.prompt_len:
                ready.append((request, logits))
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

    def _prefill(self, request: Request, start: int, end: int) -> Tensor:
        """Runs prompt[start:end] alone (exact whatever else runs); logits of its last token: [V]."""
        device = self.loaded.device
        tokens = torch.tensor([request.sequence.prompt_ids[start:end]], device=device)  # [1, T]
        positions = torch.arange(start, end, device=device)[None]  # [1, T]
        slots = torch.tensor([request.slot], device=device)  # [1]
        return self.model(tokens, positions, self.cache, slots)[0, -1]

    def _decode(self, requests: list[Request]) -> Tensor:
        """Feeds each request's last token at its own position in one batch: logits [B, V]."""
        rows = max(len(requests), MIN_DECODE_ROWS)
        pad = rows - len(requests)
        tokens = [r.next_input for r in requests] + [0] * pad
        positions = [r.sequence.total_len - 1 for r in requests] + [0] * pad
        slots = [r.slot for r in requests] + [self.scratch_slot] * pad
        device = self.loaded.device
        logits = self.decode_step(
            torch.tensor(tokens, device=device)[:, None],  # [B, 1]
            torch.tensor(positions, device=device)[:, None],  # [B, 1]
            torch.tensor(slots, device=device),  # [B]
        )
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
        self._draining: list[ModelRunner] = []  # unloaded, still finishing their sequences
        self._lock = threading.Lock()  # guards _runners and _draining across threads
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def add(self, loaded: LoadedModel) -> None:
        """Makes a version servable (replacing the same version if it was loaded)."""
        runner = ModelRunner(loaded, self.config)
        if self.config.compile:
            runner.warm_up((MIN_DECODE_ROWS, self.config.max_batch_size))
        with self._lock:
            self._retire_locked((loaded.name, loaded.version))
            self._runners[(loaded.name, loaded.version)] = runner
        if self.metrics is not None:
            self.metrics.kv_slots.set(self.kv_slots)

    def remove(self, name: str, version: str) -> bool:
        """Stops serving a version; its running sequences finish on the weights they hold."""
        with self._lock:
            removed = self._retire_locked((name, version))
        if removed and self.metrics is not None:
            self.metrics.kv_slots.set(self.kv_slots)
        return removed

    def _retire_locked(self, key: tuple[str, str]) -> bool:
        runner = self._runners.pop(key, None)
        if runner is None:
            return False
        runner.scheduler.close()
        self._draining.append(runner)
        self._wake.set()
        return True

    def loaded(self) -> list[LoadedModel]:
        """Every servable version."""
        return [r.loaded for r in self._runners.values()]

    def find(self, name: str, version: str) -> LoadedModel | None:
        """The loaded version, or None."""
        runner = self._runners.get((name, version))
        return None if runner is None else runner.loaded

    def get(self, name: str, version: str) -> LoadedModel:
        """The loaded version; NotFound names what is loaded instead."""
        return self._runner(name, version).loaded

    def _runner(self, name: str, version: str) -> ModelRunner:
        runner = self._runners.get((name, version))
        if runner is None:
            have = ", ".join(f"{n}/{v}" for n, v in self._runners) or "nothing"
            raise NotFound(f"{name}/{version} is not loaded on this worker (loaded: {have})")
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
        """KV slots allocated, draining versions included."""
        return self.config.max_batch_size * len(self._all_runners())

    def _all_runners(self) -> list[ModelRunner]:
        with self._lock:
            return [*self._runners.values(), *self._draining]

    async def generate(
        self, name: str, version: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncGenerator[Delta]:
        """Streams the deltas of one completion; leaving early frees its slot at the next step."""
        if not self._thread.is_alive():
            raise Unavailable("this worker's engine has stopped; restart the worker")
        runner = self._runner(name, version)
        max_len = runner.loaded.max_len
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty")
        if len(prompt_ids) >= max_len:
            raise InvalidArgument(
                f"the prompt is {len(prompt_ids)} tokens; model {name}/{version} takes at most {max_len - 1}"
            )
        mailbox: Mailbox[Delta] = Mailbox(Delta.merge)
        loop = asyncio.get_running_loop()
        sequence = Sequence(prompt_ids, params, runner.loaded.tokenizer, max_len)
        request = Request(sequence, make_generator(params.sampling), (loop, mailbox))
        runner.scheduler.submit(request)
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

    def _step(self, runner: ModelRunner) -> None:
        started = time.perf_counter()
        try:
            outputs = runner.step(self.metrics)
        except Exception as error:  # outside any one sequence: fail this version's sequences, go on
            logger.exception("engine step failed for %s/%s", runner.loaded.name, runner.loaded.version)
            outputs = [(r, error) for r in runner.scheduler.take_all()]
        if self.metrics is not None:
            self.metrics.observe_outputs(outputs, time.perf_counter() - started)
            self.metrics.observe_occupancy(*self.occupancy())
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
