"""A supervisor of child processes: start them, wait until they are ready, watch them, stop them in order."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from feedback.bus.broker import tansu_command, wait_listening
from reflow.gateway_tls import client_credentials
from reflow.mtls import open_channel
from reflow.serving import free_port
from reflow.settings import Settings

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # a worker may download and load a model first
STOP_MARGIN_S = 10.0  # beyond the children's own drain grace
MAX_RESTARTS, RESTART_WINDOW_S = 3, 600.0  # a child that exits more often is broken, not unlucky

_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child must not dlopen


class ChildFailed(RuntimeError):
    """A child exited, or did not become ready or serving in time; the message says which, and why."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a killed supervisor leaves no orphans


@dataclass
class Child:
    """One supervised process and where its log goes; a restartable one is started again (with
    `restart_args` added) when it exits, at most MAX_RESTARTS times in RESTART_WINDOW_S."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    ready_file: Path | None = None
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restart_args: list[str] | None = None  # None: its exit ends the supervision
    restarts: list[float] = field(default_factory=list)  # when it was restarted (monotonic)

    def tail(self, lines: int = 20) -> str:
        """The last lines of the child's log, for an error message."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def exited(self, code: int) -> str:
        """Why it exited: the one line a reflow command prints when it cannot start (`error: ...`),
        else the end of its log."""
        tail = self.tail()
        said = [line for line in tail.splitlines() if line.startswith("error: ")]
        if said:
            return (
                f"{self.name} exited with status {code}: {said[-1].removeprefix('error: ')} (log: {self.log})"
            )
        return f"{self.name} exited with status {code}; its log ({self.log}) ends:\n{tail}"


@dataclass
class Supervisor:
    """Starts children, waits until they are ready, watches them and stops them in order."""

    settings: Settings
    children: list[Child] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        """Where each child's output is written."""
        return self.settings.data_dir / "logs"

    def spawn(self, name: str, args: list[str], env: dict[str, str], ready: bool = True) -> Child:
        """Starts `python -m reflow ARGS` (or ARGS when they start with an executable's path) as a child."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        ready_file = self.settings.data_dir / "run" / f"{name}.json" if ready else None
        if ready_file is not None:
            ready_file.parent.mkdir(parents=True, exist_ok=True)
            ready_file.unlink(missing_ok=True)
            args = [*args, "--ready-file", str(ready_file)]
        command = args if os.path.isabs(args[0]) else [sys.executable, "-m", "reflow", *args]
        child = Child(name, _start(command, env, log), log, ready_file, command, env)
        self.children.append(child)
        return child

    def restart_on_exit(self, child: Child, *args: str) -> None:
        """From now on, `child` exiting starts it again with `args` added (e.g. the port it had)."""
        child.restart_args = list(args)

    def wait_ready(self, child: Child, timeout_s: float = START_TIMEOUT_S) -> dict[str, str]:
        """What a child wrote to its ready file (address, metrics); ChildFailed if it died or timed out."""
        assert child.ready_file is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if child.ready_file.is_file():
                return json.loads(child.ready_file.read_text())
            time.sleep(0.1)
        raise ChildFailed(f"{child.name} did not become ready in {timeout_s:.0f}s:\n{child.tail()}")

    def spawn_broker(self, env: dict[str, str] | None = None) -> str:
        """Starts the embedded Kafka broker (memory-only Tansu) on a free loopback port; returns its
        bootstrap address once it accepts connections."""
        port = free_port()
        broker = self.spawn("kafka", tansu_command(port), env or {}, ready=False)
        try:
            wait_listening("127.0.0.1", port)
        except TimeoutError as error:
            raise ChildFailed(f"the embedded Kafka broker: {error}; see its log, {broker.log}") from None
        return f"127.0.0.1:{port}"

    def check_alive(self) -> None:
        """Restarts a restartable child that exited; ChildFailed naming the first other child that
        exited (or one that keeps exiting), and why."""
        for child in self.children:
            code = child.process.poll()
            if code is None:
                continue
            now = time.monotonic()
            child.restarts = [at for at in child.restarts if now - at < RESTART_WINDOW_S]
            if child.restart_args is None or len(child.restarts) >= MAX_RESTARTS:
                raise ChildFailed(child.exited(code))
            logger.warning("%s exited with status %s; starting it again", child.name, code)
            child.restarts.append(now)
            child.process = _start([*child.command, *child.restart_args], child.env, child.log)

    def stop(self) -> None:
        """SIGTERM to each child, newest first (gateway drains before workers go), then SIGKILL."""
        timeout_s = self.settings.shutdown_grace_s + STOP_MARGIN_S
        for child in reversed(self.children):
            if child.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.process.pid, signal.SIGTERM)
            try:
                child.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs; killing it", child.name, timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.process.pid, signal.SIGKILL)  # and anything it left behind
            child.process.wait()
        self.children.clear()


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
            preexec_fn=_die_with_parent,
        )


def wait_serving(address: str, timeout_s: float = 60.0, ca_file: str | None = None) -> None:
    """Blocks until the gRPC server at `address` answers health checks with SERVING (over TLS
    trusting the CA in `ca_file`, as the gateway's clients call it, when given)."""
    deadline = time.monotonic() + timeout_s
    with open_channel(address, client_credentials(ca_file)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(  # type: ignore[attr-defined]  # typeshed's HealthStub lists no methods
                    health_pb2.HealthCheckRequest(), timeout=1.0
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.2)
    raise ChildFailed(f"{address} did not report SERVING within {timeout_s:.0f}s")


def wait_http(url: str, timeout_s: float = 60.0) -> bool:
    """True once `url` answers HTTP 200 (the MLflow UI's health endpoint)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1.0) as reply:
            if reply.status == 200:
                return True
        time.sleep(0.3)
    return False
