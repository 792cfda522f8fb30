"""reflow's test suite; see workers/__init__.py for why OpenMP threads wait passively."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before any test module imports torch
