"""The prefix cache in the engine: prompts that start alike reuse the blocks an earlier prompt
prefilled and give exactly the tokens they give without it, alone and in mixed batches; eviction,
a hot-swapped version, an adapter beside its base and another cache salt (tenant) never get
another's keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.support.hf import VOCAB, random_adapter, tiny_checkpoint
from tests.support.models import collect, reference_greedy, tiny_model
from workers.engine import Engine, EngineConfig
from workers.loading import load_adapter, load_directory
from workers.metrics import WorkerMetrics
from workers.models.builtin import TOKENIZER, new_model
from workers.models.lora import LoraConfig
from workers.residency import ResidentVersion
from workers.sequence import Delta, GenerationParams, SamplingParams

SYSTEM = "Add the numbers; answer only the sum. "  # 39 tokens with BOS: 2 full blocks of 16
QUESTIONS = ["47+38=", "1+1=", "99+9=", "5+60=", "12+34="]
GREEDY = GenerationParams(max_tokens=12)
SEEDED = GenerationParams(max_tokens=12, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=5))


def new_engine(prefix_cache: bool, **config: int) -> Engine:
    engine = Engine(EngineConfig(prefix_cache=prefix_cache, **config), WorkerMetrics())
    engine.add(ResidentVersion("arith", "1", tiny_model(0), TOKENIZER, torch.device("cpu"), {"champion"}))
    return engine


async def completions(engine: Engine, prompts: list[str], params: GenerationParams) -> list[Delta]:
    """One after another (each may reuse the ones before), then all at once in one batch."""
    alone = [await collect(engine, p, params) for p in prompts]
    return alone + list(await asyncio.gather(*(collect(engine, p, params) for p in prompts)))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_shared_prefixes_are_prefilled_once_and_give_the_tokens_they_give_without_the_cache(
    params: GenerationParams,
) -> None:
    prompts = [SYSTEM + q for q in QUESTIONS]
    cached, uncached = new_engine(True), new_engine(False)
    try:
        with_cache = await completions(cached, prompts, params)
        without = await completions(uncached, prompts, params)
        assert [d.token_ids for d in with_cache] == [d.token_ids for d in without]
        reused = [d.usage.cached_tokens for d in with_cache if d.usage]
        assert reused == [0] + [32] * (2 * len(prompts) - 1)  # the system prompt's two full blocks
        assert all(d.usage and d.usage.cached_tokens == 0 for d in without)
        blocks, hit_rate = cached.prefix_cache()
        prompt_tokens = 2 * sum(len(TOKENIZER.encode(p)) for p in prompts)
        assert blocks >= 2 and hit_rate == pytest.approx(32 * 9 / prompt_tokens)
        assert uncached.prefix_cache() == (0, 0.0)
        if params is GREEDY:  # and the cache-free ground truth
            assert with_cache[1].token_ids == reference_greedy(tiny_model(0), prompts[1], 12)
        metrics = cached.metrics
        assert metrics is not None
        assert metrics.cached_prompt_tokens._value.get() == 32 * 9
        assert metrics.prompt_tokens._value.get() == prompt_tokens
    finally:
        cached.close()
        uncached.close()


async def test_eviction_under_pressure_never_reuses_a_block_another_prompt_overwrote() -> None:
    model, _ = new_model("arith-small", 0)  # 16 blocks of 16 tokens in 1 MiB
    engine = Engine(EngineConfig(kv_cache_mb=1, max_model_len=128), WorkerMetrics())
    engine.add(ResidentVersion("arith", "1", model.eval(), TOKENIZER, torch.device("cpu")))
    # 52 tokens: a first block all share, two of their own; 72 with the completion, 5 blocks a sequence
    prompts = [f"{'x' * 15}{c * 32}{i}+{i}=" for i, c in enumerate("abcdefgh")]
    params = GenerationParams(max_tokens=20)
    try:
        first = [await collect(engine, p, params) for p in prompts]  # 17 blocks to cache: one evicted
        assert [d.usage.cached_tokens for d in first if d.usage] == [0] + [16] * 7
        again = list(await asyncio.gather(*(collect(engine, p, params) for p in reversed(prompts))))
        hits = sorted(d.usage.cached_tokens for d in again if d.usage)
        assert hits[0] < 48 and hits[-1] == 48  # some found whole, some evicted in between
        truth = [reference_greedy(model, p, 20) for p in prompts]
        assert [d.token_ids for d in first] == truth and [d.token_ids for d in reversed(again)] == truth
        assert len(set(map(tuple, truth))) > 1  # a block from the wrong prompt would show
        assert engine.kv_blocks() == (0, 16)  # cached blocks nobody holds count as free
        last = await collect(engine, prompts[0], params)  # the last to run above
        assert last.usage and last.usage.cached_tokens == 48 and last.token_ids == truth[0]
    finally:
        engine.close()


async def test_a_new_version_never_reuses_the_old_ones_blocks() -> None:
    engine = new_engine(True)
    try:
        prompt = SYSTEM + QUESTIONS[0]
        assert (await collect(engine, prompt, GREEDY)).usage is not None
        engine.add(ResidentVersion("arith", "2", tiny_model(1), TOKENIZER, torch.device("cpu"), {"champion"}))
        engine.remove("arith", "1")
        swapped = await collect(engine, prompt, GREEDY, version="2")
        assert swapped.usage and swapped.usage.cached_tokens == 0
        assert swapped.token_ids == reference_greedy(tiny_model(1), prompt, 12)
        again = await collect(engine, prompt, GREEDY, version="2")
        assert again.usage and again.usage.cached_tokens == 32 and again.token_ids == swapped.token_ids
    finally:
        engine.close()


async def test_an_adapter_and_its_base_never_share_blocks(tmp_path: Path) -> None:
    engines = {on: Engine(EngineConfig(prefix_cache=on, prefill_chunk=16)) for on in (True, False)}
    prompt = torch.randint(2, VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    checkpoint = tiny_checkpoint(tmp_path / "tiny")
    base = load_directory(checkpoint, "tiny", "1", torch.device("cpu"))
    random_adapter(base.model, LoraConfig(rank=4, alpha=8), seed=3).save(
        tmp_path / "adapter", base_model="tiny"
    )  # type: ignore[arg-type]
    outputs: dict[bool, list[tuple[list[int], int]]] = {}
    try:
        for on, engine in engines.items():
            base = load_directory(checkpoint, "tiny", "1", torch.device("cpu"))
            engine.add(base)
            engine.add(load_adapter(tmp_path / "adapter", "2", base))
            outputs[on] = []
            for version in ("1", "2", "2", "1"):
                out = Delta()
                async for delta in engine.generate("tiny", version, prompt, GenerationParams(max_tokens=16)):
                    out.merge(delta)
                assert out.usage is not None
                outputs[on].append((out.token_ids, out.usage.cached_tokens))
        assert [ids for ids, _ in outputs[True]] == [ids for ids, _ in outputs[False]]
        assert outputs[True][0][0] != outputs[True][1][0]  # the adapter matters
        assert [hit for _, hit in outputs[True]] == [0, 0, 32, 32]  # each reuses its own, never the other's
    finally:
        for engine in engines.values():
            engine.close()


async def test_only_requests_with_the_same_cache_salt_share_blocks() -> None:
    engine = new_engine(True)
    try:
        ids = TOKENIZER.encode(SYSTEM + QUESTIONS[0])
        hits = []
        for salt in ("tenant 1", "tenant 2", "tenant 1", "tenant 2"):
            out = Delta()
            async for delta in engine.generate("arith", "1", ids, GREEDY, cache_salt=salt):
                out.merge(delta)
            assert out.usage is not None
            hits.append(out.usage.cached_tokens)
        assert hits == [0, 0, 32, 32]
    finally:
        engine.close()
