"""`python -m reflow` runs the command line, as the `reflow` script does."""

from reflow.cli import app

app()
