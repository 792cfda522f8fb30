"""workers: the model runtime — models behind their seams, decoding, scheduler, engine, the Worker
server, hot-swap and isolation."""

import os

# torch's OpenMP threads spin while waiting for work. On a machine shared with a gateway and
# other processes that turned a 1 ms decode step into 120 ms (measured on 2 cores), so they
# wait passively unless the operator says otherwise. libgomp reads this once, when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
