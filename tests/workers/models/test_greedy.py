"""Batched greedy decoding outside the engine: the same answers alone or batched, as a cache-free pass."""

from __future__ import annotations

import pytest

from tests.support.models import reference_greedy
from tests.support.models import tiny_model as new_tiny_model
from workers.models.builtin import TOKENIZER
from workers.models.greedy import greedy_answers
from workers.models.interface import CausalLM


@pytest.fixture
def tiny_model() -> CausalLM:
    return new_tiny_model(3)


PROMPTS = ["1+2=", "47+38=", "0+0=", "123+4567=", "9+10=", "5+5="]


def test_greedy_answers_batched_matches_one_at_a_time(tiny_model: CausalLM) -> None:
    batched = greedy_answers(tiny_model, TOKENIZER, PROMPTS, max_new_tokens=20, batch_size=4)
    single = [greedy_answers(tiny_model, TOKENIZER, [p], max_new_tokens=20)[0] for p in PROMPTS]
    assert len(batched) == len(PROMPTS)
    assert batched == single
    assert any(batched)  # the random model does emit text, so the comparison means something


def test_greedy_answers_match_uncached_decoding(tiny_model: CausalLM) -> None:
    answers = greedy_answers(tiny_model, TOKENIZER, PROMPTS, max_new_tokens=20)
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        generated = reference_greedy(tiny_model, prompt, max_new_tokens=20)
        assert TOKENIZER.think_id not in generated  # so the whole continuation is the answer
        assert answer == TOKENIZER.decode([t for t in generated if t != TOKENIZER.eos_id])


def test_greedy_answers_stop_at_max_seq_len(tiny_model: CausalLM) -> None:
    answers = greedy_answers(tiny_model, TOKENIZER, PROMPTS, max_new_tokens=1000)
    assert len(answers) == len(PROMPTS)
