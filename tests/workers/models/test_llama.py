"""The Llama family against transformers: tiny random checkpoints of each architecture, written by
transformers itself, give the same logits through reflow's paged KV cache (alone and in mixed
batches) and the same greedy tokens through the engine."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from tests.support.hf import EOS, VOCAB, tiny_checkpoint, transformers
from workers.engine import Engine, EngineConfig
from workers.loading import load_directory
from workers.models.llama import LlamaForCausalLM, RMSNorm
from workers.models.loader import load_checkpoint
from workers.sampling import TokenLogprob
from workers.sequence import GenerationParams

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64, "rope_theta": 500000.0,
}  # fmt: skip
ARCHITECTURES = {  # name -> (transformers config class, model class, what sets it apart)
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3-scaled-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2-qkv-bias": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3-qk-norm": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config_class, model_class, extra = ARCHITECTURES[request.param]
    return tiny_checkpoint(tmp_path_factory.mktemp(request.param), config_class, model_class, **extra)


async def generate(engine: Engine, prompt_ids: list[int], params: GenerationParams) -> list[int]:
    ids: list[int] = []
    async for delta in engine.generate("tiny", "1", prompt_ids, params):
        ids += delta.token_ids
    return ids


def reference_model(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return transformers().AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = (5, 17, 40, 9)[:n]
    return [torch.randint(2, VOCAB, (length,), generator=generator).tolist() for length in lengths]


@torch.inference_mode()
def test_logits_equal_transformers_over_a_prefill_and_32_decode_steps(checkpoint: Path) -> None:
    reference = reference_model(checkpoint)
    model, _ = load_checkpoint(checkpoint)
    assert isinstance(model, LlamaForCausalLM)
    rows = prompts(4)
    continuations = torch.randint(2, VOCAB, (4, 32), generator=torch.Generator().manual_seed(2)).tolist()
    expected = [
        reference(torch.tensor([p + c])).logits[0, len(p) - 1 :]
        for p, c in zip(rows, continuations, strict=True)
    ]
    cache = model.new_cache(64)
    tables = [[1 + 8 * i + j for j in range(8)] for i in range(4)]  # 8 blocks of 16 tokens each
    # prefill: row 0 alone, rows 1-3 together in one padded forward
    got: list[list[torch.Tensor]] = [[] for _ in rows]
    alone = model(torch.tensor([rows[0]]), cache, cache.view(tables[:1], [list(range(5))], CPU))
    got[0].append(alone[0, -1:])
    width = max(len(p) for p in rows[1:])
    tokens = torch.tensor([p + [0] * (width - len(p)) for p in rows[1:]])
    positions = [[*range(len(p)), *[-1] * (width - len(p))] for p in rows[1:]]
    logits = model(tokens, cache, cache.view(tables[1:], positions, CPU))
    for i, p in enumerate(rows[1:], start=1):
        got[i].append(logits[i - 1, len(p) - 1 :][:1])
    last = torch.tensor([len(p) - 1 for p in rows[1:]])  # the same forward for the last tokens' alone
    at = torch.arange(3) * width + last  # among the forward's tokens, row by row
    at_last = model(tokens, cache, cache.view(tables[1:], positions, CPU), at=at)
    torch.testing.assert_close(at_last, logits[torch.arange(3), last], rtol=0, atol=1e-6)
    # 32 decode steps of all four rows in one batch
    for step in range(32):
        tokens = torch.tensor([[c[step]] for c in continuations])
        positions = [[len(p) + step] for p in rows]
        logits = model(tokens, cache, cache.view(tables, positions, CPU))
        for i in range(4):
            got[i].append(logits[i])
    for i in range(4):
        torch.testing.assert_close(torch.cat(got[i]), expected[i], rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_norm_gives_transformers_bits_in_every_dtype(dtype: torch.dtype) -> None:
    """Normalised in float32 and rounded once to the input's dtype, as LlamaRMSNorm's casts do (as
    autograd runs it here; a served forward's norms in bfloat16 and float16: test_native.py)."""
    generator = torch.Generator().manual_seed(0)
    for width, scale in [(64, 0.01), (576, 1.0), (960, 30.0), (2048, 1.0)]:
        reference = transformers().models.llama.modeling_llama.LlamaRMSNorm(width, eps=1e-5)
        norm = RMSNorm(width, eps=1e-5)
        weight = torch.randn(width, generator=generator).to(dtype)
        reference.weight.data, norm.weight.data = weight.clone(), weight.clone()
        x = (torch.randn(64, 3, width, generator=generator) * scale).to(dtype)
        assert torch.equal(norm(x), reference(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_engine_gives_the_same_greedy_tokens_alone_and_in_any_batch_as_transformers(
    checkpoint: Path, dtype: torch.dtype
) -> None:
    rows = prompts(4)
    engine = Engine(EngineConfig(max_batch_size=8, prefill_chunk=16, max_prefill_tokens=64))
    try:
        engine.add(load_directory(checkpoint, "tiny", "1", CPU, dtype=dtype))
        params = GenerationParams(max_tokens=32)
        alone = [asyncio.run(generate(engine, p, params)) for p in rows]

        async def together() -> list[list[int]]:
            return list(await asyncio.gather(*(generate(engine, p, params) for p in rows)))

        batched = asyncio.run(together())
    finally:
        engine.close()
    assert alone == batched  # bit-exact in any batch mix, in float32 and in bfloat16
    if dtype == torch.bfloat16:
        return  # its roundings differ from transformers' in places, so greedy paths may part
    reference = reference_model(checkpoint)
    with torch.inference_mode():
        expected = [
            reference.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=32, do_sample=False, eos_token_id=EOS, pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in rows
        ]  # fmt: skip
    assert alone == expected


def test_logprobs_are_transformers_log_softmax_of_the_logits_each_token_was_picked_from(
    checkpoint: Path,
) -> None:
    prompt = prompts(3)[2]  # 40 tokens: three prefill chunks of 16
    params = GenerationParams(max_tokens=12, top_logprobs=5, prompt_logprobs=True)
    engine = Engine(EngineConfig(max_batch_size=4, prefill_chunk=16))
    try:
        loaded = load_directory(checkpoint, "tiny", "1", CPU, dtype=torch.float32)
        engine.add(loaded)

        async def logprobs(
            params: GenerationParams = params,
        ) -> tuple[list[int], list[TokenLogprob], list[TokenLogprob], int]:
            ids, entries, prompt_entries, cached = [], [], [], -1
            async for delta in engine.generate("tiny", "1", prompt, params):
                ids += delta.token_ids
                entries += delta.logprobs
                prompt_entries += delta.prompt_logprobs
                cached = delta.usage.cached_tokens if delta.usage else cached
            return ids, entries, prompt_entries, cached

        plain = asyncio.run(logprobs(GenerationParams(max_tokens=12)))  # its prompt's blocks are cached
        ids, entries, prompt_entries, cached = asyncio.run(logprobs())
        scored = asyncio.run(logprobs(GenerationParams(max_tokens=0, top_logprobs=5, prompt_logprobs=True)))
    finally:
        engine.close()
    assert plain[3] == 0 and plain[0] == ids and not plain[1] and not plain[2]
    assert scored[:3] == ([], [], prompt_entries)  # the prompt only: the same log probabilities, no token
    assert cached == 0  # a prompt whose log probabilities are asked for is computed whole
    assert [e.token_id for e in entries] == ids and ids
    with torch.inference_mode():
        logits = reference_model(checkpoint)(torch.tensor([prompt + ids])).logits[0]
        raw = torch.log_softmax(logits[: len(prompt) - 1].float(), dim=-1)  # the prompt's, as they are
        logits[:, loaded.banned_tokens] = float("-inf")  # what a worker never generates, as it picks
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)  # [tokens, V]
    for row, (token, entry) in enumerate(zip(ids, entries, strict=True)):
        assert entry.logprob == pytest.approx(float(expected[row, token]), abs=1e-4)
        values, likeliest = expected[row].topk(5)
        assert [i for i, _ in entry.top] == likeliest.tolist() and entry.top[0][0] == token  # greedy
        assert [p for _, p in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    assert [e.token_id for e in prompt_entries] == prompt and math.isnan(prompt_entries[0].logprob)
    for position, entry in enumerate(prompt_entries[1:]):
        assert entry.logprob == pytest.approx(float(raw[position, prompt[position + 1]]), abs=1e-4)
        assert [i for i, _ in entry.top] == raw[position].topk(5).indices.tolist()
