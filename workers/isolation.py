"""Isolation hooks for a worker: only the gateway gets in, and the worker reaches only what its
policy lists. `REFLOW_ISOLATION` picks `ebpf`, `none`, or `auto` (eBPF where the host allows it).

The eBPF hook gives each worker a cgroup (v2) of its own under `<cgroup2>/reflow/<instance>/`,
where the instance is derived from the data dir, so two `reflow up` on one host stay apart:

- prepare: finds (or mounts) cgroup v2, removes the groups of workers that died, creates this
  worker's group, loads the programs of `workers/bpf/isolation.bpf.c` and attaches them to it;
- start_inside: moves this process into its group, before it creates a socket (sockets keep the
  cgroup they were created in, so moving a serving process would not be enough);
- guard: after binding, new connections to the gRPC port need the gateway's cgroup or an allowed
  source address (REFLOW_ISOLATION_ALLOW_FROM, for gateways on other hosts);
- stats: dropped and admitted connections, read from the programs' counters;
- teardown: detaches the programs, leaves the group and removes it.

The gateway joins `<instance>/gateway`; reflow's own control commands that talk to workers (the
scheduler's pushes, `reflow models promote|rollback`, `reflow workers status`) join it as well.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import ipaddress
import logging
import os
import socket
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from reflow.errors import FailedPrecondition
from reflow.settings import Network, Settings, parse_destination
from workers.ebpf import BpfError, IsolationPrograms

logger = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OBJECT = REPO_ROOT / "build" / "bpf" / "isolation.bpf.o"
MOUNT_POINT = Path("/run/reflow/cgroup2")  # where cgroup v2 is mounted when the host has only v1
CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_BPF = 12, 21, 39
OPT_OUT = "set REFLOW_ISOLATION=none to run without isolation"


class IsolationUnavailable(FailedPrecondition):
    """The host cannot isolate workers; the message names what is missing."""


class Isolation(Protocol):
    """What a worker calls around its life."""

    name: str

    def prepare(self) -> None: ...
    def start_inside(self) -> None: ...
    def guard(self, port: int) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def teardown(self) -> None: ...


class NoIsolation:
    """`REFLOW_ISOLATION=none`: anyone who can reach the port can call the worker."""

    name = "none"

    def prepare(self) -> None:
        pass

    def start_inside(self) -> None:
        pass

    def guard(self, port: int) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}

    def teardown(self) -> None:
        pass


class EbpfIsolation:
    """One worker's cgroup with the isolation programs attached."""

    name = "ebpf"

    def __init__(self, settings: Settings, object_path: Path = DEFAULT_OBJECT):
        self.settings = settings
        self.object_path = Path(settings.bpf_object) if settings.bpf_object else object_path
        self.instance = instance_dir(settings)
        self.group = self.instance / f"worker-{os.getpid()}"
        self.programs: IsolationPrograms | None = None
        self.origin: Path | None = None  # the group this process was in before

    def prepare(self) -> None:
        check_host(self.object_path)
        reconcile(self.instance)
        gateway = gateway_dir(self.settings)
        self.group.mkdir(exist_ok=True)
        try:
            self.programs = IsolationPrograms(self.object_path, self.group)
        except BpfError as error:
            self.group.rmdir()
            raise IsolationUnavailable(f"{error}\n{OPT_OUT}") from None
        self.programs.allow_cgroup(cgroup_id(gateway))
        for network in self.settings.isolation_allow_from:
            self.programs.allow_source(ipaddress.ip_network(network, strict=False))
        for network, port in egress_policy(self.settings):
            self.programs.allow_destination(network, port)
        logger.info("isolation: cgroup %s, gateway group %s", self.group, gateway)

    def start_inside(self) -> None:
        self.origin = current_group()
        join(self.group)

    def guard(self, port: int) -> None:
        assert self.programs is not None
        self.programs.guard_port(port)

    def stats(self) -> dict[str, int]:
        return self.programs.counters() if self.programs is not None else {}

    def teardown(self) -> None:
        if self.programs is not None:
            self.programs.close()
            self.programs = None
        if self.origin is not None:
            join(self.origin)  # back where it came from, so the group can go
        remove_group(self.group)


def isolation_for(settings: Settings) -> Isolation:
    """The hook REFLOW_ISOLATION asks for; `auto` falls back to none, saying why, where the host
    cannot do eBPF. IsolationUnavailable when `ebpf` was asked for and the host cannot."""
    if settings.isolation == "none":
        return NoIsolation()
    try:
        check_host(Path(settings.bpf_object) if settings.bpf_object else DEFAULT_OBJECT)
    except IsolationUnavailable as error:
        if settings.isolation == "ebpf":
            raise
        logger.warning("worker isolation off (REFLOW_ISOLATION=auto): %s", str(error).splitlines()[0])
        return NoIsolation()
    return EbpfIsolation(settings)


def check_host(object_path: Path) -> None:
    """IsolationUnavailable naming the first thing the host lacks."""
    if not Path("/proc/self/status").is_file():
        raise IsolationUnavailable(f"eBPF isolation needs Linux; {OPT_OUT}")
    missing = [name for bit, name in ((CAP_BPF, "CAP_BPF"), (CAP_NET_ADMIN, "CAP_NET_ADMIN"),
               (CAP_SYS_ADMIN, "CAP_SYS_ADMIN")) if not has_capability(bit)]  # fmt: skip
    if missing:
        raise IsolationUnavailable(
            f"eBPF isolation needs {', '.join(missing)} (run the worker as root or grant them); {OPT_OUT}"
        )
    if not object_path.is_file():
        raise IsolationUnavailable(
            f"{object_path} not found: build it with `make bpf` (needs clang and libbpf-dev); {OPT_OUT}"
        )
    cgroup2_root()


def has_capability(bit: int) -> bool:
    """Whether this process holds capability `bit` (effective set)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def cgroup2_root() -> Path:
    """Where cgroup v2 is mounted; mounted at MOUNT_POINT when the host has only v1."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    MOUNT_POINT.mkdir(parents=True, exist_ok=True)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mount(b"none", str(MOUNT_POINT).encode(), b"cgroup2", 0, None) != 0:
        raise IsolationUnavailable(
            f"no cgroup v2 hierarchy is mounted and mounting one at {MOUNT_POINT} failed "
            f"({os.strerror(ctypes.get_errno())}); {OPT_OUT}"
        )
    return MOUNT_POINT


def instance_dir(settings: Settings, *, create: bool = True) -> Path:
    """`<cgroup2>/reflow/<instance>`, the instance named after the data dir."""
    digest = hashlib.sha256(str(settings.data_dir.resolve()).encode()).hexdigest()[:12]
    path = cgroup2_root() / "reflow" / digest
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def remove_instance(settings: Settings) -> None:
    """After `reflow up` stopped its processes: removes the instance's groups, if empty."""
    if settings.isolation == "none" or not has_capability(CAP_SYS_ADMIN):
        return
    instance = instance_dir(settings, create=False)
    if instance.is_dir():
        reconcile(instance)
        remove_group(instance / "gateway")
        remove_group(instance)


def gateway_dir(settings: Settings) -> Path:
    """The gateway's group, created when missing (workers need its id before it starts); never
    removed, so its id stays what running workers were told."""
    path = instance_dir(settings) / "gateway"
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


def join_gateway_group(settings: Settings, *, create: bool = True) -> bool:
    """For the gateway, and for reflow's commands that call workers (`create=False`: only when a
    gateway or an isolated worker made the group): joins the group isolated workers admit.
    False where isolation is off, the group does not exist, or the host does not allow it."""
    if settings.isolation == "none":
        return False
    try:
        check_host(Path(settings.bpf_object) if settings.bpf_object else DEFAULT_OBJECT)
        group = gateway_dir(settings) if create else instance_dir(settings, create=False) / "gateway"
        if not group.is_dir():
            return False
        join(group)
    except (IsolationUnavailable, OSError) as error:
        message = str(error).splitlines()[0]
        if settings.isolation == "ebpf":
            logger.warning("could not join the gateway's cgroup: %s", message)
        return False
    return True


def reconcile(instance: Path) -> None:
    """Removes the groups of workers that are gone (their programs went with their process). A
    group is named after its worker's pid: one whose worker lives (perhaps still preparing, not
    yet inside) is left alone."""
    for group in instance.glob("worker-*"):
        pid = group.name.removeprefix("worker-")
        if pid.isdigit() and Path(f"/proc/{pid}").exists():
            continue
        remove_group(group)
        logger.info("removed the leftover cgroup %s", group)


def remove_group(group: Path) -> None:
    """Removes an empty cgroup; one still holding processes is left, logged."""
    try:
        group.rmdir()
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("could not remove cgroup %s: %s", group, error)


def egress_policy(settings: Settings) -> list[tuple[Network, int]]:
    """Destinations a worker may connect to: REFLOW_ISOLATION_EGRESS, and the MLflow tracking
    server when it is one (it downloads versions from there)."""
    policy = [parse_destination(entry) for entry in settings.isolation_egress]
    uri = urlsplit(settings.resolved_tracking_uri)
    if uri.scheme in ("http", "https") and uri.hostname:
        port = uri.port or (443 if uri.scheme == "https" else 80)
        for *_, address in socket.getaddrinfo(uri.hostname, port, type=socket.SOCK_STREAM):
            policy.append((ipaddress.ip_network(address[0]), port))
    return policy
