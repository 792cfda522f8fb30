"""Tasks users ask of the models: the `Task` seam, its implementations by name, simulated users."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from feedback.tasks.arith import Arith
from feedback.tasks.numbered import Numbered
from feedback.tasks.task import Task
from feedback.tasks.terse import Terse

TASKS: dict[str, Callable[..., Task]] = {"arith": Arith, "numbered": Numbered, "terse": Terse}
BUILTIN_MODEL_TASK = "arith"  # what the built-in demo model is trained on, and all it knows


def get_task(name: str, **options: Any) -> Task:
    """The task called `name`, made with `options` (e.g. `arith`'s operand ranges); ValueError
    naming the tasks there are, or the options this one does not take."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; reflow has {', '.join(sorted(TASKS))}")
    try:
        return TASKS[name](**options)
    except TypeError as error:
        raise ValueError(f"the {name} task does not take {sorted(options)}: {error}") from None
