"""The gateway's latency model: for each worker, version and copy (the reference or a variant),
time to first token and time per output token as functions of the worker's load, fitted online to
every stream it relays.

    TTFT ms ≈ θ · [1, tokens to prefill first (queued ahead of it + its prompt), sequences running]
    TPOT ms ≈ φ · [1, sequences running]

Recursive least squares fits both, forgetting old streams at FORGETTING per stream, so a worker
that slows down (another tenant's load, a noisy neighbour) is followed within tens of streams. A
copy starts from what its worker measured when it loaded it (ms per prompt token and per token,
one sequence alone: LoadedVariant), so its first prediction is already of the right size; a copy
its worker did not measure starts from generic priors that its first streams quickly correct. The
load is the worker's own (its running sequences, over every variant: they share its engine
thread) and what this gateway has sent it that has not reached its first token yet.

A worker's variants share its one engine thread: each step runs every busy variant's batch in
turn, so a sequence on one variant also waits, every token, for the steps of the others that are
busy. A prediction adds those (`Load.others_ms`: each other busy variant's one-row step time), and
a stream's observed times have them taken out before they are fitted, so that each fit describes
its variant as if it ran alone.

The worker has not tokenized a prompt when the gateway chooses, so prompt tokens are estimated
from its characters, at a chars-per-token ratio learned per model from the usage streams report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.quotas import PROMPT_CHARS_PER_TOKEN
from reflow.v1 import inference_pb2, worker_pb2

FORGETTING = 0.97  # weight of the past per stream: about 30 streams of memory
LEARNING = 0.1  # weight of one stream in the per-model averages (chars per token, answer tokens)
# Generic priors for a copy its worker did not measure (decode_ms_per_token 0), of the order of
# SmolLM2-135M on a CPU (about 45 ms per token alone, docs/benchmarks.md; a prompt token, prefilled
# in chunks, a small share of that): wide, and corrected by the first streams.
GENERIC_PREFILL_MS_PER_TOKEN = 2.0
GENERIC_DECODE_MS_PER_TOKEN = 40.0
FIRST_ANSWER_TOKENS = 8.0  # the answer after a thought, before any stream said


class RecursiveLeastSquares:
    """Online linear regression y ≈ θ·x with exponential forgetting."""

    def __init__(self, prior: list[float], prior_sd: list[float], forgetting: float = FORGETTING):
        self.theta = list(prior)
        self.p = [[sd * sd if i == j else 0.0 for j in range(len(prior))] for i, sd in enumerate(prior_sd)]
        self.forgetting = forgetting

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def predict_rising(self, x: list[float]) -> float:
        """The prediction with negative slopes taken as flat (x[0] is the intercept's 1): more load
        never makes a worker faster, whatever a noisy fit says."""
        return self.theta[0] + sum(max(t, 0.0) * v for t, v in zip(self.theta[1:], x[1:], strict=True))

    def update(self, x: list[float], y: float) -> None:
        """Moves θ toward explaining `y` at `x`."""
        px = [sum(row[j] * x[j] for j in range(len(x))) for row in self.p]
        denominator = self.forgetting + sum(x[i] * px[i] for i in range(len(x)))
        gain = [v / denominator for v in px]
        error = y - self.predict(x)
        self.theta = [t + g * error for t, g in zip(self.theta, gain, strict=True)]
        n = len(x)
        self.p = [[(self.p[i][j] - gain[i] * px[j]) / self.forgetting for j in range(n)] for i in range(n)]


@dataclass(frozen=True)
class Load:
    """A worker's load as the gateway sees it when it chooses."""

    running: int  # sequences generating on the worker, every variant and version
    queued_tokens: int  # prompt tokens sent to it that have not reached their first token
    others_ms: float = 0.0  # per step, the worker's other busy variants' steps it waits for


@dataclass(frozen=True)
class Prediction:
    """What a variant is predicted to take for one request, in milliseconds."""

    ttft_ms: float
    tpot_ms: float  # per output token after the first
    output_tokens: int

    @property
    def total_ms(self) -> float:
        return self.ttft_ms + self.tpot_ms * max(self.output_tokens - 1, 0)

    def affordable_tokens(self, budget_ms: float) -> int:
        """The most output tokens that fit in `budget_ms`."""
        if budget_ms < self.ttft_ms:
            return 0
        return 1 + math.floor((budget_ms - self.ttft_ms) / max(self.tpot_ms, 1e-3))


@dataclass
class VariantLatency:
    """The fitted TTFT and TPOT of one variant on one worker."""

    ttft: RecursiveLeastSquares
    tpot: RecursiveLeastSquares

    @classmethod
    def seeded(cls, prefill_ms_per_token: float, decode_ms_per_token: float) -> VariantLatency:
        """Starts from one sequence's measured speeds: its first token costs the prefill of what is
        ahead of it and a fifth of a step per running sequence (prefill chunks share steps with
        them); each later token a step, a tenth longer per other sequence in the batch."""
        prefill, decode = prefill_ms_per_token, decode_ms_per_token
        return cls(
            ttft=RecursiveLeastSquares([0.0, prefill, decode * 0.2], [decode, prefill, decode]),
            tpot=RecursiveLeastSquares([decode * 0.9, decode * 0.1], [decode, decode * 0.2]),
        )

    @staticmethod
    def ttft_features(prompt_tokens: int, load: Load) -> list[float]:
        return [1.0, float(load.queued_tokens + prompt_tokens), float(load.running)]

    @staticmethod
    def tpot_features(load: Load) -> list[float]:
        return [1.0, float(load.running + 1)]  # itself among them

    def predict(self, prompt_tokens: int, output_tokens: int, load: Load) -> Prediction:
        ttft = max(self.ttft.predict_rising(self.ttft_features(prompt_tokens, load)), 0.0)
        tpot = max(self.tpot.predict_rising(self.tpot_features(load)), 0.0)
        return Prediction(ttft + load.others_ms, tpot + load.others_ms, output_tokens)

    def step_ms(self) -> float:
        """One step of one row alone: what it adds to every step of the worker's other variants."""
        return max(self.tpot.predict_rising([1.0, 1.0]), 0.0)


@dataclass
class ModelShape:
    """What streams of one model taught about its requests: chars per prompt token, and how many
    tokens follow a thought (for versions that reason)."""

    chars_per_token: float = float(PROMPT_CHARS_PER_TOKEN)
    answer_tokens: float = FIRST_ANSWER_TOKENS

    def prompt_tokens(self, chars: int) -> int:
        return max(1, math.ceil(chars / self.chars_per_token))

    def learn(self, chars: int, usage: inference_pb2.Usage) -> None:
        if usage.prompt_tokens:
            self.chars_per_token += LEARNING * (max(chars, 1) / usage.prompt_tokens - self.chars_per_token)
        if usage.reasoning_tokens:
            answer = usage.completion_tokens - usage.reasoning_tokens
            self.answer_tokens += LEARNING * (answer - self.answer_tokens)


# (worker address, model, version, copy name: the reference's dtype or a variant's name)
Key = tuple[str, str, str, str]


@dataclass(frozen=True)
class Observation:
    """One stream that reached its first token, as the latency model learns from it: finished, or
    cut off at its deadline or by its client (what it took so far is learned too: fitting finished
    streams only would never see the slow ones a deadline cuts)."""

    key: Key
    load: Load  # when it was placed
    prompt_tokens: int  # those the worker prefilled when it finished, else the estimate it was placed with
    tokens: int  # generated so far
    ttft_ms: float  # from placement to the first token
    last_ms: float  # from placement to the last token so far


@dataclass
class LatencyModel:
    """Every variant's fitted latency, and every model's shape, as this gateway has seen them."""

    variants: dict[Key, VariantLatency] = field(default_factory=dict)
    shapes: dict[str, ModelShape] = field(default_factory=dict)

    def shape(self, model: str) -> ModelShape:
        return self.shapes.setdefault(model, ModelShape())

    def variant(self, key: Key, measured: worker_pb2.LoadedVariant) -> VariantLatency:
        """The fit for `key`, seeded from its worker's measurement (`measured`) the first time."""
        fit = self.variants.get(key)
        if fit is None:
            if measured.decode_ms_per_token > 0:
                fit = VariantLatency.seeded(measured.prefill_ms_per_token, measured.decode_ms_per_token)
            else:
                fit = VariantLatency.seeded(GENERIC_PREFILL_MS_PER_TOKEN, GENERIC_DECODE_MS_PER_TOKEN)
            self.variants[key] = fit
        return fit

    def observe(self, seen: Observation) -> None:
        """Fits the stream's variant to what the stream took."""
        fit = self.variants.get(seen.key)
        if fit is None:
            return
        others = seen.load.others_ms  # the other variants' steps, as it was placed: not this one's
        fit.ttft.update(VariantLatency.ttft_features(seen.prompt_tokens, seen.load), seen.ttft_ms - others)
        if seen.tokens > 1:
            tpot = (seen.last_ms - seen.ttft_ms) / (seen.tokens - 1)
            fit.tpot.update(VariantLatency.tpot_features(seen.load), tpot - others)
