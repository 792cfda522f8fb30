"""Sampling: greedy, seeded reproducibility, top-k and top-p bounds."""

from __future__ import annotations

import torch

from workers.sampling import SamplingParams, make_generator, sample

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
