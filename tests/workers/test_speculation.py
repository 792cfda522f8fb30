"""Prompt lookup: drafts are what followed the latest earlier occurrence of the longest recurring
n-gram the sequence ends with, in its prompt or its output."""

from __future__ import annotations

import random

from workers.speculation import LONGEST_NGRAM, SHORTEST_NGRAM, PromptLookup


def test_a_draft_is_what_followed_the_sequences_last_tokens_in_its_prompt() -> None:
    lookup = PromptLookup([5, 6, 7, 8, 9, 10], 64)
    assert lookup.draft([1, 5, 6, 7], 3) == [8, 9, 10]
    assert lookup.draft([1, 5, 6, 7], 2) == [8, 9]  # never more than asked
    assert lookup.draft([1, 5, 6, 7, 8, 9], 3) == [10, 1, 5]  # on into the output after it


def test_the_latest_occurrence_of_the_longest_ngram_wins() -> None:
    #         0  1  2  3  4   5  6  7  8  9   10 11 12
    prompt = [1, 2, 3, 4, 40, 9, 2, 3, 4, 50, 1, 2, 3]
    lookup = PromptLookup(prompt, 64)
    assert lookup.draft([4], 1) == [40]  # "1 2 3 4" (at 0) beats "2 3 4", which recurs later (at 6)
    assert PromptLookup(prompt[1:], 64).draft([4], 1) == [50]  # without it, the latest "2 3 4"


def test_the_output_is_looked_up_as_it_grows() -> None:
    lookup = PromptLookup([100, 101], 64)
    assert lookup.draft([7, 8, 9], 2) == []
    assert lookup.draft([7, 8, 9, 7, 8, 9], 2) == [7, 8]  # its own output repeats


def test_no_draft_without_a_recurring_ngram_or_room() -> None:
    assert SHORTEST_NGRAM == 3 and LONGEST_NGRAM == 4
    assert PromptLookup([1, 2, 3, 4], 64).draft([9, 4], 3) == []  # one token alone recurs by chance
    assert PromptLookup([1, 2, 3, 4], 64).draft([9, 3, 4], 3) == []  # and so do two
    assert PromptLookup([1, 2, 3, 4], 64).draft([1, 2, 3], 3) == [4, 1, 2]  # "1 2 3" recurs:
    assert PromptLookup([1, 2, 3, 4], 64).draft([1, 2, 3], 0) == []  # yet no room, no draft
    assert PromptLookup([], 64).draft([], 3) == []


def latest_longest(tokens: list[int], most: int) -> list[int]:
    """The rule, searched the slow way: the longest n-gram first, its latest earlier occurrence."""
    for n in range(LONGEST_NGRAM, SHORTEST_NGRAM - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if len(tokens) > n and tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + most]
    return []


def test_drafts_follow_the_rule_on_sequences_full_of_repeats() -> None:
    rng = random.Random(4)
    for _ in range(200):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
        output = [rng.randrange(3) for _ in range(30)]
        lookup = PromptLookup(prompt, len(prompt) + len(output))
        for grown in range(len(output) + 1):  # as a sequence grows, a token a step
            most = rng.randrange(1, 6)
            assert lookup.draft(output[:grown], most) == latest_longest(prompt + output[:grown], most)
