"""Tasks users ask of the models: the `Task` seam, its implementations by name, simulated users."""

from __future__ import annotations

from typing import Any

from feedback.tasks.arith import Arith
from feedback.tasks.task import Task

TASKS: dict[str, type[Arith]] = {"arith": Arith}


def get_task(name: str, **options: Any) -> Task:
    """The task called `name`, made with `options` (e.g. `arith`'s operand ranges)."""
    try:
        return TASKS[name](**options)
    except KeyError:
        raise ValueError(f"unknown task {name!r}; reflow has {', '.join(sorted(TASKS))}") from None
