"""Sampling: greedy, seeded reproducibility, top-k and top-p bounds; logit bias and penalties."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from workers.sampling import SamplingParams, adjust, make_generator, sample

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])


def draws(params: SamplingParams, n: int = 200) -> list[int]:
    generator = make_generator(params)
    return [sample(LOGITS, params, generator) for _ in range(n)]


def test_temperature_zero_is_greedy() -> None:
    assert set(draws(SamplingParams(temperature=0.0, seed=1), 20)) == {0}


def test_the_same_seed_gives_the_same_tokens_and_another_seed_differs() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(temperature=1.0, seed=43))


def test_top_k_never_leaves_the_k_most_likely() -> None:
    assert set(draws(SamplingParams(temperature=5.0, top_k=2, seed=7), 500)) == {0, 1}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.softmax(LOGITS, dim=-1)  # 0.35, 0.21, 0.13, ...
    assert probs[0] < 0.5 < probs[0] + probs[1]
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5, seed=7), 500)) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.01, seed=7), 50)) == {0}


def test_unseeded_requests_are_not_all_identical() -> None:
    params = SamplingParams(temperature=1.0)
    assert len({tuple(draws(params, 30)) for _ in range(3)}) > 1


PENALIZED = SamplingParams(
    repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.25, logit_bias=((0, -100.0), (9, 2.0))
)
PROMPT, OUTPUT = [3, 7, 7, 20], [7, 9, 9, 9, 41]


def test_logit_bias_then_transformers_repetition_penalty_then_openai_frequency_and_presence() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 4
    got = logits.clone()
    adjust(got, PENALIZED, PROMPT, OUTPUT, [])
    expected = logits.clone()
    expected[0, 0] -= 100.0
    expected[0, 9] += 2.0
    # transformers' penalty: every token of the prompt and the completion, each once
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([PROMPT + OUTPUT]), expected)
    # OpenAI's: the completion's tokens, by how often they occur and whether they do
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=50).float()
    expected -= 0.4 * counts - 0.25 * (counts > 0).float()
    torch.testing.assert_close(got, expected)
    assert got[0, 20] != logits[0, 20] and got[0, 41] != logits[0, 41]  # a prompt's token, an output's


def test_a_drafted_row_is_adjusted_as_the_same_row_a_step_later() -> None:
    rows = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    draft = [9, 13, 9]  # row i follows the completion and draft[:i]
    together = rows.clone()
    adjust(together, PENALIZED, PROMPT, OUTPUT, draft)
    for i in range(4):
        alone = rows[i : i + 1].clone()
        adjust(alone, PENALIZED, PROMPT, OUTPUT + draft[:i], [])
        assert torch.equal(together[i : i + 1], alone)


def test_only_a_bias_or_a_penalty_adjusts() -> None:
    assert not SamplingParams(repetition_penalty=1.0).penalizes
    assert SamplingParams(presence_penalty=0.1).penalizes and SamplingParams(repetition_penalty=0.9).penalizes
    logits = torch.randn(1, 50)
    unchanged = logits.clone()
    adjust(unchanged, SamplingParams(), PROMPT, OUTPUT, [])
    assert torch.equal(unchanged, logits)
