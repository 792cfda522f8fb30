"""Where a request runs: the worker, the copy of its version there (the reference, which is the
version as loaded, or a variant), and the reasoning budget it gets, from the latency model's
predictions (gateway/latency.py), the request's deadline and each worker's free KV blocks; and
what this gateway runs on each worker meanwhile (WorkerLoad), which only placement changes.

- Without a deadline, the reference copy (the best), on the worker with the lowest cost.
- A request that names a variant (GenerateRequest.variant) runs on it, on its lowest-cost worker.
- Another choice of a request that asked for several runs beside the first one (its worker and
  copy), where the prompt's blocks are cached, as long as that copy serves it.
- With one, the best-quality copy (token agreement, workers/quality.py) predicted to finish
  within it, on its lowest-cost worker; when none is, the lowest-cost option of all. When even that
  one is predicted to miss, a version that reasons gets its reasoning budget lowered just enough to
  fit, never below the floor (REFLOW_REASONING_BUDGET_FLOOR) nor above what the request asked.
- Cost is the predicted total time, weighted by how much of the worker's free KV pool the request
  would take (1 + blocks needed / blocks free): of two equally fast workers, the one whose cache is
  nearly full stops attracting long prompts first. An option whose pool has fewer free blocks than
  the request needs would queue behind it; it meets no deadline.
- A worker this gateway has placed nothing on for EXPLORE_AFTER_S gets the next request it would
  serve on its reference copy (within the deadline, if there is one), whatever its cost: a fit is
  corrected only by the streams placed on it, so without this a worker predicted slower once (cut
  off, or busy with another gateway's streams) would stay unused while another predicts faster.

A worker's copies take turns on its one engine thread, so a busy worker stays on the copy it runs
and switches only as `choose` says (docs/latency.md#one-engine-thread).

The prediction assumes the completion runs to max_tokens (for a version that reasons: to its
reasoning budget and a typical answer): a deadline is a promise, and an early stop only helps.
The copy is chosen inside the arm the request was assigned, so experiments stay fair.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from gateway.latency import Key, LatencyModel, Load, Observation, Prediction, VariantLatency
from gateway.quotas import prompt_chars
from gateway.routing import ModelSpec, WorkerHandle, WorkerPool, holds_variants
from gateway.validation import RequestLimits, max_tokens_for
from reflow.errors import NotFound
from reflow.v1 import inference_pb2, worker_pb2

# A copy idle on a worker busy with another is taken (a new turn on its engine thread) when it
# would meet the deadline within this share of it once it ran alone: hysteresis against flapping.
RETURN_SHARE = 0.6
SMOOTHING = 0.2  # weight of the newest gap in a worker's arrival rate
EXPLORE_AFTER_S = 30.0  # a worker this gateway placed nothing on for this long is tried again


@dataclass(frozen=True, kw_only=True)
class Blocks:
    """The KV blocks a request needs on a copy's pool, and those free there."""

    needed: int
    free: int

    @property
    def fit(self) -> bool:
        return self.needed <= self.free

    @property
    def weight(self) -> float:
        """What a prediction's cost is multiplied by: 1 + the share of the free blocks it takes."""
        return 1 + self.needed / max(self.free, 1)


@dataclass(frozen=True, kw_only=True)
class Option:
    """One way to serve a request: a worker, a copy of its version there, and what it is predicted
    to take."""

    worker: WorkerHandle
    loaded: worker_pb2.LoadedVersion
    copy: worker_pb2.LoadedVariant  # the reference or a variant (LoadedVersion.variants)
    load: Load
    prediction: Prediction  # beside the worker's other busy copies, as it is now
    alone: Prediction  # with its worker's load on this copy alone (the other copies drained)
    blocks: Blocks
    mixes: bool = False  # its worker is busy, on another copy lately
    harms: bool = False  # its steps would push a stream on its worker past a deadline it would meet
    idle_s: float = math.inf  # since this gateway last placed a request on its worker (inf: never)

    @property
    def name(self) -> str:
        return self.copy.name

    @property
    def variant(self) -> str:
        """The copy as clients are told it (Routing.variant): its name, or "" where its worker holds
        the reference alone (no REFLOW_VARIANTS), as ListModels lists no variants there."""
        return self.name if holds_variants(self.loaded) else ""

    @property
    def agreement(self) -> float:
        return self.copy.token_agreement

    @property
    def best(self) -> bool:
        """The reference copy, which the variants are measured against."""
        return self.copy.reference

    @property
    def cost_ms(self) -> float:
        return self.prediction.total_ms * self.blocks.weight

    def meets(self, budget_ms: float | None) -> bool:
        return budget_ms is None or (self.blocks.fit and self.prediction.total_ms <= budget_ms)

    def settled(self) -> Option:
        """This option as predicted once its worker runs this copy alone."""
        return replace(self, prediction=self.alone)


@dataclass(frozen=True, kw_only=True)
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
            variant=o.variant, token_agreement=o.agreement,
            predicted_time_to_first_token_ms=o.prediction.ttft_ms,
            predicted_total_ms=o.prediction.total_ms, reasoning_budget=self.reasoning_budget,
            predicted_to_meet_deadline=o.meets(self.budget_ms),
        )  # fmt: skip


@dataclass
class ArrivalRate:
    """Requests per second sent to a worker lately: an exponentially weighted mean of the gaps
    between them (SMOOTHING per arrival), and the silence since the last one when it is longer."""

    mean_gap_s: float = math.inf
    last: float | None = None

    def arrived(self, now: float) -> None:
        if self.last is not None:
            gap = now - self.last
            self.mean_gap_s = (
                gap if math.isinf(self.mean_gap_s) else self.mean_gap_s + SMOOTHING * (gap - self.mean_gap_s)
            )
        self.last = now

    def per_second(self, now: float) -> float:
        if self.last is None:
            return 0.0
        return 1.0 / max(self.mean_gap_s, now - self.last, 1e-3)


@dataclass
class WorkerLoad:
    """What this gateway runs and queues on one worker: its open streams, the copy it placed there
    last, the prompt tokens still to reach a first token, and how fast it sends requests. Only the
    streams the Placer starts change it (admitted, prefilled, released)."""

    streams: dict[str, int] = field(default_factory=dict)  # open, by copy
    in_flight: set[PlacedStream] = field(default_factory=set)  # the same streams, with their progress
    active: str = ""  # the copy of the latest stream placed on it ("" before the first)
    queued_tokens: int = 0  # of those streams, the estimated prompt tokens before the first token
    arrivals: ArrivalRate = field(default_factory=ArrivalRate)

    @property
    def outstanding(self) -> int:
        """Streams that have not ended."""
        return sum(self.streams.values())

    def busy(self, held: list[worker_pb2.LoadedVariant]) -> set[str]:
        """The names of the copies in `held` with sequences running or waiting: by the worker's last
        status (every gateway's), or open through this gateway since."""
        return {c.name for c in held if c.running or c.waiting or self.streams.get(c.name)}

    def pushes_past_deadline(self, copy: str, added_ms: float, now: float) -> bool:
        """Whether `added_ms` more per token would make a stream here on another copy than `copy`
        miss a deadline it is on course to meet."""
        return any(s.copy != copy and s.pushed_past_deadline(added_ms, now) for s in self.in_flight)

    def admitted(self, stream: PlacedStream) -> None:
        self.arrivals.arrived(stream.placed)
        self.active = stream.copy
        self.streams[stream.copy] = self.streams.get(stream.copy, 0) + 1
        self.queued_tokens += stream.placement.prompt_tokens
        self.in_flight.add(stream)

    def prefilled(self, stream: PlacedStream) -> None:
        """Its first token came: its prompt no longer waits."""
        self.queued_tokens -= stream.placement.prompt_tokens

    def released(self, stream: PlacedStream) -> None:
        self.streams[stream.copy] -= 1
        self.in_flight.discard(stream)
        if stream.first_at is None:
            self.queued_tokens -= stream.placement.prompt_tokens


class Placer:
    """Chooses where each request runs, from a pool's workers and a latency model, and keeps the
    load of the streams it starts on each worker."""

    def __init__(self, pool: WorkerPool, latency: LatencyModel, limits: RequestLimits, reasoning_floor: int):
        self.pool = pool
        self.latency = latency
        self.limits = limits
        self.reasoning_floor = reasoning_floor
        self.loads: dict[str, WorkerLoad] = {}  # by worker address

    def load_of(self, worker: WorkerHandle) -> WorkerLoad:
        """What this gateway runs on `worker`."""
        return self.loads.setdefault(worker.address, WorkerLoad())

    def place(
        self,
        spec: ModelSpec,
        request: inference_pb2.GenerateRequest,
        budget_ms: float | None,
        exclude: frozenset[str] = frozenset(),
        near: Placement | None = None,
    ) -> Placement:
        """The placement of `request` with `budget_ms` left to its deadline (None: no deadline),
        beside `near` (another choice of the same request) where that one's copy still serves it;
        the pool's Unavailable or NotFound when no worker serves `spec`, InvalidArgument for a
        max_tokens beyond the version's context."""
        chars = prompt_chars(request)
        options = self.options(spec, request, exclude, chars)
        if request.variant:
            options = pinned(options, request.variant, spec)
        if near is not None:
            options = beside(options, near)
        chosen = choose(options, budget_ms)
        reasoning = request.reasoning_budget
        if not chosen.meets(budget_ms) and chosen.loaded.reasons and budget_ms is not None:
            chosen, reasoning = self._think_less(chosen, request, budget_ms)
        return Placement(
            option=chosen, prompt_chars=chars,
            prompt_tokens=self.latency.shape(spec.name).prompt_tokens(chars),
            reasoning_budget=reasoning, budget_ms=budget_ms,
        )  # fmt: skip

    def start(self, placement: Placement) -> PlacedStream:
        """The stream of `placement`, counted in its worker's load until it closes."""
        stream = PlacedStream(placement, self.load_of(placement.option.worker), self.latency)
        stream.load.admitted(stream)
        return stream

    def options(
        self,
        spec: ModelSpec,
        request: inference_pb2.GenerateRequest,
        exclude: frozenset[str] = frozenset(),
        chars: int | None = None,
    ) -> list[Option]:
        """Every worker and copy that could serve `request` now, with its prediction (`chars`:
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
        load = self.load_of(worker)
        alone = Load(max(worker.reported_running, load.outstanding), load.queued_tokens)
        block = max(loaded.kv_block_size, 1)
        needed = math.ceil((prompt_tokens + max_tokens) / block)
        queued_blocks = math.ceil(load.queued_tokens / block)
        held = list(loaded.variants)  # the reference first, never empty
        fits = {c.name: self.latency.variant(key_of(worker, loaded, c.name), c) for c in held}
        busy = load.busy(held)
        now = time.perf_counter()
        rate = load.arrivals.per_second(now)
        idle_s = math.inf if load.arrivals.last is None else now - load.arrivals.last
        options = []
        for copy in held:
            fit = fits[copy.name]
            beside = replace(alone, others_ms=sum(fits[other].step_ms() for other in busy - {copy.name}))
            mixes = bool(busy) and copy.name != load.active
            options.append(
                Option(
                    worker=worker, loaded=loaded, copy=copy, load=beside,
                    prediction=self._expected(fit, rate, prompt_tokens, output, beside),
                    alone=self._expected(fit, rate, prompt_tokens, output, alone),
                    blocks=Blocks(
                        needed=needed,
                        free=max(copy.kv_blocks_total - copy.kv_blocks_used - queued_blocks, 0),
                    ),
                    mixes=mixes,
                    harms=mixes and load.pushes_past_deadline(copy.name, fit.step_ms(), now),
                    idle_s=idle_s,
                )
            )  # fmt: skip
        return options

    @staticmethod
    def _expected(
        fit: VariantLatency, rate: float, prompt_tokens: int, output: int, load: Load
    ) -> Prediction:
        """The prediction with the load the request will meet over its life: the sequences running
        now, or as many as the worker's recent arrival rate (`rate` per second) keeps running for
        that long (Little's law), whichever is more; so a rising rate is met before the queue
        shows it."""
        prediction = fit.predict(prompt_tokens, output, load)
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


def key_of(worker: WorkerHandle, loaded: worker_pb2.LoadedVersion, copy: str) -> Key:
    """The latency model's key of a copy of a version on a worker."""
    return (worker.address, loaded.model, loaded.version, copy)


def pinned(options: list[Option], variant: str, spec: ModelSpec) -> list[Option]:
    """The options on `variant`, which the request named (a variant's name, or the reference's);
    NotFound, naming the copies there are, when no worker serving `spec` holds it."""
    on = [o for o in options if o.name == variant]
    if not on:
        held = ", ".join(sorted({o.name for o in options}))
        references_only = all(o.best for o in options)
        there = "its workers hold no variants" if references_only else f"its variants are {held}"
        raise NotFound(f"no worker serving model {spec} holds variant {variant!r}; {there}")
    return on


def beside(options: list[Option], near: Placement) -> list[Option]:
    """The options on `near`'s worker and copy, whose prefix cache holds the prompt they share;
    all of them when none is (that worker failed, or no longer serves the version)."""
    there = (near.option.worker.address, near.option.name)
    return [o for o in options if (o.worker.address, o.name) == there] or options


def choose(options: list[Option], budget_ms: float | None) -> Option:
    """The best-quality option predicted to meet `budget_ms` (the reference copy when there is no
    deadline), the lowest-cost one among equals, in this order of preference:

    1. on the copy its worker runs lately (any, on an idle worker): a busy engine thread takes no
       new copy into its turns; or on another that would meet well within it (RETURN_SHARE of it)
       once its worker ran it alone: the way back to a better copy when load falls;
    2. on the copy that would meet it once its worker ran it alone: under sustained load the
       worker switches copy (the old one drains) rather than mixing them.

    Never on another copy than the one a worker runs when its steps would push a stream there past
    a deadline it is on course to meet.

    The lowest-cost option of all when none would. Before all of these, while this gateway uses
    other workers: the reference copy on a worker it has not used for EXPLORE_AFTER_S, where that
    meets the deadline and takes no new copy into the worker's turns (the module's docstring)."""
    unused = [
        o for o in options if o.idle_s >= EXPLORE_AFTER_S and o.best and not o.mixes and o.meets(budget_ms)
    ]
    if unused and {o.worker.address for o in unused} != {o.worker.address for o in options}:
        return min(unused, key=lambda o: o.cost_ms)  # some workers are in use: try an unused one
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
    """A placed request while its stream runs (Placer.start): counted in its worker's load (its
    prompt as queued until the first token), and learned from by the latency model when it ends,
    however it ends."""

    def __init__(self, placement: Placement, load: WorkerLoad, latency: LatencyModel):
        self.placement = placement
        self.copy = placement.option.name
        self.load = load
        self.latency = latency
        self.placed = time.perf_counter()
        self.first_at: float | None = None
        self.last_at = self.placed
        self.tokens = 0

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
            self.load.prefilled(self)
        self.tokens += n
        self.last_at = now

    def close(self, usage: inference_pb2.Usage | None = None) -> None:
        """Takes it out of its worker's load and teaches the latency model what it took; `usage`,
        when it finished, says the prompt tokens its worker prefilled (those its prefix cache held
        cost no prefill) and what its model's requests are like."""
        self.load.released(self)
        prompt_tokens = self.placement.prompt_tokens
        if usage is not None:
            self.latency.shape(self.placement.option.loaded.model).learn(self.placement.prompt_chars, usage)
            if usage.prompt_tokens:
                prompt_tokens = usage.prompt_tokens - usage.cached_tokens
        if self.first_at is None:
            return
        self.latency.observe(
            Observation(
                key=self.placement.key, load=self.placement.option.load, prompt_tokens=prompt_tokens,
                tokens=self.tokens, ttft_ms=(self.first_at - self.placed) * 1000,
                last_ms=(self.last_at - self.placed) * 1000,
            )
        )  # fmt: skip
