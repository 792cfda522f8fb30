"""Isolation hooks for a worker: only the gateway gets in, and the worker reaches only what its
policy lists. `REFLOW_ISOLATION` picks `ebpf`, `none`, or `auto` (eBPF where the host allows it).

The eBPF hook gives each worker a cgroup (v2) of its own under `<cgroup2>/reflow/<instance>/`,
where the instance is derived from the data dir, so two `reflow up` on one host stay apart:

- prepare: finds (or mounts) cgroup v2, removes the groups of workers that died, creates this
  worker's group, loads the programs of `workers/bpf/isolation.bpf.c` and attaches them to it;
- start_inside: moves this process into its group, before it creates a socket (sockets keep the
  cgroup they were created in, so moving a serving process would not be enough), and checks that
  the programs act there. From then on a new connection to any port of the worker needs the
  gateway's cgroup or, from another host, an allowed source address (REFLOW_ISOLATION_ALLOW_FROM);
- open_port: lets anyone connect to one port (the metrics port, for Prometheus);
- stats: dropped and admitted connections, read from the programs' counters;
- teardown: detaches the programs, leaves the group and removes it.

`isolate` runs prepare and start_inside, falling back to no isolation under `auto`.

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
PROBE_DESTINATION = ("192.0.2.1", 9)  # TEST-NET-1, discard: a worker's policy should never allow it
CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_BPF = 12, 21, 39
OPT_OUT = "set REFLOW_ISOLATION=none to run without isolation"


class IsolationUnavailable(FailedPrecondition):
    """The host cannot isolate workers; the message names what is missing."""


class Isolation(Protocol):
    """What a worker calls around its life, once `isolate` prepared it and moved it inside."""

    name: str

    def open_port(self, port: int) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def teardown(self) -> None: ...


class NoIsolation:
    """`REFLOW_ISOLATION=none`: anyone who can reach the port can call the worker."""

    name = "none"

    def open_port(self, port: int) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}

    def teardown(self) -> None:
        pass


class EbpfIsolation:
    """One worker's cgroup with the isolation programs attached."""

    name = "ebpf"

    def __init__(self, settings: Settings):
        self.settings = settings
        self.programs: IsolationPrograms | None = None
        self.group: Path | None = None
        self.origin: Path | None = None  # the group this process was in before
        self.egress: list[tuple[Network, int]] = []

    def prepare(self) -> None:
        """Checks the host, creates this worker's group and attaches the programs to it."""
        programs = object_path(self.settings)
        check_host(programs)
        instance = instance_dir(self.settings)
        reconcile(instance)
        gateway = gateway_dir(self.settings)
        self.egress = egress_policy(self.settings)
        self.group = instance / f"worker-{os.getpid()}"
        self.group.mkdir(exist_ok=True)
        try:
            self.programs = IsolationPrograms(programs, self.group)
            self.programs.allow_cgroup(cgroup_id(gateway))
            for network in self.settings.isolation_allow_from:
                self.programs.allow_source(ipaddress.ip_network(network, strict=False))
            for network, port in self.egress:
                self.programs.allow_destination(network, port)
        except BaseException:
            self.teardown()
            raise
        logger.info("isolation: cgroup %s, gateway group %s", self.group, gateway)

    def start_inside(self) -> None:
        """Moves this process into its group, then checks that the programs hold there (they do
        not where net_cls/net_prio v1 controllers have taken over socket cgroups)."""
        assert self.group is not None
        self.origin = current_group()
        join(self.group)
        probe = ipaddress.ip_network(PROBE_DESTINATION[0])
        if any(probe.subnet_of(n) for n, _ in self.egress if n.version == 4):  # type: ignore[arg-type]
            return  # the policy allows the probe's destination: nothing to learn from it
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            try:
                udp.connect(PROBE_DESTINATION)  # UDP: no packet is sent
            except PermissionError:
                return
        raise IsolationUnavailable(
            "the isolation programs are attached but do not act in this worker's cgroup (are the "
            f"net_cls or net_prio cgroup v1 controllers in use?); {OPT_OUT}"
        )

    def open_port(self, port: int) -> None:
        """Anyone may connect to `port` (the metrics port); every other port is guarded."""
        assert self.programs is not None
        self.programs.open_port(port)

    def stats(self) -> dict[str, int]:
        programs = self.programs
        return programs.counters() if programs is not None else {}

    def teardown(self) -> None:
        """Detaches the programs, leaves the group and removes it."""
        programs, self.programs = self.programs, None  # a metrics scrape no longer reads them
        if programs is not None:
            programs.close()
        if self.origin is not None:
            try:
                join(self.origin)  # back where it came from, so the group can go
            except OSError as error:
                logger.warning("could not leave %s: %s", self.group, error)
        if self.group is not None:
            remove_group(self.group)


def isolate(settings: Settings) -> Isolation:
    """The hook REFLOW_ISOLATION asks for, prepared, with this process inside: call it before the
    worker makes its first socket. Where the host cannot isolate, `auto` logs why and runs without
    isolation, while `ebpf` raises IsolationUnavailable saying why."""
    if settings.isolation == "none":
        return NoIsolation()
    hook = EbpfIsolation(settings)
    try:
        hook.prepare()
        hook.start_inside()
    except (IsolationUnavailable, BpfError, OSError) as error:
        hook.teardown()
        reason = str(error) if isinstance(error, IsolationUnavailable) else f"{error}; {OPT_OUT}"
        if settings.isolation == "ebpf":
            raise IsolationUnavailable(reason) from None
        logger.warning("worker isolation off (REFLOW_ISOLATION=auto): %s", reason.splitlines()[0])
        return NoIsolation()
    return hook


def object_path(settings: Settings) -> Path:
    """The compiled isolation programs: REFLOW_BPF_OBJECT, else the build directory's."""
    return Path(settings.bpf_object) if settings.bpf_object else DEFAULT_OBJECT


def check_host(object_path: Path) -> None:
    """IsolationUnavailable naming the first thing the host lacks."""
    if not Path("/proc/self/status").is_file():
        raise IsolationUnavailable(f"eBPF isolation needs Linux; {OPT_OUT}")
    held = effective_capabilities()
    missing = [name for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not held >> bit & 1]  # fmt: skip
    if not (held >> CAP_BPF & 1 or held >> CAP_SYS_ADMIN & 1):  # before Linux 5.8: SYS_ADMIN
        missing.insert(0, "CAP_BPF")
    if missing:
        raise IsolationUnavailable(
            f"eBPF isolation needs {', '.join(missing)} (run the worker as root or grant them); {OPT_OUT}"
        )
    if not object_path.is_file():
        raise IsolationUnavailable(
            f"{object_path} not found: build it with `make bpf` (needs clang and libbpf-dev); {OPT_OUT}"
        )
    cgroup2_root()


def effective_capabilities() -> int:
    """This process's effective capability set, as a bit mask (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


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


def instance_dir(settings: Settings, *, create: bool = True) -> Path:
    """`<cgroup2>/reflow/<instance>`, the instance named after the data dir."""
    digest = hashlib.sha256(str(settings.data_dir.resolve()).encode()).hexdigest()[:12]
    path = cgroup2_root() / "reflow" / digest
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def remove_instance(settings: Settings) -> None:
    """After `reflow up` stopped its processes: removes the instance's groups, if empty."""
    if settings.isolation == "none" or mounted_cgroup2() is None:
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
        if not create and mounted_cgroup2() is None:
            return False  # no cgroup v2: no worker of this host can be isolated
        group = gateway_dir(settings) if create else instance_dir(settings, create=False) / "gateway"
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


def reconcile(instance: Path) -> None:
    """Removes the groups of workers that are gone (their programs went with their process). A
    group is named after its worker's pid: one whose worker lives (perhaps still preparing, not
    yet inside) is left alone."""
    for group in instance.glob("worker-*"):
        pid = group.name.removeprefix("worker-")
        if pid.isdigit() and Path(f"/proc/{pid}").exists():
            continue
        if remove_group(group):
            logger.info("removed the leftover cgroup %s", group)


def remove_group(group: Path) -> bool:
    """Removes an empty cgroup; one still holding processes is left, logged. True if removed."""
    try:
        group.rmdir()
    except FileNotFoundError:
        return False
    except OSError as error:
        logger.warning("could not remove cgroup %s: %s", group, error)
        return False
    return True


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
