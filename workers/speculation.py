"""Drafts a sequence's next tokens by prompt lookup (speculative decoding that costs no model).

Where the sequence's last few tokens occurred before, in its prompt or its own output, the tokens
that followed them then are the draft: answers quote their prompt (a summary, an edited file, a
question repeated back) and repeat themselves (lists, code). The engine feeds a draft to one decode
forward beside the sequence's next input, one row per token at its own position, picks each row's
token as it would a step later, and keeps the drafted tokens that are the tokens picked
(workers/runner.py), so a draft is never wrong, only wasted rows. Each draft row is a decode row
like any other, in the very arithmetic it would have had a step later, and draws from the
request's generator just as that step would: outputs, greedy or seeded, are what they are without
drafts, to the standard batching keeps (docs/batching.md#exactness).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The n-grams looked up, longest first. A single token recurs all the time whatever follows it, and
# so do pairs ("of the"): with pairs looked up too, int4 SmolLM2 lost 10% on free text at 4 streams
# where 3 and 4 tokens did not (docs/benchmarks.md#speculative-decoding-prompt-lookup).
LONGEST_NGRAM = 4
SHORTEST_NGRAM = 3


class PromptLookup:
    """One sequence's tokens, searched for the n-gram it ends with: 4 bytes a token it may hold."""

    def __init__(self, prompt_ids: Sequence[int], capacity: int):
        self._tokens = np.empty(capacity, dtype=np.int32)  # prompt, then output, up to capacity
        self._tokens[: len(prompt_ids)] = prompt_ids
        self._prompt_len = self._len = len(prompt_ids)

    def draft(self, output_ids: Sequence[int], most: int) -> list[int]:
        """Up to `most` tokens that followed the latest earlier occurrence of the longest n-gram the
        sequence (prompt, then `output_ids`) ends with; [] when none recurs."""
        new = output_ids[self._len - self._prompt_len :]
        self._tokens[self._len : self._len + len(new)] = new
        self._len += len(new)
        tokens, last = self._tokens[: self._len], self._len - 1
        if last < SHORTEST_NGRAM:  # too short to hold an n-gram and an earlier one
            return []
        # where the last token occurred before: the ends of earlier occurrences, each with a token after
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        matched = np.ones(len(ends), dtype=np.int64)  # how many tokens before each end match too
        for back in range(1, min(LONGEST_NGRAM, last + 1)):
            going = (matched == back) & (ends >= back)
            going[going] = tokens[ends[going] - back] == tokens[last - back]
            matched += going
        if not len(ends) or matched.max() < SHORTEST_NGRAM:
            return []
        start = ends[matched == matched.max()][-1] + 1
        return tokens[start : start + most].tolist()
