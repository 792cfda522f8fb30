"""How torch's OpenMP threads wait between kernels, chosen per process before torch loads: a worker
spins briefly, a training job that shares the cores with workers does not spin at all.

libgomp reads its waiting policy once, when torch loads, so each function here must be called first
thing in its process. Neither overrides an operator's choice (OMP_WAIT_POLICY or GOMP_SPINCOUNT set).
"""

from __future__ import annotations

import os

SPIN_COUNT = "10000"  # libgomp's busy-wait iterations before a thread sleeps: a few microseconds


def spin_briefly() -> None:
    """For a serving process: torch's OpenMP threads spin GOMP_SPINCOUNT=10000 iterations before
    they sleep. OpenMP's default, 300,000, turned a 1 ms decode step into 120 ms on 2 cores shared
    with a gateway; not spinning at all (OMP_WAIT_POLICY=PASSIVE) wakes the threads for each of a
    step's ~1,000 kernels and doubled SmolLM2-135M's decode step (32 -> 63 ms for one sequence).
    10,000 bridges the gaps within a step and sleeps between steps: the built-in model's throughput
    is the same as passive (`benchmarks/decode_throughput.py`)."""
    if not _chosen():
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def wait_passively() -> None:
    """For a training process beside serving workers (`reflow scheduler`, `reflow finetune run`):
    OMP_WAIT_POLICY=PASSIVE. Threads that spin hold a core their sibling, or a worker's, needs;
    on 2 cores shared with a worker serving 8 requests a second, a demo fine-tune step took 6 s at
    OpenMP's default and 1.4 s at GOMP_SPINCOUNT=10000, against 0.33 s passive, in `reflow up
    --demo`; `benchmarks/training_beside_serving.py` measures it side by side (docs/benchmarks.md).
    Alone on the machine passive costs small steps more (the demo's, 2x on one Xeon, 15% on one
    EPYC), and one thread does as well beside a worker on 2 cores; but passive threads use every
    core a larger machine has, and a training job mostly runs beside workers."""
    if not _chosen():
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def _chosen() -> bool:
    """Whether the operator set how OpenMP threads wait."""
    return "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
