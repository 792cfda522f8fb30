"""How torch's threads wait in a process that serves: passively, so a shared machine keeps its pace."""

from __future__ import annotations

import os


def wait_passively() -> None:
    """Makes torch's OpenMP threads sleep while they wait for work instead of spinning, unless the
    operator chose (OMP_WAIT_POLICY is set). Spinning threads turned a 1 ms decode step into 120 ms
    on 2 cores shared with a gateway and other processes. libgomp reads the policy once, when torch
    loads: call this first thing in a serving process. Training processes keep OpenMP's default,
    which is faster for their long matrix products (a fine-tune run took 35 s spinning, 57 s
    passive: `benchmarks/finetune_gain.py` with OMP_WAIT_POLICY set either way)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
