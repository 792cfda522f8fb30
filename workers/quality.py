"""Measures a loaded version's copies when its variants load: how much of the reference copy's greedy
output each variant reproduces on a fixed prompt set, and how fast each copy prefills and decodes
one sequence alone.

Two agreements: greedy agreement, the share of the reference's greedy tokens a variant's own
greedy continuation reproduces before they first differ (strict: one early divergence into equally
good text scores 0); and token agreement, the share of them the variant predicts as its top token
given the reference's tokens before each (teacher-forced, as speculative decoding accepts drafts): a
per-token fidelity in which a divergence counts once. The gateway ranks variants by token agreement.

The prompts run through the engine like any request (greedy, batched with live traffic), so a
variant is measured as it will be served; the speeds are priors that the gateway's latency model
refines from live streams.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

from workers.engine import Engine
from workers.models.interface import CausalLM
from workers.residency import Copy, Quality, ResidentVersion
from workers.sampling import SamplingParams
from workers.sequence import GenerationParams
from workers.variants import weight_bytes

# Fixed: the same prompts for every version, so qualities compare across versions and workers.
QUALITY_PROMPTS = (
    "12+7=", "48+35=", "3+96=", "70+29=",
    "The capital of France is", "Water boils at a temperature of",
    "def fibonacci(n):", "The three primary colors are",
)  # fmt: skip
QUALITY_TOKENS = 16  # greedy tokens compared per prompt
TIMED_RUNS = 3  # the speeds are the median of this many runs: one run is noise on a shared machine
GREEDY = GenerationParams(max_tokens=QUALITY_TOKENS, sampling=SamplingParams(temperature=0.0))


async def measure_copies(engine: Engine, version: ResidentVersion, variants: list[Copy]) -> None:
    """Sets `quality` on a version's reference copy and on each of its variants (added to the engine
    already)."""
    reference = version.reference
    prompts = [version.tokenizer.encode(p) for p in QUALITY_PROMPTS]
    expected = await _greedy(engine, version, reference, prompts)
    # the speeds come from one longer prompt (all of them, ~60 tokens, a chat turn's size, within
    # half the context): a short one's time to first token is mostly its fixed cost, which spread
    # over its few tokens overstates what each token of a real prompt costs
    timing = [t for p in prompts for t in p][: reference.max_len // 2]
    reference.quality = await _timed(engine, version, reference, timing, 1.0, 1.0)
    for variant in variants:
        got = await _greedy(engine, version, variant, prompts)
        agreement = sum(_agreed(e, g) for e, g in zip(expected, got, strict=True)) / len(prompts)
        token = await asyncio.to_thread(
            engine.run, lambda v=variant: teacher_forced_agreement(v.model, prompts, expected)
        )
        variant.quality = await _timed(engine, version, variant, timing, agreement, token)


async def _greedy(
    engine: Engine, version: ResidentVersion, copy: Copy, prompts: list[list[int]]
) -> list[list[int]]:
    return list(await asyncio.gather(*(_tokens(engine, version, copy, p) for p in prompts)))


async def _tokens(engine: Engine, version: ResidentVersion, copy: Copy, prompt: list[int]) -> list[int]:
    stream = engine.generate(version.name, version.version, prompt, GREEDY, copy.name)
    return [t async for delta in stream for t in delta.token_ids]


async def _timed(
    engine: Engine,
    version: ResidentVersion,
    copy: Copy,
    prompt: list[int],
    agreement: float,
    token_agreement: float,
) -> Quality:
    """The copy's quality with its speeds: the medians of TIMED_RUNS runs of one prompt alone (of
    what this worker runs)."""
    runs = [
        await _speeds(engine, version, copy, prompt, salt=f"speed run {run}") for run in range(TIMED_RUNS)
    ]
    return Quality(
        greedy_agreement=agreement,
        token_agreement=token_agreement,
        prefill_ms_per_token=statistics.median(prefill for prefill, _ in runs),
        decode_ms_per_token=statistics.median(decode for _, decode in runs),
        weight_bytes=weight_bytes(copy.model),
    )


async def _speeds(
    engine: Engine, version: ResidentVersion, copy: Copy, prompt: list[int], salt: str
) -> tuple[float, float]:
    """Milliseconds per prompt token to the first token, and per later token, of one run (its own
    cache salt: no run reuses another's prompt blocks)."""
    started = time.perf_counter()
    first = last = started
    tokens = 0
    stream = engine.generate(version.name, version.version, prompt, GREEDY, copy.name, cache_salt=salt)
    async for delta in stream:
        last = time.perf_counter()
        first = last if tokens == 0 else first
        tokens += len(delta.token_ids)
    return (first - started) * 1000 / len(prompt), (last - first) * 1000 / max(tokens - 1, 1)


def _agreed(expected: list[int], got: list[int]) -> float:
    """Share of `expected` that `got` reproduces before they first differ."""
    same = 0
    for a, b in zip(expected, got, strict=False):
        if a != b:
            break
        same += 1
    return same / max(len(expected), 1)


def teacher_forced_agreement(model: CausalLM, prompts: list[list[int]], expected: list[list[int]]) -> float:
    """Share of the reference's greedy tokens `expected` that `model` predicts as its top token,
    each given the prompt and the reference's tokens before it: one causal pass per prompt."""
    agreed = total = 0
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, expected, strict=True):
            if not tokens:
                continue
            row = torch.tensor([prompt + tokens[:-1]], device=model.device)
            predicted = model(row)[0, len(prompt) - 1 :].argmax(-1).tolist()
            agreed += sum(p == t for p, t in zip(predicted, tokens, strict=True))
            total += len(tokens)
    return agreed / max(total, 1)
