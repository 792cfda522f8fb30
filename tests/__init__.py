"""reflow's test suite. Its engines share the cores with everything else, as a worker's do: torch's
threads spin only briefly here (workers/threads.py). libgomp reads that once, as torch loads, so the
variable is taken back right after: the reflow processes a test starts choose their own, as they do
for a user (a scheduler that inherited the suite's choice would spin beside its workers).

Under pytest-xdist each worker gets its share of the cores, for itself and for the processes it
starts (OMP_NUM_THREADS): two workers of two threads each on two cores made every step wait for a
thread the other had taken, and the suite spent a fifth more CPU (1,943 s against 2,411 s)."""

import os

from workers.threads import spin_briefly

if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))
_before = os.environ.copy()
spin_briefly()
import torch  # noqa: E402, F401  # libgomp reads its environment now

for _name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
    if _name not in _before:
        os.environ.pop(_name, None)
