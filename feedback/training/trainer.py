"""Trains a candidate from the champion: supervised loss on corrections and liked completions,
KTO on rated completions, DPO on preference pairs, and a pull toward the champion on replayed
general prompts.

Each step's loss is

    SFT(batch) + kto_weight * KTO(rated batch) + dpo_weight * DPO(pair batch)
        + kl_weight * KL(policy || champion on replay rows)

where the SFT batch mixes feedback examples with `replay_fraction` of replayed prompts (the
champion's own answers to general prompts, or a demo task's base problems), so learning what users
want does not unlearn the rest. The champion's
weights are never changed. A full fine-tune trains a copy, and the champion, switched to eval mode
and frozen, is the reference. A LoRA fine-tune trains only a low-rank adapter over the champion's
frozen weights, and the reference is the champion itself with the adapter switched off, so no
second copy of the model is held.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feedback.tasks.task import Example
from feedback.training.dataset import Dataset, Pair
from feedback.training.examples import example_rows, learning_rate, pad_rows, training_example
from feedback.training.losses import KtoResult, completion_logits, dpo_loss, kto_loss, sequence_logps
from workers.models.interface import CausalLM, Tokenizer
from workers.models.lora import Adapter, LoraConfig


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tune run's recipe; the defaults suit a full fine-tune of the demo model on two CPU
    cores (LORA_RECIPE is the one for Llama-family models)."""

    steps: int = 200
    batch_size: int = 32  # supervised rows per step, replay included
    lr: float = 3e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    replay_fraction: float = 0.5  # share of each supervised batch from the base distribution
    kto_batch_size: int = 16
    kto_weight: float = 0.2  # below SFT: corrections carry most of what there is to learn here
    kto_beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    dpo_batch_size: int = 8
    dpo_weight: float = 1.0
    dpo_beta: float = 0.1
    label_smoothing: float = 0.1  # DPO's: the share of preferences assumed to be the wrong way round
    kl_weight: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    lora: LoraConfig | None = None  # None: every weight is trained (a full fine-tune)


# Sized for SmolLM2-135M-Instruct on two CPU cores (docs/finetuning.md): an adapter learns a format
# in tens of steps at a higher learning rate than full weights take, and each step's rows cost a
# forward and backward through the whole model, so batches are small and KTO's are smaller.
LORA_RECIPE = FinetuneConfig(
    steps=20, batch_size=8, lr=1e-3, warmup_steps=3, kto_batch_size=4, dpo_batch_size=2, lora=LoraConfig()
)


@dataclass(frozen=True)
class StepLog:
    """What one step measured (logged to MLflow as curves)."""

    loss: float
    sft: float
    kto: float
    dpo: float
    kl: float
    kto_reference_point: float


def train_candidate(
    champion: CausalLM,
    tokenizer: Tokenizer,
    dataset: Dataset,
    replay: Callable[[random.Random], Example],
    config: FinetuneConfig,
    progress: Callable[[int, int, float], None] | None = None,
) -> tuple[CausalLM, list[StepLog]]:
    """The candidate and the per-step log; deterministic for a seed on CPU. The candidate is a
    fine-tuned copy of `champion`, or with `config.lora` the champion seen through the trained
    adapter (`CausalLM.adapted`); a champion that is itself an adapter over some weights has a copy
    of its adapter trained further, over the same weights.

    `replay(rng)` draws one problem of the base distribution; `progress(step, total, loss)` is
    called after every step.
    """
    device = champion.device
    reference = champion.eval()
    policy: CausalLM
    if champion.adapter is not None:  # a tenant's own adapter: trained on from where it is
        policy = champion.adapted(champion.adapter.trainable_copy()).train()
    elif config.lora is not None:  # the adapter's tensors are the only parameters
        base = cast(nn.Module, champion)  # every CausalLM reflow has is a torch module
        policy = champion.adapted(Adapter.new(base, config.lora, config.seed)).train()
    else:
        policy = copy.deepcopy(champion).train()
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    context = champion.max_seq_len

    def fits(example: Example) -> bool:  # longer completions cannot be scored by this model
        return len(training_example(tokenizer, example.prompt, example.answer, example.thought)[0]) <= context

    supervised = [e for e in dataset.supervised if fits(e)]
    rated = [(e, True) for e in dataset.desirable if fits(e)] + [
        (e, False) for e in dataset.undesirable if fits(e)
    ]
    pairs = [pair for pair in dataset.pairs if fits(pair.chosen) and fits(pair.rejected)]
    n_replay = round(config.batch_size * config.replay_fraction) if supervised else config.batch_size
    history = []
    for step in range(1, config.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        replayed = [replay(rng) for _ in range(n_replay)]
        learned = [rng.choice(supervised) for _ in range(config.batch_size - n_replay)]
        tokens, mask = _batch(tokenizer, replayed + learned, device, context)
        found = completion_logits(policy, tokens, mask)  # [N, V]: the completion tokens'
        sft = F.cross_entropy(found.logits, found.targets)
        replayed_logits = found.logits[: int((found.rows < n_replay).sum())]  # the rows come in order
        kl = _kl_to_reference(replayed_logits, reference, tokens[:n_replay], mask[:n_replay])
        loss = sft + config.kl_weight * kl
        kto_value = reference_point = 0.0
        if rated and config.kto_weight > 0:
            chosen = [rng.choice(rated) for _ in range(config.kto_batch_size)]
            result = _kto(policy, reference, tokenizer, chosen, config, device)
            loss = loss + config.kto_weight * result.loss
            kto_value, reference_point = result.loss.item(), result.kl
        dpo_value = 0.0
        if pairs and config.dpo_weight > 0:
            dpo = _dpo(
                policy,
                reference,
                tokenizer,
                [rng.choice(pairs) for _ in range(config.dpo_batch_size)],
                config,
            )
            loss = loss + config.dpo_weight * dpo
            dpo_value = dpo.item()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), config.grad_clip)
        optimizer.step()
        history.append(StepLog(loss.item(), sft.item(), kto_value, dpo_value, kl.item(), reference_point))
        if progress is not None:
            progress(step, config.steps, loss.item())
    return policy.eval(), history


def _kl_to_reference(logits: Tensor, reference: CausalLM, tokens: Tensor, mask: Tensor) -> Tensor:
    """Mean per-token KL(policy || reference) over the completion tokens of these rows, whose
    policy `logits` ([N, V], `completion_logits`) are given."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    with torch.no_grad():
        reference_logps = completion_logits(reference, tokens, mask).logits.log_softmax(-1)
    logps = logits.log_softmax(-1)
    return (logps.exp() * (logps - reference_logps)).sum(-1).mean()


def _kto(
    policy: CausalLM,
    reference: CausalLM,
    tokenizer: Tokenizer,
    chosen: list[tuple[Example, bool]],
    config: FinetuneConfig,
    device: torch.device,
) -> KtoResult:
    """KTO over `chosen`; the reference point pairs each prompt with the next row's completion."""
    examples = [example for example, _ in chosen]
    mismatched = [
        Example(example.prompt, other.thought, other.answer)
        for example, other in zip(examples, examples[1:] + examples[:1], strict=True)
    ]
    context = policy.max_seq_len
    tokens, mask = _batch(tokenizer, examples, device, context)
    kl_tokens, kl_mask = _batch(tokenizer, mismatched, device, context)
    with torch.no_grad():
        reference_logps = sequence_logps(reference, tokens, mask)
        kl_policy = sequence_logps(policy, kl_tokens, kl_mask)
        kl_reference = sequence_logps(reference, kl_tokens, kl_mask)
    desirable = torch.tensor([wanted for _, wanted in chosen], device=device)
    return kto_loss(
        sequence_logps(policy, tokens, mask), reference_logps, kl_policy, kl_reference, desirable,
        beta=config.kto_beta, desirable_weight=config.desirable_weight,
        undesirable_weight=config.undesirable_weight,
    )  # fmt: skip


def _dpo(
    policy: CausalLM, reference: CausalLM, tokenizer: Tokenizer, pairs: list[Pair], config: FinetuneConfig
) -> Tensor:
    """DPO over `pairs`: chosen and rejected completions scored in one batch."""
    tokens, mask = _batch(
        tokenizer, [p.chosen for p in pairs] + [p.rejected for p in pairs], policy.device, policy.max_seq_len
    )
    with torch.no_grad():
        reference_logps = sequence_logps(reference, tokens, mask)
    logps, n = sequence_logps(policy, tokens, mask), len(pairs)
    return dpo_loss(
        logps[:n], logps[n:], reference_logps[:n], reference_logps[n:],
        beta=config.dpo_beta, label_smoothing=config.label_smoothing,
    )  # fmt: skip


def _batch(
    tokenizer: Tokenizer, examples: list[Example], device: torch.device, context: int
) -> tuple[Tensor, Tensor]:
    """Right-padded token ids and completion masks of `examples`, both [B, T], cut at `context`
    tokens (only a mismatched prompt and completion can be that long: examples that do not fit
    are left out before)."""
    rows = example_rows(tokenizer, examples)
    tokens, mask = pad_rows([(ids[:context], mask[:context]) for ids, mask in rows], tokenizer.pad_id)
    return tokens.to(device), mask.to(device)
