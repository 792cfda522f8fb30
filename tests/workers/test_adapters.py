"""LoRA adapters served beside their base version: rows of each in the same steps and forwards, each
given the tokens it gets alone (and the tokens transformers + peft give), and an adapter unloaded
while one of its sequences runs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from reflow.errors import NotFound
from tests.support.hf import EOS, VOCAB, random_adapter, tiny_checkpoint, transformers
from workers.engine import Engine, EngineConfig
from workers.loading import load_adapter, load_directory
from workers.metrics import WorkerMetrics
from workers.models.lora import LoraConfig
from workers.residency import ResidentAdapter, ResidentVersion
from workers.sequence import GenerationParams, SamplingParams

CPU = torch.device("cpu")
PARAMS = GenerationParams(max_tokens=24)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(max_batch_size=8, prefill_chunk=16, max_prefill_tokens=64))
    yield engine
    engine.close()


def serve(
    engine: Engine, checkpoint: Path, tmp_path: Path, dtype: torch.dtype = torch.float32
) -> tuple[ResidentVersion, ResidentAdapter]:
    """Base version 1 and, over it, adapter version 2 (saved in PEFT's format and loaded back)."""
    base = load_directory(checkpoint, "tiny", "1", CPU, dtype=dtype)
    engine.add(base)
    trained = base if dtype == torch.float32 else load_directory(checkpoint, "tiny", "1", CPU)  # not packed
    adapter = random_adapter(trained.model, LoraConfig(rank=4, alpha=8), seed=3)  # type: ignore[arg-type]
    adapter.save(tmp_path / "adapter", base_model="tiny")
    challenger = load_adapter(tmp_path / "adapter", "2", base)
    engine.add(challenger)
    return base, challenger


async def generate(
    engine: Engine, version: str, prompt_ids: list[int], params: GenerationParams = PARAMS
) -> list[int]:
    ids: list[int] = []
    async for delta in engine.generate("tiny", version, prompt_ids, params):
        ids += delta.token_ids
    return ids


def prompts(n: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(2, VOCAB, (length,), generator=generator).tolist() for length in (5, 19, 33, 8)[:n]]


# bfloat16: a step's rows in one packed forward, prompt tokens and decode rows of both versions
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_champion_and_challenger_rows_in_one_step_get_the_tokens_each_gets_alone(
    engine: Engine, checkpoint: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    serve(engine, checkpoint, tmp_path, dtype)
    rows = prompts(4)
    seeded = GenerationParams(max_tokens=24, sampling=SamplingParams(temperature=0.8, seed=7))
    work = [(version, p, params) for p in rows for version in ("1", "2") for params in (PARAMS, seeded)]
    alone = [asyncio.run(generate(engine, v, p, params)) for v, p, params in work]

    async def together() -> list[list[int]]:
        return list(await asyncio.gather(*(generate(engine, v, p, params) for v, p, params in work)))

    assert asyncio.run(together()) == alone
    greedy = [ids for ids, (_, _, params) in zip(alone, work, strict=True) if params is PARAMS]
    assert greedy[0::2] != greedy[1::2]  # the adapter matters: versions 1 and 2 alternate
    assert [m.version for m in engine.loaded()] == ["1", "2"]
    assert engine.get("tiny", "2").base_version == "1"
    assert engine.kv_slots == engine.config.max_batch_size  # one pool: the adapter holds no cache


def test_drafted_tokens_through_the_base_and_an_adapter_in_one_step_change_no_greedy_token(
    checkpoint: Path, tmp_path: Path
) -> None:
    work = [(version, p) for p in prompts(4) for version in ("1", "2")]
    outputs, accepted = [], []
    for drafts in (0, 4):
        config = EngineConfig(max_batch_size=8, prefill_chunk=16, max_prefill_tokens=64)
        engine = Engine(replace(config, speculative_tokens=drafts), WorkerMetrics())
        try:
            serve(engine, checkpoint, tmp_path / str(drafts))

            async def together(engine: Engine = engine) -> list[list[int]]:
                long = GenerationParams(max_tokens=64)  # long enough to run into loops drafts predict
                return list(await asyncio.gather(*(generate(engine, v, p, long) for v, p in work)))

            outputs.append(asyncio.run(together()))
        finally:
            engine.close()
        assert engine.metrics is not None
        accepted.append(engine.metrics.accepted_draft_tokens._value.get())
    assert outputs[1] == outputs[0]
    assert accepted[0] == 0 < accepted[1]


def test_an_adapter_served_gives_the_greedy_tokens_of_transformers_plus_peft(
    engine: Engine, checkpoint: Path, tmp_path: Path
) -> None:
    peft = pytest.importorskip("peft", reason="the reference for adapters: pip install -e '.[test]'")
    serve(engine, checkpoint, tmp_path)
    reference = transformers().AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(reference, tmp_path / "adapter").eval()
    for p in prompts(3):
        with torch.inference_mode():
            expected = wrapped.generate(
                input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=PARAMS.max_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0,
            )[0, len(p) :].tolist()  # fmt: skip
        assert asyncio.run(generate(engine, "2", p)) == expected


def test_an_adapter_unloaded_mid_stream_finishes_its_sequence_and_takes_no_new_one_until_loaded_again(
    engine: Engine, checkpoint: Path, tmp_path: Path
) -> None:
    _, challenger = serve(engine, checkpoint, tmp_path)
    [prompt] = prompts(1)
    expected = asyncio.run(generate(engine, "2", prompt))

    async def unload_after_the_first_delta() -> list[int]:
        stream = engine.generate("tiny", "2", prompt, PARAMS)
        ids = list((await anext(stream)).token_ids)
        assert engine.remove("tiny", "2")
        async for delta in stream:
            ids += delta.token_ids
        return ids

    assert asyncio.run(unload_after_the_first_delta()) == expected
    with pytest.raises(NotFound, match="tiny/2 is not loaded"):
        asyncio.run(generate(engine, "2", prompt))
    assert asyncio.run(generate(engine, "1", prompt))  # the base serves on
    assert [m.version for m in engine.loaded()] == ["1"]
    engine.add(challenger)  # loaded again: served as it was
    assert asyncio.run(generate(engine, "2", prompt)) == expected
    assert [m.version for m in engine.loaded()] == ["1", "2"]


def test_an_adapter_that_does_not_fit_its_base_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    base = load_directory(checkpoint, "tiny", "1", CPU)
    adapter = random_adapter(base.model, LoraConfig(rank=2, targets=("q_proj",)), seed=1)  # type: ignore[arg-type]
    name = "model.layers.0.self_attn.q_proj"
    a, b = adapter.weights[name]
    adapter.weights[name] = (a[:, :-1], b)  # one input feature short
    adapter.save(tmp_path / "bad", base_model="tiny")
    with pytest.raises(ValueError, match="q_proj is 64x63; the base model's is 64x64"):
        load_adapter(tmp_path / "bad", "2", base)
