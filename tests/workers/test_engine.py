"""The engine: exact greedy decoding, seeded reproducibility, cancellation, torch off the event loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from reflow.errors import InvalidArgument, NotFound
from tests.conftest import reference_greedy, tiny_model
from workers.engine import Engine
from workers.loading import LoadedModel
from workers.sampling import SamplingParams
from workers.sequence import Delta, GenerationParams
from workers.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture
def engine() -> Engine:
    engine = Engine()
    engine.add(LoadedModel("arith", "1", tiny_model(0), TOK, torch.device("cpu"), {"champion"}))
    yield engine
    engine.close()


async def collect(engine: Engine, prompt: str, params: GenerationParams) -> Delta:
    out = Delta()
    async for delta in engine.generate("arith", "1", TOK.encode(prompt), params):
        out.merge(delta)
    return out


async def test_greedy_tokens_match_a_cache_free_reference(engine: Engine) -> None:
    out = await collect(engine, "47+38=", GenerationParams(max_tokens=20))
    assert out.token_ids == reference_greedy(tiny_model(0), "47+38=", 20)


async def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    params = GenerationParams(max_tokens=20, sampling=SamplingParams(temperature=1.0, seed=9))
    first = await collect(engine, "1+2=", params)
    assert (await collect(engine, "1+2=", params)).token_ids == first.token_ids
    other = GenerationParams(max_tokens=20, sampling=SamplingParams(temperature=1.0, seed=10))
    assert (await collect(engine, "1+2=", other)).token_ids != first.token_ids


async def test_closing_the_stream_stops_generation_and_frees_the_sequence(engine: Engine) -> None:
    stream = engine.generate("arith", "1", TOK.encode("1+1="), GenerationParams(max_tokens=50))
    await anext(stream)
    assert engine.running == 1
    await stream.aclose()
    assert (engine.running, engine.waiting) == (0, 0)


async def test_concurrent_streams_interleave_and_stay_exact(engine: Engine) -> None:
    params = GenerationParams(max_tokens=15)
    outs = await asyncio.gather(*(collect(engine, p, params) for p in ("1+1=", "22+7=", "9+40=")))
    for prompt, out in zip(("1+1=", "22+7=", "9+40="), outs, strict=True):
        assert out.token_ids == reference_greedy(tiny_model(0), prompt, 15)


async def test_ids_the_tokenizer_cannot_produce_are_never_sampled(engine: Engine) -> None:
    params = GenerationParams(max_tokens=60, sampling=SamplingParams(temperature=100.0, seed=3))
    out = await collect(engine, "1+1=", params)
    assert len(out.token_ids) == 60 or out.token_ids[-1] == TOK.eos_id
    assert all(t < TOK.vocab_size and t not in (TOK.pad_id, TOK.bos_id) for t in out.token_ids)


async def test_event_loop_stays_responsive_while_decoding(engine: Engine) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    await collect(engine, "3+4=", GenerationParams(max_tokens=40))
    task.cancel()
    assert ticks > 5


async def test_bad_requests(engine: Engine) -> None:
    with pytest.raises(NotFound, match="arith/9 is not loaded"):
        await collect_version(engine, "9")
    with pytest.raises(InvalidArgument, match="takes at most 63"):
        await collect(engine, "9" * 100, GenerationParams(max_tokens=5))


async def collect_version(engine: Engine, version: str) -> None:
    async for _ in engine.generate("arith", version, [1, 2], GenerationParams(max_tokens=1)):
        pass
