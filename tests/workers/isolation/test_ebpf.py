"""eBPF isolation of real `reflow worker` processes: only the gateway gets in, a worker reaches only
its allow-list, workers cannot reach each other, a killed worker leaves no program behind, and
across hosts (network namespaces) the address allow-list admits the gateway's address only.

Needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN), cgroup v2 and the compiled programs
(`make bpf`); skipped with the reason otherwise."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gateway.tenants import create_tenant
from reflow.cgroups import current_group, instance_dir, remove_group, remove_instance
from reflow.client import Client
from reflow.store.database import migrate, open_db
from reflow.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from tests.support.certificates import tls_files
from tests.support.cli import Process, reflow, start
from tests.support.kafka import Broker
from tests.support.models import MODEL, save_model, tiny_model
from tests.support.netns import network
from tests.support.registry import local_registry
from tests.support.waiting import wait_for
from workers.isolation.ebpf import PROGRAMS, attached_programs

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolation_host")]
UDP_SEND = """import socket
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", 53)); print("sent")
except OSError as error:
    print(type(error).__name__, error.errno)"""
LISTEN_50999 = """import socket, time
server = socket.create_server(("0.0.0.0", 50999))
print("up", flush=True)
time.sleep(60)"""


def worker_env(root: Path, **extra: str) -> dict[str, str]:
    """A data dir whose registry serves a tiny arith v1 @champion."""
    if not (root / "mlflow.db").exists():
        registry = local_registry(root)
        registry.register(
            MODEL, save_model(tiny_model(), root / "v1"), params={}, metrics={}, alias="champion"
        )
    return {
        "REFLOW_DATA_DIR": str(root), "REFLOW_MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        "REFLOW_MLFLOW_ARTIFACT_ROOT": (root / "mlflow-artifacts").as_uri(), "REFLOW_DEVICE": "cpu",
        "REFLOW_ISOLATION": "ebpf", "REFLOW_REGISTRY_POLL_S": "0", **extra,
    }  # fmt: skip


def run_inside(group: Path, code: str) -> str:
    """Runs Python `code` in a new process placed in cgroup `group` before it makes any socket."""

    def enter() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=enter,
                            timeout=30)  # fmt: skip
    return (result.stdout + result.stderr).strip()


def connect_code(host: str, port: int, source: str = "", source_port: int = 0) -> str:
    """Python that prints `connected` or the error of one TCP connect."""
    bind = f", source_address=({source!r}, {source_port})" if source else ""
    return (
        "import socket\ntry:\n"
        f"    socket.create_connection(({host!r}, {port}), timeout=2{bind}).close(); print('connected')\n"
        "except OSError as error:\n    print(type(error).__name__, error.errno)"
    )


def counters(worker: Process) -> dict[tuple[str, str], float]:
    """The worker's isolation counters from its (unguarded) metrics endpoint."""
    with urllib.request.urlopen(worker.ready["metrics"], timeout=10) as reply:
        text = reply.read().decode()
    pattern = r'reflow_worker_isolation_connections_total\{direction="(\w+)",verdict="(\w+)"\} (\S+)'
    return {(d, v): float(n) for d, v, n in re.findall(pattern, text)}


@dataclass
class Cluster:
    root: Path
    workers: list[Process]
    gateway: Process
    api_key: str
    allowed: socket.socket  # a listener the first worker may connect to


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two isolated workers (the first may connect to one local listener) and a gateway."""
    root = tmp_path_factory.mktemp("isolated")
    broker = Broker()
    broker.start()
    store = open_db(f"sqlite:///{root / 'reflow.db'}")
    migrate(store)
    _, api_key = create_tenant(store, "acme")
    store.dispose()
    allowed = socket.create_server(("127.0.0.1", 0))
    allowed.listen()
    port = allowed.getsockname()[1]
    started: list[Process] = []
    try:
        for i, egress in enumerate((f"127.0.0.1:{port}", "")):
            env = worker_env(root, REFLOW_ISOLATION_EGRESS=egress)
            started.append(start(root, f"worker-{i}", ["worker"], env))
        gateway_env = {**worker_env(root), "REFLOW_KAFKA_BOOTSTRAP": broker.bootstrap,
                       "REFLOW_WORKERS": ",".join(w.address for w in started)}  # fmt: skip
        gateway = start(root, "gateway", ["gateway", "--port", "0", "--http-port", "0"], gateway_env)
        started.append(gateway)
        yield Cluster(root, started[:2], gateway, api_key, allowed)
    finally:
        for process in reversed(started):
            process.stop()
        allowed.close()
        broker.stop()
        remove_instance(root)


def test_the_gateway_reaches_an_isolated_worker_and_nothing_else_does(cluster: Cluster) -> None:
    with Client(cluster.gateway.address, cluster.api_key) as client:
        messages = list(client.generate("12+30=", sampling=inference_pb2.SamplingParams(max_tokens=4)))
    assert messages[-1].usage.completion_tokens == 4  # through the gateway's cgroup: admitted
    worker = cluster.workers[0]
    before = counters(worker)[("inbound", "dropped")]
    # this test runs outside the gateway's cgroup
    with grpc.insecure_channel(worker.address) as channel, pytest.raises(grpc.RpcError) as refused:
        worker_pb2_grpc.WorkerStub(channel).Status(worker_pb2.WorkerStatusRequest(), timeout=3)
    assert refused.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(TimeoutError):  # the SYN is dropped: no answer at all
        socket.create_connection(("127.0.0.1", worker.port), timeout=2)
    wait_for(lambda: counters(worker)[("inbound", "dropped")] > before)

    status = reflow(
        "workers",
        "status",
        "--json",
        env={**worker_env(cluster.root), "REFLOW_WORKERS": worker.address},
        timeout_s=60,
    )
    assert status.returncode == 0, status.stderr
    [row] = json.loads(status.stdout)
    assert row["isolation"] == "ebpf" and row["connections_dropped"] >= 1
    assert [v["version"] for v in row["loaded"]] == ["1"]


def test_a_worker_connects_only_to_its_allow_list(cluster: Cluster) -> None:
    worker = cluster.workers[0]
    group = current_group(worker.process.pid)
    assert group.name == f"worker-{worker.process.pid}"
    allowed_port = cluster.allowed.getsockname()[1]
    assert run_inside(group, connect_code("127.0.0.1", allowed_port)) == "connected"
    assert run_inside(group, connect_code("::ffff:127.0.0.1", allowed_port)) == "connected"  # v4-mapped
    denied = run_inside(group, connect_code("127.0.0.1", 5432))  # the database: not listed
    assert denied == "PermissionError 1"
    assert run_inside(group, UDP_SEND) == "PermissionError 1"  # unconnected UDP is checked too
    wait_for(lambda: counters(worker)[("outbound", "denied")] >= 1)
    assert counters(worker)[("outbound", "allowed")] >= 1


def test_two_isolated_workers_cannot_reach_each_other(cluster: Cluster) -> None:
    first, second = cluster.workers
    assert (
        run_inside(current_group(first.process.pid), connect_code("127.0.0.1", second.port))
        == "PermissionError 1"
    )
    assert (
        run_inside(current_group(second.process.pid), connect_code("127.0.0.1", first.port))
        == "PermissionError 1"
    )


def test_ipv6_gets_the_same_treatment(tmp_path: Path) -> None:
    worker = start(tmp_path, "worker", ["worker"], worker_env(tmp_path, REFLOW_WORKER_HOST="::1"))
    try:
        assert worker.address.startswith("[::1]:")
        gateway_group = current_group(worker.process.pid).parent / "gateway"
        assert run_inside(gateway_group, connect_code("::1", worker.port)) == "connected"
        with pytest.raises(TimeoutError):
            socket.create_connection(("::1", worker.port), timeout=2)
        assert run_inside(current_group(worker.process.pid), connect_code("::1", 5432)) == "PermissionError 1"
    finally:
        worker.stop()
        remove_instance(tmp_path)


def test_a_killed_worker_leaves_no_program_and_its_group_is_reconciled(tmp_path: Path) -> None:
    env = worker_env(tmp_path)
    killed = start(tmp_path, "killed", ["worker"], env)
    group = current_group(killed.process.pid)
    assert attached_programs(group) == len(PROGRAMS)  # ingress, connect4/6, sendmsg4/6
    killed.stop(signal.SIGKILL)
    wait_for(lambda: attached_programs(group) == 0)  # the links died with the process
    assert group.is_dir()  # an empty leftover, until the next worker starts
    restarted = start(tmp_path, "restarted", ["worker"], env)
    own = current_group(restarted.process.pid)
    try:
        assert not group.exists()
        assert attached_programs(own) == len(PROGRAMS)
    finally:
        restarted.stop()
    assert not own.exists()  # a clean stop removes its own group
    remove_instance(tmp_path)
    assert not own.parent.exists()


def test_across_hosts_the_address_allow_list_admits_the_gateway_only(tmp_path: Path) -> None:
    extra = {"peer": ["10.213.0.3"]}  # the peer is the gateway's host (.2) and another (.3)
    with network("host", "peer", subnet="10.213.0", extra=extra) as hosts:
        host, peer = hosts["host"], hosts["peer"]
        files = tls_files(tmp_path / "tls", "reflow test CA")  # off loopback a worker serves mTLS only
        env = worker_env(
            tmp_path, REFLOW_WORKER_HOST="10.213.0.1", REFLOW_ISOLATION_ALLOW_FROM="10.213.0.2/32",
            REFLOW_TLS_CA_FILE=str(files["ca"][0]), REFLOW_TLS_CERT_FILE=str(files["worker"][0]),
            REFLOW_TLS_KEY_FILE=str(files["worker"][1]),
        )  # fmt: skip
        worker = start(tmp_path, "worker", ["worker"], env, prefix=host.exec)
        try:

            def from_peer(source: str, source_port: int = 0) -> str:
                code = connect_code("10.213.0.1", worker.port, source, source_port)
                result = subprocess.run([*peer.exec, sys.executable, "-c", code],
                                        capture_output=True, text=True, timeout=30)  # fmt: skip
                return result.stdout.strip()

            assert from_peer("10.213.0.2") == "connected"  # the gateway's address
            assert from_peer("10.213.0.3").startswith("TimeoutError")  # another address of that host
            # a listener of the gateway's cgroup on the worker's host, on all addresses: a SYN
            # from another host sent from that listener's port must not pass for the gateway's
            gateway_group = current_group(worker.process.pid).parent / "gateway"
            listener = subprocess.Popen(
                [*host.exec, sys.executable, "-c", LISTEN_50999],
                stdout=subprocess.PIPE, text=True,
                preexec_fn=lambda: (gateway_group / "cgroup.procs").write_text(str(os.getpid())),
            )  # fmt: skip
            try:
                assert listener.stdout is not None and listener.stdout.readline().strip() == "up"
                assert from_peer("10.213.0.3", source_port=50999).startswith("TimeoutError")
            finally:
                listener.kill()
                listener.wait()
        finally:
            worker.stop()
            remove_instance(tmp_path)


REFUSED_PROGRAM = """#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
char LICENSE[] SEC("license") = "GPL";
SEC("cgroup_skb/ingress")
int reflow_ingress(struct __sk_buff *skb) { return *(int *)(long)skb->data; } /* unchecked read */
"""


def test_a_program_the_verifier_refuses_stops_the_worker_with_the_verifiers_reason(tmp_path: Path) -> None:
    source, compiled = tmp_path / "refused.bpf.c", tmp_path / "refused.bpf.o"
    source.write_text(REFUSED_PROGRAM)
    subprocess.run(["clang", "-O2", "-target", "bpf", f"-I/usr/include/{os.uname().machine}-linux-gnu", "-c",
                    str(source), "-o", str(compiled)], check=True)  # fmt: skip
    result = reflow("worker", env=worker_env(tmp_path, REFLOW_BPF_OBJECT=str(compiled)), timeout_s=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "the kernel refused the isolation programs" in result.stderr
    assert "invalid access to packet" in result.stderr  # the verifier's own words
    assert "REFLOW_ISOLATION=none" in result.stderr
    remove_instance(tmp_path)


def test_a_group_is_removed_once_its_last_process_is_gone_not_before(tmp_path: Path) -> None:
    """What a worker's clean stop relies on: threads still exiting when it left its group keep the
    group busy for a moment, and removing it waits for them."""
    group = instance_dir(tmp_path) / "worker-exiting"
    group.mkdir()
    held = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
        preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
    )  # fmt: skip
    try:
        assert not remove_group(group, patience_s=0) and group.is_dir()  # a process holds it
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            removing = pool.submit(remove_group, group, 60)
            assert held.stdin is not None
            held.stdin.close()  # it exits
            assert removing.result() and not group.exists()
    finally:
        held.kill()
        held.wait()
        remove_instance(tmp_path)
