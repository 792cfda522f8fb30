"""Where a request runs: the worker, the variant of its version, and the reasoning budget it gets,
from the latency model's predictions (gateway/latency.py), the request's deadline and each
worker's free KV blocks.

- Without a deadline, the version as loaded (the best variant), on the worker with the lowest cost.
- A request that names a variant (GenerateRequest.variant) runs on it, on its lowest-cost worker.
- With one, the best-quality variant (token agreement, workers/quality.py) predicted to finish
  within it, on its lowest-cost worker; when none is, the lowest-cost option of all. When even that
  one is predicted to miss, a version that reasons gets its reasoning budget lowered just enough to
  fit, never below the floor (REFLOW_REASONING_BUDGET_FLOOR) nor above what the request asked.
- Cost is the predicted total time, weighted by how much of the worker's free KV pool the request
  would take (1 + blocks needed / blocks free): of two equally fast workers, the one whose cache is
  nearly full stops attracting long prompts first. An option whose pool has fewer free blocks than
  the request needs would queue behind it; it meets no deadline.

A worker's variants take turns on its one engine thread, so a busy worker stays on the variant it
runs and switches only as `choose` says (docs/latency.md#one-engine-thread).

The prediction assumes the completion runs to max_tokens (for a version that reasons: to its
reasoning budget and a typical answer): a deadline is a promise, and an early stop only helps.
Variant choice happens inside the arm the request was assigned, so experiments stay fair.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from gateway.latency import Key, LatencyModel, Load, Observation, Prediction, VariantLatency
from gateway.quotas import prompt_chars
from gateway.routing import ModelSpec, WorkerHandle, WorkerPool
from gateway.validation import RequestLimits, max_tokens_for
from reflow.errors import NotFound
from reflow.v1 import inference_pb2, worker_pb2

# A variant idle on a worker busy with another is taken (a new turn on its engine thread) when it
# would meet the deadline within this share of it once it ran alone: hysteresis against flapping.
RETURN_SHARE = 0.6


@dataclass(frozen=True)
class Option:
    """One way to serve a request: a worker, a variant there, and what it is predicted to take."""

    worker: WorkerHandle
    loaded: worker_pb2.LoadedVersion
    variant: worker_pb2.LoadedVariant | None  # None: the version, which holds no variants
    load: Load
    prediction: Prediction  # beside the worker's other busy variants, as it is now
    alone: Prediction  # with its worker's load on this variant alone (the other variants drained)
    blocks_needed: int
    blocks_free: int
    mixes: bool = False  # its worker is busy, on another variant lately
    harms: bool = False  # its steps would push a stream on its worker past a deadline it would meet

    @property
    def name(self) -> str:
        return self.variant.name if self.variant is not None else ""

    @property
    def agreement(self) -> float:
        return self.variant.token_agreement if self.variant is not None else 1.0

    @property
    def best(self) -> bool:
        """The version as loaded, which its variants are measured against."""
        return self.variant is None or self.variant.reference

    @property
    def fits(self) -> bool:
        return self.blocks_needed <= self.blocks_free

    @property
    def cost_ms(self) -> float:
        return self.prediction.total_ms * (1 + self.blocks_needed / max(self.blocks_free, 1))

    def meets(self, budget_ms: float | None) -> bool:
        return budget_ms is None or (self.fits and self.prediction.total_ms <= budget_ms)

    def settled(self) -> Option:
        """This option as predicted once its worker runs this variant alone."""
        return replace(self, prediction=self.alone)


@dataclass(frozen=True)
class Placement:
    """The option chosen for a request, with what it was chosen for."""

    option: Option
    prompt_chars: int
    prompt_tokens: int  # estimated: the worker has not tokenized the prompt yet
    reasoning_budget: int  # applied
    budget_ms: float | None  # the time left to the deadline when it was chosen

    @property
    def key(self) -> Key:
        return key_of(self.option.worker, self.option.loaded, self.option.name)

    def routing(self) -> inference_pb2.Routing:
        o = self.option
        return inference_pb2.Routing(
            variant=o.name, token_agreement=o.agreement,
            predicted_time_to_first_token_ms=o.prediction.ttft_ms,
            predicted_total_ms=o.prediction.total_ms, reasoning_budget=self.reasoning_budget,
            predicted_to_meet_deadline=o.meets(self.budget_ms),
        )  # fmt: skip


class Placer:
    """Chooses where each request runs, from a pool's workers and a latency model."""

    def __init__(self, pool: WorkerPool, latency: LatencyModel, limits: RequestLimits, reasoning_floor: int):
        self.pool = pool
        self.latency = latency
        self.limits = limits
        self.reasoning_floor = reasoning_floor
        self.inflight: dict[str, set[PlacedStream]] = {}  # by worker address

    def place(
        self,
        spec: ModelSpec,
        request: inference_pb2.GenerateRequest,
        budget_ms: float | None,
        exclude: frozenset[str] = frozenset(),
    ) -> Placement:
        """The placement of `request` with `budget_ms` left to its deadline (None: no deadline);
        the pool's Unavailable or NotFound when no worker serves `spec`, InvalidArgument for a
        max_tokens beyond the version's context."""
        chars = prompt_chars(request)
        options = self.options(spec, request, exclude, chars)
        if request.variant:
            options = pinned(options, request.variant, spec)
        chosen = choose(options, budget_ms)
        reasoning = request.reasoning_budget
        if not chosen.meets(budget_ms) and chosen.loaded.reasons and budget_ms is not None:
            chosen, reasoning = self._think_less(chosen, request, budget_ms)
        return Placement(
            chosen, chars, self.latency.shape(spec.name).prompt_tokens(chars), reasoning, budget_ms
        )

    def options(
        self,
        spec: ModelSpec,
        request: inference_pb2.GenerateRequest,
        exclude: frozenset[str] = frozenset(),
        chars: int | None = None,
    ) -> list[Option]:
        """Every worker and variant that could serve `request` now, with its prediction (`chars`:
        its prompt's characters, when the caller counted them)."""
        chars = prompt_chars(request) if chars is None else chars
        prompt_tokens = self.latency.shape(spec.name).prompt_tokens(chars)
        return [
            option
            for worker, loaded in self.pool.candidates(spec, exclude)
            for option in self._options(worker, loaded, request, prompt_tokens)
        ]

    def _options(
        self,
        worker: WorkerHandle,
        loaded: worker_pb2.LoadedVersion,
        request: inference_pb2.GenerateRequest,
        prompt_tokens: int,
    ) -> list[Option]:
        max_tokens = max_tokens_for(request, self.limits, loaded)
        output = self._output_tokens(loaded, max_tokens, request.reasoning_budget)
        alone = Load(max(worker.reported_running, worker.outstanding), worker.queued_tokens)
        block = max(loaded.kv_block_size, 1)
        needed = math.ceil((prompt_tokens + max_tokens) / block)
        queued_blocks = math.ceil(worker.queued_tokens / block)
        variants: list[worker_pb2.LoadedVariant | None] = [*loaded.variants] or [None]
        fits = {
            (name := v.name if v else ""): self.latency.variant(key_of(worker, loaded, name), v)
            for v in variants
        }
        busy = {v.name for v in loaded.variants if v.running or v.waiting or worker.streams.get(v.name)}
        active = worker.active_variant if busy else None  # None: the worker is idle
        now = time.perf_counter()
        running = self.inflight.get(worker.address, set())
        options = []
        for variant in variants:
            name = variant.name if variant is not None else ""
            pool = variant if variant is not None else loaded
            free = max(pool.kv_blocks_total - pool.kv_blocks_used - queued_blocks, 0)
            others = sum(fits[other].step_ms() for other in busy - {name})
            load = replace(alone, others_ms=others)
            fit = fits[name]
            prediction = self._expected(fit, worker, prompt_tokens, output, load)
            settled = self._expected(fit, worker, prompt_tokens, output, alone)
            mixes = active is not None and name != active
            step = fit.step_ms()
            harms = mixes and any(
                s.pushed_past_deadline(step, now) for s in running if s.placement.option.name != name
            )
            options.append(
                Option(worker, loaded, variant, load, prediction, settled, needed, free, mixes, harms)
            )
        return options

    @staticmethod
    def _expected(
        fit: VariantLatency, worker: WorkerHandle, prompt_tokens: int, output: int, load: Load
    ) -> Prediction:
        """The prediction with the load the request will meet over its life: the sequences running
        now, or as many as the worker's recent arrival rate keeps running for that long (Little's
        law), whichever is more; so a rising rate is met before the queue shows it."""
        prediction = fit.predict(prompt_tokens, output, load)
        rate = worker.arrivals.per_second(time.perf_counter())
        kept = math.ceil(rate * prediction.total_ms / 1000)
        if kept <= load.running:
            return prediction
        return fit.predict(prompt_tokens, output, replace(load, running=kept))

    def _output_tokens(self, loaded: worker_pb2.LoadedVersion, max_tokens: int, reasoning: int) -> int:
        """The tokens a completion is predicted to run to: max_tokens, or for a version that
        reasons its reasoning budget and a typical answer, if fewer."""
        if not loaded.reasons or not reasoning:
            return max_tokens
        answer = math.ceil(self.latency.shape(loaded.model).answer_tokens)
        return min(max_tokens, reasoning + answer)

    def _think_less(
        self, option: Option, request: inference_pb2.GenerateRequest, budget_ms: float
    ) -> tuple[Option, int]:
        """`option` with its reasoning budget lowered just enough to meet `budget_ms` (not below
        the floor, nor above the request's own), and the budget applied."""
        max_tokens = max_tokens_for(request, self.limits, option.loaded)
        asked = request.reasoning_budget or max_tokens
        answer = math.ceil(self.latency.shape(option.loaded.model).answer_tokens)
        fitting = option.prediction.affordable_tokens(budget_ms) - answer
        lowered = max(min(self.reasoning_floor, asked), fitting)
        if lowered >= asked:
            return option, request.reasoning_budget
        output = self._output_tokens(option.loaded, max_tokens, lowered)
        return replace(option, prediction=replace(option.prediction, output_tokens=output)), lowered


def key_of(worker: WorkerHandle, loaded: worker_pb2.LoadedVersion, variant: str) -> Key:
    """The latency model's key of a variant on a worker ("" for a version without variants)."""
    return (worker.address, loaded.model, loaded.version, variant)


def pinned(options: list[Option], variant: str, spec: ModelSpec) -> list[Option]:
    """The options on `variant`, which the request named; NotFound, naming the variants there are,
    when no worker serving `spec` holds it."""
    on = [o for o in options if o.name == variant]
    if not on:
        held = sorted({o.name for o in options if o.name})
        there = f"its variants are {', '.join(held)}" if held else "its workers hold no variants"
        raise NotFound(f"no worker serving model {spec} holds variant {variant!r}; {there}")
    return on


def choose(options: list[Option], budget_ms: float | None) -> Option:
    """The best-quality option predicted to meet `budget_ms` (the version itself when there is no
    deadline), the lowest-cost one among equals, in this order of preference:

    1. on the variant its worker runs lately (any, on an idle worker): a busy engine thread takes
       no new variant into its turns; or on another that would meet well within it (RETURN_SHARE
       of it) once its worker ran it alone: the way back to a better variant when load falls;
    2. on the variant that would meet it once its worker ran it alone: under sustained load the
       worker switches variant (the old one drains) rather than mixing them.

    Never on another variant than the one a worker runs when its steps would push a stream there
    past a deadline it is on course to meet.

    The lowest-cost option of all when none would."""
    if budget_ms is None:
        return min([o for o in options if o.best] or options, key=lambda o: o.cost_ms)  # or a pinned one
    meeting = [
        o for o in options
        if o.meets(budget_ms)
        and (not o.mixes or (not o.harms and o.settled().meets(budget_ms * RETURN_SHARE)))
    ]  # fmt: skip
    meeting = meeting or [s for o in options if not o.harms and (s := o.settled()).meets(budget_ms)]
    if not meeting:
        return min(options, key=lambda o: o.cost_ms)
    return min(meeting, key=lambda o: (-o.agreement, o.cost_ms))


class PlacedStream:
    """A placed request while its stream runs: counted in its worker's load (its prompt as queued
    until the first token), and learned from by the latency model when it ends, however it ends."""

    def __init__(self, placement: Placement, placer: Placer):
        self.placement = placement
        self.latency = placer.latency
        self.placed = time.perf_counter()
        self.first_at: float | None = None
        self.last_at = self.placed
        self.tokens = 0
        self.prompt_tokens = placement.prompt_tokens
        worker, variant = placement.option.worker, placement.option.name
        worker.arrivals.arrived(self.placed)
        worker.active_variant = variant
        worker.streams[variant] = worker.streams.get(variant, 0) + 1
        worker.queued_tokens += placement.prompt_tokens
        self.running = placer.inflight.setdefault(worker.address, set())
        self.running.add(self)

    def pushed_past_deadline(self, added_ms: float, now: float) -> bool:
        """Whether `added_ms` more per token it has left would make it miss a deadline it is on
        course to meet."""
        budget = self.placement.budget_ms
        if budget is None:
            return False
        predicted = self.placement.option.prediction
        left = max(predicted.output_tokens - self.tokens, 0)
        needed = left * predicted.tpot_ms + (predicted.ttft_ms if self.first_at is None else 0.0)
        time_left = budget - (now - self.placed) * 1000
        return needed <= time_left < needed + left * added_ms

    def tokens_arrived(self, n: int, now: float) -> None:
        if self.first_at is None:
            self.first_at = now
            self.placement.option.worker.queued_tokens -= self.placement.prompt_tokens
        self.tokens += n
        self.last_at = now

    def finished(self, usage: inference_pb2.Usage) -> None:
        """The prompt tokens its worker prefilled (those its prefix cache held cost no prefill),
        and what its usage says of its model's requests."""
        if usage.prompt_tokens:
            self.prompt_tokens = usage.prompt_tokens - usage.cached_tokens
        shape = self.latency.shape(self.placement.option.loaded.model)
        shape.learn(self.placement.prompt_chars, usage)

    def close(self) -> None:
        """Takes it out of its worker's load and teaches the latency model what it took."""
        option = self.placement.option
        worker = option.worker
        worker.streams[option.name] -= 1
        self.running.discard(self)
        if self.first_at is None:
            worker.queued_tokens -= self.placement.prompt_tokens
            return
        self.latency.observe(
            Observation(
                self.placement.key, option.load, self.prompt_tokens, self.tokens,
                (self.first_at - self.placed) * 1000, (self.last_at - self.placed) * 1000,
            )
        )  # fmt: skip
