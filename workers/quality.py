"""Measures a loaded version's variants when they load: how much of the reference's greedy output each
reproduces on a fixed prompt set, and how fast each prefills and decodes one sequence alone.

The prompts run through the engine like any request (greedy, batched with live traffic), so a
variant is measured as it will be served; the speeds are priors that the gateway's latency model
refines from live streams.
"""

from __future__ import annotations

import asyncio
import time

from workers.engine import Engine
from workers.loading import LoadedModel, Quality
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
GREEDY = GenerationParams(max_tokens=QUALITY_TOKENS, sampling=SamplingParams(temperature=0.0))


async def measure(engine: Engine, reference: LoadedModel, variants: list[LoadedModel]) -> None:
    """Sets `quality` on the reference and on each of its variants (added to the engine already)."""
    prompts = [reference.tokenizer.encode(p) for p in QUALITY_PROMPTS]
    expected = await _greedy(engine, reference, prompts)
    reference.quality = await _timed(engine, reference, prompts[0], 1.0)
    for variant in variants:
        got = await _greedy(engine, variant, prompts)
        agreement = sum(_agreed(e, g) for e, g in zip(expected, got, strict=True)) / len(prompts)
        variant.quality = await _timed(engine, variant, prompts[0], agreement)


async def _greedy(engine: Engine, loaded: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    return list(await asyncio.gather(*(_tokens(engine, loaded, p) for p in prompts)))


async def _tokens(engine: Engine, loaded: LoadedModel, prompt: list[int]) -> list[int]:
    stream = engine.generate(loaded.name, loaded.version, prompt, GREEDY, loaded.variant)
    return [t async for delta in stream for t in delta.token_ids]


async def _timed(engine: Engine, loaded: LoadedModel, prompt: list[int], agreement: float) -> Quality:
    """The variant's quality with its speeds, from one prompt run alone (of what this worker runs)."""
    started = time.perf_counter()
    first = last = started
    tokens = 0
    async for delta in engine.generate(loaded.name, loaded.version, prompt, GREEDY, loaded.variant):
        last = time.perf_counter()
        first = last if tokens == 0 else first
        tokens += len(delta.token_ids)
    return Quality(
        greedy_agreement=agreement,
        prefill_ms_per_token=(first - started) * 1000 / len(prompt),
        decode_ms_per_token=(last - first) * 1000 / max(tokens - 1, 1),
        weight_bytes=weight_bytes(loaded.model),
    )


def _agreed(expected: list[int], got: list[int]) -> float:
    """Share of `expected` that `got` reproduces before they first differ."""
    same = 0
    for a, b in zip(expected, got, strict=False):
        if a != b:
            break
        same += 1
    return same / max(len(expected), 1)
