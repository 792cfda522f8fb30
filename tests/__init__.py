"""reflow's test suite. Its engines and workers share two cores with everything else, as a
worker does: torch's threads wait passively (workers/threads.py), set before any test loads torch."""

from workers.threads import wait_passively

wait_passively()
