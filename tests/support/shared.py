"""What many tests read and none changes, built once per run: a directory under the run's own temp
root, shared by pytest-xdist's workers. The first to ask builds it behind a file lock; the others
wait for it, then read it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

DONE = ".built"  # written last: a directory without it was cut short (a killed run) and is built again


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The directory `name`, which `build(directory)` filled once for this run."""
    root = factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:  # each worker has its own basetemp below the run's
        root = root.parent
    shelf = root / "shared"
    shelf.mkdir(exist_ok=True)
    directory = shelf / name
    with FileLock(shelf / f"{name}.lock"):
        if not (directory / DONE).is_file():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            (directory / DONE).touch()
    return directory
