"""reflow's test suite. Its engines and workers share two cores with everything else, as a
worker does: torch's threads spin only briefly (workers/threads.py), set before any test loads torch."""

from workers.threads import spin_briefly

spin_briefly()
