"""How torch's threads wait in a process that serves: spinning only briefly, so a shared machine keeps
its pace and a model's many small kernels do not each pay a wake-up."""

from __future__ import annotations

import os

SPIN_COUNT = "10000"  # libgomp's busy-wait iterations before a thread sleeps: a few microseconds


def spin_briefly() -> None:
    """Makes torch's OpenMP threads spin GOMP_SPINCOUNT=10000 iterations before they sleep, unless
    the operator chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT is set). OpenMP's default, 300,000,
    turned a 1 ms decode step into 120 ms on 2 cores shared with a gateway; not spinning at all
    (OMP_WAIT_POLICY=PASSIVE) wakes the threads for each of a step's ~1,000 kernels and doubled
    SmolLM2-135M's decode step (32 -> 63 ms for one sequence). 10,000 bridges the gaps within a
    step and sleeps between steps: the built-in model's throughput is the same as passive
    (`benchmarks/decode_throughput.py`). libgomp reads this once, when torch loads: call it first
    thing in a serving process. Training processes keep OpenMP's default, which is faster for
    their long matrix products."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
