"""Structured outputs on the worker: a format's grammar (reflow/structured_output.py) compiled with
llguidance against a version's vocabulary, and each constrained sequence's matcher, which masks, row
by row inside the shared batch, the tokens that cannot continue the grammar.

A model that reasons (`<think>` ... `</think>`, workers/sequence.py) thinks freely: the grammar holds
its answer, and before the answer starts `<think>` may open a thought. Only the answer's tokens go
through the matcher.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence as Ids

import llguidance
import numpy as np
import torch
from torch import Tensor

from reflow.errors import InvalidArgument
from workers.models.byte_tokenizer import SPECIAL_TOKENS, ByteTokenizer
from workers.models.hf_tokenizer import HFTokenizer
from workers.models.interface import Tokenizer
from workers.sequence import Phase, Sequence

MAX_COMPILED = 64  # grammars kept compiled per version, the latest used; a compile takes ~1 ms for a schema


class Grammars:
    """The grammars compiled for one version's vocabulary, the latest MAX_COMPILED kept by their
    text. Thread-safe: requests compile theirs off the engine thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the model's logits, which may pad the tokenizer's vocabulary
        self._vocabulary: llguidance.LLTokenizer | None = None  # made at the first grammar (~0.2 s)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # each at its start
        self._lock = threading.Lock()

    def constraint(self, grammar: str) -> Constraint:
        """A matcher of `grammar` at its start, for one sequence: compiled once for this vocabulary,
        copied for each request; InvalidArgument where it does not compile against it."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is None:
                compiled = self._compile(grammar)
                self._compiled[grammar] = compiled
                if len(self._compiled) > MAX_COMPILED:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(grammar)
        return Constraint(compiled.deep_copy(), self._tokenizer.reasoning_markers, self._tokenizer.eos_ids)

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        if self._vocabulary is None:
            self._vocabulary = vocabulary(self._tokenizer, self._vocab_size)
        matcher = llguidance.LLMatcher(self._vocabulary, grammar)
        if matcher.is_error():
            raise InvalidArgument(f"the format cannot be enforced on this model: {matcher.get_error()}")
        matcher.compute_bitmask()  # the first mask over a vocabulary builds what later ones reuse
        return matcher


class Constraint:
    """One sequence's place in its grammar: which tokens each of its rows in a step may pick, and
    the tokens it picked."""

    def __init__(self, matcher: llguidance.LLMatcher, markers: tuple[int, int] | None, ends: Ids[int]):
        self._matcher = matcher
        self._opens = None if markers is None else markers[0]  # `<think>`, which the answer may start with
        self._ends = frozenset(ends)

    def restrict(self, logits: Tensor, sequence: Sequence, draft: Ids[int]) -> None:
        """Sets to -inf, in place, the logits [n, V] of the tokens row i may not pick: the grammar
        after the answer so far and the first i tokens of `draft` (which `usable_draft` cut to
        tokens it takes). Nothing while the sequence thinks."""
        if sequence.phase is Phase.REASONING:
            return
        rows, vocab_size = logits.shape
        masks = []  # row i's bitmask: bit t of byte t // 8 is set where token t may come next
        for row in range(rows):
            masks.append(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8))
            if row < rows - 1 and not self._matcher.consume_token(draft[row]):
                raise RuntimeError(f"a drafted token left the grammar: {self._matcher.get_error()}")
        if not self._matcher.rollback(rows - 1):
            raise RuntimeError(f"the grammar could not take back a draft: {self._matcher.get_error()}")
        allowed = np.zeros((rows, vocab_size), dtype=np.uint8)  # ids past the grammar's vocabulary: never
        known = np.unpackbits(np.stack(masks), axis=1, bitorder="little")[:, :vocab_size]
        allowed[:, : known.shape[1]] = known
        if self._opens is not None and sequence.phase is Phase.START:  # never drafted: one row
            allowed[0, self._opens] = 1
        logits.masked_fill_(torch.from_numpy(allowed == 0).to(logits.device), float("-inf"))

    def accept(self, sequence: Sequence, token: int) -> None:
        """Takes the token picked next, before `sequence` appends it: into the grammar when it is
        part of the answer."""
        phase = sequence.phase
        thought = phase is Phase.REASONING or (token == self._opens and phase is Phase.START)
        if not thought and not self._matcher.consume_token(token):
            raise RuntimeError(f"the completion left its grammar: {self._matcher.get_error()}")

    def usable_draft(self, sequence: Sequence, draft: list[int]) -> list[int]:
        """The tokens of `draft` the grammar takes after the answer so far, up to the first it does
        not, and before any end token (llguidance rolls back one token too few over an end); none
        before the answer starts (a drafted `<think>` would change what holds the rows)."""
        if sequence.phase is not Phase.ANSWER or not draft:
            return []
        taken = draft[: self._matcher.validate_tokens(draft)]
        return taken[: next((i for i, token in enumerate(taken) if token in self._ends), len(taken))]


def vocabulary(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """`tokenizer`'s vocabulary as llguidance matches grammars against it, `vocab_size` ids long
    (the model's logits), its end ids the ones a grammar ends on."""
    eos = list(tokenizer.eos_ids)
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        wrapped = llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer))
        return llguidance.LLTokenizer(wrapped, n_vocab=vocab_size)
    raise InvalidArgument(f"structured outputs are not available for {type(tokenizer).__name__} tokenizers")


class _ByteVocabulary:
    """The byte tokenizer as llguidance's TokenizerWrapper reads one: each id's bytes, the specials'."""

    def __init__(self, tokenizer: ByteTokenizer):
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [bytes([i]) for i in range(256)] + [token.encode() for token in SPECIAL_TOKENS]
        self.special_token_ids = list(range(256, 256 + len(SPECIAL_TOKENS)))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)
