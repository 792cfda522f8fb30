"""Drafts a sequence's next tokens by prompt lookup (speculative decoding that costs no model).

Where the sequence's last few tokens occurred before, in its prompt or its own output, the tokens
that followed them then are the draft: answers quote their prompt (a summary, an edited file, a
question repeated back) and repeat themselves (lists, code). The engine feeds a draft to one decode
forward beside the sequence's next input, one row per token at its own position, and keeps the
drafted tokens the model itself picks there (workers/runner.py), so a draft is never wrong, only
wasted rows. Each draft row is a decode row like any other, in the very arithmetic it would have
had a step later: greedy outputs are what they are without drafts, to the standard batching keeps
(docs/batching.md#exactness), and sampled ones are drawn from the same distribution
(workers/sampling.py).
"""

from __future__ import annotations

from collections.abc import Sequence

# The n-grams looked up, longest first. Four tokens rarely recur by chance; a single token recurs
# all the time, whatever follows it. Looking up 3 and 4 only measured no different from 2 to 4
# (docs/benchmarks.md#speculative-decoding-prompt-lookup).
LONGEST_NGRAM = 4
SHORTEST_NGRAM = 2


class PromptLookup:
    """One sequence's n-gram index: where each n-gram it holds last occurred with a continuation."""

    def __init__(self, prompt_ids: Sequence[int]):
        self._tokens: list[int] = []
        self._prompt_len = len(prompt_ids)
        # an n-gram -> the index of the token after its latest occurrence that has one
        self._after: dict[tuple[int, ...], int] = {}
        self._extend(prompt_ids)

    def draft(self, output_ids: Sequence[int], most: int) -> list[int]:
        """Up to `most` tokens that followed the latest earlier occurrence of the longest n-gram the
        sequence (prompt, then `output_ids`) ends with; [] when none recurs."""
        self._extend(output_ids[len(self._tokens) - self._prompt_len :])
        tokens = self._tokens
        if most <= 0:
            return []
        for n in range(min(LONGEST_NGRAM, len(tokens)), SHORTEST_NGRAM - 1, -1):
            start = self._after.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + most]
        return []

    def _extend(self, new: Sequence[int]) -> None:
        """Indexes new tokens: each n-gram that ends just before one gets it as its continuation."""
        tokens, after = self._tokens, self._after
        for token in new:
            end = len(tokens)
            for n in range(SHORTEST_NGRAM, min(LONGEST_NGRAM, end) + 1):
                after[tuple(tokens[end - n : end])] = end
            tokens.append(token)
