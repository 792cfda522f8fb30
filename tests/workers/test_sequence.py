"""A sequence's state machine: reasoning vs answer, budgets, stop strings, lengths, UTF-8."""

from __future__ import annotations

from workers.models.builtin import TOKENIZER
from workers.sequence import Delta, FinishReason, GenerationParams, Sequence

TOK = TOKENIZER


def feed(seq: Sequence, ids: list[int]) -> Delta:
    """Appends tokens (honouring forced ones) until the sequence ends or ids run out."""
    total = Delta()
    for token in ids:
        forced = seq.forced_token()
        total.merge(seq.append(forced if forced is not None else token))
        if seq.finish_reason is not None:
            break
    return total


def text_ids(text: str) -> list[int]:
    return TOK.encode(text, bos=False)


def new(max_tokens: int = 100, stop: tuple[str, ...] = (), budget: int = 0, max_len: int = 128) -> Sequence:
    params = GenerationParams(max_tokens=max_tokens, stop=stop, reasoning_budget=budget)
    return Sequence(TOK.encode("47+38="), params, TOK, max_len)


def test_reasoning_and_answer_are_separated() -> None:
    seq = new()
    ids = [TOK.think_id, *text_ids("7+8=15"), TOK.end_think_id, *text_ids("85"), TOK.eos_id]
    out = feed(seq, ids)
    assert (out.reasoning_text, out.text, out.finish_reason) == ("7+8=15", "85", FinishReason.STOP)
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.reasoning_tokens) == (7, 11, 6)


def test_an_answer_without_thinking() -> None:
    out = feed(new(), [*text_ids("85"), TOK.eos_id])
    assert (out.reasoning_text, out.text) == ("", "85")


def test_reasoning_budget_closes_the_thought_and_the_model_answers() -> None:
    seq = new(budget=3)
    out = feed(seq, [TOK.think_id, *text_ids("7+8=15"), *text_ids("85"), TOK.eos_id])
    assert out.reasoning_text == "7+8"
    assert TOK.end_think_id in seq.output_ids
    assert seq.reasoning_tokens == 3
    assert out.finish_reason is FinishReason.STOP


def test_max_tokens_ends_with_length() -> None:
    out = feed(new(max_tokens=4), text_ids("123456789"))
    assert (out.text, out.finish_reason) == ("1234", FinishReason.LENGTH)


def test_context_length_ends_with_length() -> None:
    out = feed(new(max_len=10), text_ids("123456789"))  # 7 prompt tokens + 3
    assert (out.text, out.finish_reason) == ("123", FinishReason.LENGTH)


def test_stop_string_across_tokens_is_cut_and_never_leaked() -> None:
    seq = new(stop=("END",))
    emitted = []
    for token in text_ids("85 ENDmore"):
        delta = seq.append(token)
        emitted.append(delta.text)
        if seq.finish_reason:
            break
    assert "".join(emitted) == "85 "
    assert "E" not in "".join(emitted)
    assert seq.finish_reason is FinishReason.STOP


def test_held_back_prefix_is_released_when_it_is_not_a_stop() -> None:
    out = feed(new(stop=("END",)), [*text_ids("85 ENough"), TOK.eos_id])
    assert out.text == "85 ENough"


def test_multibyte_characters_split_across_tokens() -> None:
    out = feed(new(), [*text_ids("é→ok"), TOK.eos_id])
    assert out.text == "é→ok"


def test_specials_never_reach_text() -> None:
    out = feed(new(), [TOK.bos_id, *text_ids("1"), TOK.think_id, TOK.pad_id, TOK.eos_id])
    assert out.text == "1"
