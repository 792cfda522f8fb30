"""Prompt lookup: drafts are what followed the latest earlier occurrence of the longest recurring
n-gram the sequence ends with, in its prompt or its output."""

from __future__ import annotations

from workers.speculation import LONGEST_NGRAM, SHORTEST_NGRAM, PromptLookup


def test_a_draft_is_what_followed_the_sequences_last_tokens_in_its_prompt() -> None:
    lookup = PromptLookup([5, 6, 7, 8, 9, 10])
    assert lookup.draft([1, 6, 7], 3) == [8, 9, 10]
    assert lookup.draft([1, 6, 7], 2) == [8, 9]  # never more than asked
    assert lookup.draft([1, 6, 7, 8, 9], 3) == [10, 1, 6]  # on into the output after it


def test_the_latest_occurrence_of_the_longest_ngram_wins() -> None:
    #            0  1  2  3  4  5  6  7  8  9
    prompt = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2]
    lookup = PromptLookup(prompt)
    assert lookup.draft([3], 1) == [40]  # "1 2 3" (at 0) beats "2 3", which recurs later (at 5)
    assert PromptLookup(prompt[1:]).draft([3], 1) == [50]  # without it, the latest "2 3"


def test_the_output_is_looked_up_as_it_grows() -> None:
    lookup = PromptLookup([100, 101])
    assert lookup.draft([7, 8, 9], 2) == []
    assert lookup.draft([7, 8, 9, 7, 8], 2) == [9, 7]  # its own output repeats


def test_no_draft_without_a_recurring_ngram_or_room() -> None:
    assert SHORTEST_NGRAM >= 2 and LONGEST_NGRAM >= SHORTEST_NGRAM
    assert PromptLookup([1, 2, 3, 4]).draft([9, 4], 3) == []  # one token alone recurs by chance
    assert PromptLookup([1, 2, 3, 4]).draft([1, 2], 0) == []
    assert PromptLookup([]).draft([], 3) == []
