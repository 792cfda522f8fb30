"""The cgroup v2 groups of one reflow instance: `<cgroup2>/reflow/<instance>/`, named after the
data dir, holding a group per isolated worker and the gateway's group, the one identity isolated
workers admit. The gateway joins it first thing; reflow's commands that call workers (the
scheduler's pushes, `reflow models promote|rollback`, `reflow workers status`) join it too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import logging
import os
import time
from pathlib import Path

from reflow.errors import FailedPrecondition

logger = logging.getLogger(__name__)
MOUNT_POINT = Path("/run/reflow/cgroup2")  # where cgroup v2 is mounted when the host has only v1
OPT_OUT = "set REFLOW_ISOLATION=none to run without isolation"


class IsolationUnavailable(FailedPrecondition):
    """The host cannot isolate workers; the message names what is missing."""


def mounted_cgroup2() -> Path | None:
    """Where cgroup v2 is mounted, if it is."""
    mounts = Path("/proc/self/mounts")
    for line in mounts.read_text().splitlines() if mounts.is_file() else []:
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def cgroup2_root() -> Path:
    """Where cgroup v2 is mounted; mounted at MOUNT_POINT when the host has only v1."""
    if (mounted := mounted_cgroup2()) is not None:
        return mounted
    MOUNT_POINT.mkdir(parents=True, exist_ok=True)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mount(b"none", str(MOUNT_POINT).encode(), b"cgroup2", 0, None) != 0:
        raise IsolationUnavailable(
            f"no cgroup v2 hierarchy is mounted and mounting one at {MOUNT_POINT} failed "
            f"({os.strerror(ctypes.get_errno())}); {OPT_OUT}"
        )
    return MOUNT_POINT


def instance_dir(data_dir: Path, *, create: bool = True) -> Path:
    """`<cgroup2>/reflow/<instance>`, the instance named after the data dir."""
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:12]
    path = cgroup2_root() / "reflow" / digest
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def remove_instance(data_dir: Path) -> None:
    """After `reflow up` stopped its processes: removes the instance's groups, if empty."""
    if mounted_cgroup2() is None:
        return
    instance = instance_dir(data_dir, create=False)
    if instance.is_dir():
        remove_leftover_groups(instance)
        remove_group(instance / "gateway")
        remove_group(instance)


def gateway_dir(data_dir: Path) -> Path:
    """The gateway's group, created when missing (workers need its id before it starts); never
    removed, so its id stays what running workers were told."""
    path = instance_dir(data_dir) / "gateway"
    path.mkdir(exist_ok=True)
    return path


def cgroup_id(path: Path) -> int:
    """The id the kernel gives a cgroup (bpf_sk_cgroup_id): its directory's inode number."""
    return os.stat(path).st_ino


def current_group(pid: int | str = "self") -> Path:
    """The cgroup v2 directory of process `pid` (this one by default)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return cgroup2_root() / line[3:].lstrip("/")
    raise IsolationUnavailable(f"process {pid} is in no cgroup v2 group; {OPT_OUT}")


def join(group: Path) -> None:
    """Moves this process (all its threads) into `group`."""
    (group / "cgroup.procs").write_text(str(os.getpid()))


def join_gateway_group(data_dir: Path, *, create: bool = True) -> bool:
    """For the gateway, and for reflow's commands that call workers (`create=False`: only when a
    gateway or an isolated worker made the group): joins the group isolated workers admit.
    False where the group does not exist or the host does not allow it."""
    try:
        if not create and mounted_cgroup2() is None:
            return False  # no cgroup v2: no worker of this host can be isolated
        group = gateway_dir(data_dir) if create else instance_dir(data_dir, create=False) / "gateway"
        if not group.is_dir():
            return False
        join(group)
    except (IsolationUnavailable, OSError) as error:
        logger.warning(
            "could not join the gateway's cgroup (%s): isolated workers will not admit this process",
            str(error).splitlines()[0],
        )
        return False
    return True


def remove_leftover_groups(instance: Path) -> None:
    """Removes the groups of workers that are gone (their programs went with their process). A
    group is named after its worker's pid: one whose worker lives (perhaps still preparing, not
    yet inside) is left alone."""
    for group in instance.glob("worker-*"):
        pid = group.name.removeprefix("worker-")
        if pid.isdigit() and Path(f"/proc/{pid}").exists():
            continue
        if remove_group(group):
            logger.info("removed the leftover cgroup %s", group)


def remove_group(group: Path, patience_s: float = 2.0) -> bool:
    """Removes an empty cgroup; one still holding processes is left, logged. True if removed.
    Threads that were exiting when their process left the group stay counted in it until they are
    gone (the kernel does not move an exiting task), so a busy group is tried again for up to
    `patience_s`."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            group.rmdir()
        except FileNotFoundError:
            return False
        except OSError as error:
            if error.errno == errno.EBUSY and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            logger.warning("could not remove cgroup %s: %s", group, error)
            return False
        return True
