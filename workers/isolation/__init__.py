"""Isolation hooks for a worker: only the gateway gets in, and the worker reaches only what its
policy lists. `REFLOW_ISOLATION` picks `ebpf`, `none`, or `auto` (eBPF where the host allows it).

The eBPF hook gives each worker a cgroup (v2) of its own under `<cgroup2>/reflow/<instance>/`,
where the instance is derived from the data dir, so two `reflow up` on one host stay apart:

- prepare: finds (or mounts) cgroup v2, removes the groups of workers that died, creates this
  worker's group, loads the programs of `workers/isolation/bpf/isolation.bpf.c` and attaches them to it;
- start_inside: moves this process into its group, before it creates a socket (sockets keep the
  cgroup they were created in, so moving a serving process would not be enough), and checks that
  the programs act there. From then on a new connection to any port of the worker needs the
  gateway's cgroup or, from another host, an allowed source address (REFLOW_ISOLATION_ALLOW_FROM);
- open_port: lets anyone connect to one port (the metrics port, for Prometheus);
- stats: dropped and admitted connections, read from the programs' counters;
- teardown: detaches the programs, leaves the group and removes it.

`isolate` runs prepare and start_inside, falling back to no isolation under `auto`. The groups
themselves, the gateway's among them, are `reflow.cgroups`'.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from reflow.addresses import Network
from reflow.cgroups import (
    OPT_OUT,
    IsolationUnavailable,
    cgroup_id,
    current_group,
    gateway_dir,
    instance_dir,
    join,
    remove_group,
    remove_leftover_groups,
)
from workers.isolation.ebpf import BpfError, IsolationPrograms
from workers.isolation.host import check_host
from workers.isolation.policy import egress_policy

logger = logging.getLogger(__name__)
PROBE_DESTINATION = ("192.0.2.1", 9)  # TEST-NET-1, discard: a worker's policy should never allow it


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


@dataclass(frozen=True)
class IsolationConfig:
    """Which hook, for which instance, admitting whom and letting the worker reach where."""

    mode: str  # ebpf, none, or auto (eBPF where the host allows it)
    instance: Path  # the data dir the instance's cgroups are named after
    allow_from: tuple[str, ...]  # CIDRs of gateways on other hosts
    egress: tuple[str, ...]  # ADDR[/PREFIX][:PORT] the worker may connect to
    bpf_object: Path  # the compiled programs (DEFAULT_OBJECT unless REFLOW_BPF_OBJECT)
    tracking_uri: str  # the MLflow server the worker downloads from, when it is http(s); or ""


class EbpfIsolation:
    """One worker's cgroup with the isolation programs attached."""

    name = "ebpf"

    def __init__(self, config: IsolationConfig):
        self.config = config
        self.programs: IsolationPrograms | None = None
        self.group: Path | None = None
        self.origin: Path | None = None  # the group this process was in before
        self.egress: list[tuple[Network, int]] = []

    def prepare(self) -> None:
        """Checks the host, creates this worker's group and attaches the programs to it."""
        programs = self.config.bpf_object
        check_host(programs)
        instance = instance_dir(self.config.instance)
        remove_leftover_groups(instance)
        gateway = gateway_dir(self.config.instance)
        self.egress = egress_policy(self.config.egress, self.config.tracking_uri)
        self.group = instance / f"worker-{os.getpid()}"
        self.group.mkdir(exist_ok=True)
        try:
            self.programs = IsolationPrograms(programs, self.group)
            self.programs.allow_cgroup(cgroup_id(gateway))
            for source in self.config.allow_from:
                self.programs.allow_source(ipaddress.ip_network(source, strict=False))
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
        probe = ipaddress.IPv4Network(PROBE_DESTINATION[0])
        if any(isinstance(n, ipaddress.IPv4Network) and probe.subnet_of(n) for n, _ in self.egress):
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


def isolate(config: IsolationConfig) -> Isolation:
    """The hook REFLOW_ISOLATION asks for, prepared, with this process inside: call it before the
    worker makes its first socket. Where the host cannot isolate, `auto` logs why and runs without
    isolation, while `ebpf` raises IsolationUnavailable saying why."""
    if config.mode == "none":
        return NoIsolation()
    hook = EbpfIsolation(config)
    try:
        hook.prepare()
        hook.start_inside()
    except (IsolationUnavailable, BpfError, OSError) as error:
        hook.teardown()
        reason = str(error) if isinstance(error, IsolationUnavailable) else f"{error}; {OPT_OUT}"
        if config.mode == "ebpf":
            raise IsolationUnavailable(reason) from None
        logger.warning(
            "worker isolation off (REFLOW_ISOLATION=auto): %s. Whoever reaches the worker port (any "
            "process on this machine, unless REFLOW_TLS_* are set) calls it without an API key or a "
            "quota, and may load and unload versions; set REFLOW_ISOLATION=ebpf to require isolation, "
            "or REFLOW_ISOLATION=none to accept this",
            reason.splitlines()[0].removesuffix(f"; {OPT_OUT}"),
        )
        return NoIsolation()
    return hook
