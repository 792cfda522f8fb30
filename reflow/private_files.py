"""What only the user running reflow may read: the data dir (0700 when reflow creates it: the store,
the outbox, the logs) and the files in it that hold secrets (0600, also when they exist already)."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """`path`, created 0700 (its missing parents as the umask says) when it does not exist; an
    existing directory keeps its mode, since it may be one the user shares on purpose."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    return path


def private_file(path: Path) -> Path:
    """`path`, created empty and 0600 when missing (its directory private too), made 0600 when
    others could read it (a file from an older release)."""
    private_dir(path.parent)
    path.touch(mode=FILE_MODE)
    if path.stat().st_mode & 0o777 != FILE_MODE:
        try:
            path.chmod(FILE_MODE)
        except PermissionError:  # another user's file: its owner decides who reads it
            logger.warning("%s holds secrets and others may read it; make it 0600 (chmod 600)", path)
    return path
