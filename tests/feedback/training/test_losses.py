"""The preference losses: KTO's and DPO's values computed by hand, gradients that reach only the
policy, and a DPO pair whose preferred completion training makes the more likely one; the logits
they are computed from, the output head's on the completion tokens alone."""

from __future__ import annotations

import math

import torch

from feedback.tasks.task import Example
from feedback.training.dataset import Dataset, Pair
from feedback.training.examples import example_rows, pad_rows
from feedback.training.losses import completion_logits, dpo_loss, kto_loss, sequence_logps
from feedback.training.trainer import FinetuneConfig, train_candidate
from tests.support.models import tiny_model
from workers.models.builtin import TOKENIZER
from workers.models.interface import CausalLM


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_hand_computed_values_on_a_tiny_batch() -> None:
    policy = torch.tensor([-2.0, -5.0, -3.0])
    reference = torch.tensor([-3.0, -4.0, -3.0])
    kl_policy = torch.tensor([-6.0, -7.0])
    kl_reference = torch.tensor([-6.5, -7.1])  # z0 = mean(0.5, 0.1) = 0.3
    desirable = torch.tensor([True, False, True])
    result = kto_loss(policy, reference, kl_policy, kl_reference, desirable, beta=0.5, desirable_weight=2.0)
    rewards = [1.0, -1.0, 0.0]
    expected = [
        2.0 * (1 - sigmoid(0.5 * (rewards[0] - 0.3))),
        1.0 * (1 - sigmoid(0.5 * (0.3 - rewards[1]))),
        2.0 * (1 - sigmoid(0.5 * (rewards[2] - 0.3))),
    ]
    assert math.isclose(result.kl, 0.3, rel_tol=1e-6)
    assert torch.allclose(result.rewards, torch.tensor(rewards))
    assert math.isclose(result.loss.item(), sum(expected) / 3, rel_tol=1e-5)


def test_the_kl_estimate_is_clamped_at_zero() -> None:
    result = kto_loss(
        torch.tensor([-1.0]), torch.tensor([-1.0]), torch.tensor([-5.0]), torch.tensor([-4.0]),
        torch.tensor([True]), beta=1.0,
    )  # fmt: skip
    assert result.kl == 0.0
    assert math.isclose(result.loss.item(), 1 - sigmoid(0.0), rel_tol=1e-6)


def test_gradients_flow_into_the_policy_only() -> None:
    policy, reference = tiny_model(0).train(), tiny_model(1)
    for p in reference.parameters():
        p.requires_grad_(False)
    tokens = torch.randint(0, 250, (4, 10))
    mask = torch.zeros_like(tokens)
    mask[:, 5:] = 1
    shifted = torch.roll(tokens, 1, dims=0)  # mismatched pairs for the KL estimate
    result = kto_loss(
        sequence_logps(policy, tokens, mask), sequence_logps(reference, tokens, mask),
        sequence_logps(policy, shifted, mask), sequence_logps(reference, shifted, mask),
        torch.tensor([True, False, True, False]),
    )  # fmt: skip
    result.loss.backward()
    assert all(p.grad is None for p in reference.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    # the reference point is detached: the mismatched pairs add no gradient of their own
    policy.zero_grad()
    z0_only = kto_loss(
        sequence_logps(policy, tokens, mask).detach(), sequence_logps(reference, tokens, mask),
        sequence_logps(policy, shifted, mask), sequence_logps(reference, shifted, mask),
        torch.tensor([True, False, True, False]),
    )  # fmt: skip
    assert not z0_only.loss.requires_grad


def test_sequence_logps_counts_only_completion_tokens() -> None:
    model = tiny_model(0)
    tokens = torch.randint(0, 250, (2, 8))
    none, some = torch.zeros_like(tokens), torch.zeros_like(tokens)
    some[:, 6:] = 1
    with torch.no_grad():
        assert torch.equal(sequence_logps(model, tokens, none), torch.zeros(2))
        logits = model(tokens[:, :-1]).log_softmax(-1)
        by_hand = logits[:, 5, :].gather(1, tokens[:, 6:7]).squeeze(1) + logits[:, 6, :].gather(
            1, tokens[:, 7:8]
        ).squeeze(1)
        assert torch.allclose(sequence_logps(model, tokens, some), by_hand, atol=1e-5)


def test_completion_logits_are_the_whole_rows_logits_where_a_completion_token_is_predicted() -> None:
    model = tiny_model(0)
    tokens = torch.randint(0, 250, (3, 9))
    mask = torch.zeros_like(tokens)
    mask[0, 4:], mask[2, 7:] = 1, 1  # ragged completions, and a row (1) with none
    with torch.no_grad():
        found = completion_logits(model, tokens, mask)
        whole = model(tokens[:, :-1])  # [B, T-1, V]: position t predicts token t + 1
    positions = [(0, t) for t in range(3, 8)] + [(2, 6), (2, 7)]
    assert found.rows.tolist() == [row for row, _ in positions]
    assert found.targets.tolist() == [int(tokens[row, t + 1]) for row, t in positions]
    torch.testing.assert_close(found.logits, torch.stack([whole[row, t] for row, t in positions]))


def test_dpo_hand_computed_values_with_and_without_label_smoothing() -> None:
    chosen, rejected = torch.tensor([-2.0, -6.0]), torch.tensor([-4.0, -3.0])
    reference_chosen, reference_rejected = torch.tensor([-3.0, -5.0]), torch.tensor([-3.5, -3.5])
    # margins: (-2 + 3) - (-4 + 3.5) = 1.5 and (-6 + 5) - (-3 + 3.5) = -1.5
    log_sigmoid = [math.log(sigmoid(0.5 * 1.5)), math.log(sigmoid(0.5 * -1.5))]
    plain = dpo_loss(chosen, rejected, reference_chosen, reference_rejected, beta=0.5)
    assert math.isclose(plain.item(), -sum(log_sigmoid) / 2, rel_tol=1e-6)
    smoothed = dpo_loss(chosen, rejected, reference_chosen, reference_rejected, beta=0.5, label_smoothing=0.1)
    flipped = [math.log(sigmoid(-0.5 * 1.5)), math.log(sigmoid(0.5 * 1.5))]
    expected = sum(-0.9 * a - 0.1 * b for a, b in zip(log_sigmoid, flipped, strict=True)) / 2
    assert math.isclose(smoothed.item(), expected, rel_tol=1e-6)


def completion_logp(model: CausalLM, example: Example) -> float:
    tokens, mask = pad_rows(example_rows(TOKENIZER, [example]), TOKENIZER.pad_id)
    with torch.no_grad():
        return float(sequence_logps(model, tokens, mask)[0])


def test_training_on_a_dpo_pair_makes_its_preferred_completion_the_more_likely() -> None:
    champion = tiny_model(0)
    prompt = "12+30="
    one, other = Example(prompt, None, "42"), Example(prompt, None, "17")
    # the pair prefers whichever the champion finds less likely: training has to turn it round
    chosen, rejected = sorted((one, other), key=lambda e: completion_logp(champion, e))
    assert completion_logp(champion, chosen) < completion_logp(champion, rejected)
    config = FinetuneConfig(steps=30, batch_size=2, lr=3e-3, warmup_steps=2, dpo_batch_size=1, dpo_beta=0.5)
    dataset = Dataset(pairs=[Pair(chosen, rejected)], size=1)
    replay = Example("1+1=", None, "2")
    candidate, history = train_candidate(champion, TOKENIZER, dataset, lambda _rng: replay, config)

    assert completion_logp(candidate, chosen) > completion_logp(candidate, rejected)
    assert history[-1].dpo < history[0].dpo  # the loss it logged fell
    assert completion_logp(champion, chosen) < completion_logp(
        champion, rejected
    )  # the champion is untouched
