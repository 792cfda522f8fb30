"""One sequence's decoding state: reasoning vs answer phase, budgets, stop strings, finish reason."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from workers.models.interface import Tokenizer
from workers.sampling import SamplingParams, TokenLogprob


class FinishReason(enum.Enum):
    """Why a sequence ended; mirrors reflow.v1.FinishReason."""

    STOP = 1
    LENGTH = 2
    CANCELLED = 3
    ERROR = 4


@dataclass(frozen=True)
class GenerationParams:
    """Everything a request asks of the decode loop, defaults already applied."""

    max_tokens: int  # 0: none, the prompt only (its log probabilities, when asked for)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    reasoning_budget: int = 0  # 0 = bounded only by max_tokens
    top_logprobs: int | None = None  # None: no log probabilities; k: each token's and the k likeliest
    prompt_logprobs: bool = False  # the prompt tokens' too (with top_logprobs alternatives), sent first
    grammar: str | None = None  # llguidance's grammar the answer is held to (reflow/structured_output.py)


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished sequence."""

    prompt_tokens: int
    completion_tokens: int  # reasoning included
    reasoning_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, those whose keys and values the prefix cache held


@dataclass
class Delta:
    """What one step added to a sequence's output."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning_text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # on the last delta only
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per prompt token, first delta

    def merge(self, later: Delta) -> None:
        """Appends `later` to this delta, in order."""
        self.token_ids.extend(later.token_ids)
        self.logprobs.extend(later.logprobs)
        self.prompt_logprobs.extend(later.prompt_logprobs)
        self.text += later.text
        self.reasoning_text += later.reasoning_text
        self.finish_reason = later.finish_reason or self.finish_reason
        self.usage = later.usage or self.usage


class Phase(enum.Enum):
    """Where the sequence is in `<think>…</think> answer`."""

    START = 0
    REASONING = 1
    ANSWER = 2


class Sequence:
    """Consumes generated tokens one at a time and turns them into text and reasoning deltas."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: GenerationParams,
        tokenizer: Tokenizer,
        max_len: int,
    ):
        self.prompt_ids = prompt_ids
        self.params = params
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.output_ids: list[int] = []
        self.reasoning_tokens = 0
        self.cached_tokens = 0  # of the prompt, tokens the prefix cache held (set when admitted)
        self.phase = Phase.START
        self.finish_reason: FinishReason | None = None
        self._decoder = tokenizer.decoder()
        # the ids of `<think>` and `</think>`; None for models that do not reason
        markers = tokenizer.reasoning_markers
        self._opens: int | None = markers[0] if markers else None
        self._closes: int | None = markers[1] if markers else None
        self._held = ""  # answer text that may be the start of a stop string

    @property
    def total_len(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    def forced_token(self) -> int | None:
        """A token the worker must emit instead of sampling: `</think>` once the budget is spent."""
        budget = self.params.reasoning_budget
        if self.phase is Phase.REASONING and budget and self.reasoning_tokens >= budget:
            return self._closes
        return None

    def append(self, token_id: int) -> Delta:
        """Records one generated token and returns what it adds to the output."""
        tok = self.tokenizer
        self.output_ids.append(token_id)
        delta = Delta(token_ids=[token_id])
        if token_id in tok.eos_ids:
            return self._finish(delta, FinishReason.STOP)
        if token_id == self._opens and self.phase is Phase.START:
            self.phase = Phase.REASONING
        elif token_id == self._closes and self.phase is Phase.REASONING:
            delta.reasoning_text = self._decoder.flush()
            self.phase = Phase.ANSWER
        elif self.phase is Phase.REASONING:
            self.reasoning_tokens += 1
            delta.reasoning_text = self._decoder.push(token_id)
        elif not tok.is_special(token_id):
            self.phase = Phase.ANSWER
            delta.text, stopped = self._push_answer(self._decoder.push(token_id))
            if stopped:
                return self._finish(delta, FinishReason.STOP)
        if len(self.output_ids) >= self.params.max_tokens or self.total_len >= self.max_len:
            return self._finish(delta, FinishReason.LENGTH)
        return delta

    def end_unanswered(self) -> Delta:
        """Ends a sequence that is to generate nothing (max_tokens 0) once its prompt is in."""
        return self._finish(Delta(), FinishReason.LENGTH)

    def _finish(self, delta: Delta, reason: FinishReason) -> Delta:
        """Ends the sequence, flushing held-back text into the phase it belongs to."""
        rest = self._held + self._decoder.flush()
        self._held = ""
        if self.phase is Phase.REASONING:
            delta.reasoning_text += rest
        else:
            delta.text += rest
        self.finish_reason = delta.finish_reason = reason
        delta.usage = Usage(
            len(self.prompt_ids), len(self.output_ids), self.reasoning_tokens, self.cached_tokens
        )
        return delta

    def _push_answer(self, text: str) -> tuple[str, bool]:
        """Answer text safe to emit now, and whether a stop string was reached.

        Text that may be the start of a stop string is held back until it is not.
        """
        pending = self._held + text
        stops = self.params.stop
        hits = [i for i in (pending.find(s) for s in stops) if i >= 0]
        if hits:
            self._held = ""
            return pending[: min(hits)], True
        keep = max((n for s in stops for n in range(1, len(s)) if pending.endswith(s[:n])), default=0)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep], False
