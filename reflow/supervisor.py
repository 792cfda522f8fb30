"""`reflow up`: prepares the data dir, starts every process as a child, stops them all on a signal."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.table import Table

from reflow.serving import write_json_atomically
from reflow.settings import Settings

logger = logging.getLogger(__name__)
API_KEY_FILE = "api_key"
ENDPOINTS_FILE = "endpoints.json"
# `reflow up --demo`: fine-tune every minute, send half the users to a challenger, decide every
# 10 s; users (under the default tenant's 600 requests a minute) ask over 0-99, where the base
# model is mostly wrong and learns from their corrections.
DEMO_SETTINGS = {"finetune_interval_s": "60", "ab_traffic": "0.5", "ab_evaluate_s": "10"}
DEMO_SIMULATION = ["--rate", "8", "--duration", "0", "--lo", "0", "--hi", "99", "--users", "1000"]
START_TIMEOUT_S = 300.0  # a worker may download and load a model first
STOP_MARGIN_S = 10.0  # beyond the children's own drain grace


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child must not dlopen


def read_endpoints(data_dir: Path) -> dict[str, Any] | None:
    """What a running `reflow up` wrote to `<data-dir>/endpoints.json`; None when it is not up."""
    path = data_dir / ENDPOINTS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a killed supervisor leaves no orphans


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for children that cannot report their own)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_api_key(settings: Settings, console: Console) -> str:
    """The configured key, else the one saved in the data dir, else a new one; saved there 0600."""
    from gateway.tenants import new_key

    path = settings.data_dir / API_KEY_FILE
    if settings.api_key is not None:
        key = settings.api_key.get_secret_value()
    elif path.is_file():
        key = path.read_text().strip()
    else:
        key = new_key()
        console.print(f"new API key for tenant [bold]default[/]: {key}", markup=True, highlight=False)
    path.touch(mode=0o600)
    path.chmod(0o600)  # also when an older file was readable by others
    path.write_text(key + "\n")
    return key


@dataclass
class Child:
    """One supervised process and where its log goes."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    ready_file: Path | None = None

    def tail(self, lines: int = 20) -> str:
        """The last lines of the child's log, for an error message."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


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
        with log.open("ab") as out:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
                preexec_fn=_die_with_parent,
            )
        child = Child(name, process, log, ready_file)
        self.children.append(child)
        return child

    def wait_ready(self, child: Child, timeout_s: float = START_TIMEOUT_S) -> dict[str, str]:
        """What a child wrote to its ready file (address, metrics); RuntimeError if it died or timed out."""
        assert child.ready_file is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if child.ready_file.is_file():
                return json.loads(child.ready_file.read_text())
            time.sleep(0.1)
        raise RuntimeError(f"{child.name} did not become ready in {timeout_s:.0f}s:\n{child.tail()}")

    def check_alive(self) -> None:
        """RuntimeError naming the first child that exited, with the end of its log."""
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"{child.name} exited with status {code}; its log ({child.log}) ends:\n{child.tail()}"
                )

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


def wait_serving(address: str, timeout_s: float = 60.0) -> None:
    """Blocks until the gRPC server at `address` answers health checks with SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.2)
    raise RuntimeError(f"{address} did not report SERVING within {timeout_s:.0f}s")


def wait_http(url: str, timeout_s: float = 60.0) -> bool:
    """True once `url` answers HTTP 200 (the MLflow UI's health endpoint)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1.0) as reply:
            if reply.status == 200:
                return True
        time.sleep(0.3)
    return False


class Stopped(Exception):
    """Raised in the main thread by SIGINT or SIGTERM, so any step of start-up can be interrupted."""


def _raise_stopped(signum: int, _frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def cuda_device_count() -> int:
    """CUDA devices torch can see (0 on a CPU-only machine)."""
    import torch

    return torch.cuda.device_count()


def demo_overrides(settings: Settings) -> dict[str, str]:
    """`reflow up --demo`: a faster turn of the loop, for each setting the user left at its default."""
    return {
        f"REFLOW_{name.upper()}": value for name, value in DEMO_SETTINGS.items()
        if name not in settings.model_fields_set
    }  # fmt: skip


def run_up(settings: Settings, n_workers: int, console: Console, demo: bool = False) -> int:
    """Runs everything on one machine until a signal; returns the exit status. With `demo`, the
    schedule is shortened and simulated users send traffic, so the learning loop turns by itself."""
    from feedback.bootstrap import ensure_base_model
    from feedback.broker import tansu_command, wait_listening
    from feedback.kafka import ensure_topics
    from feedback.registry import Registry
    from feedback.store import migrate, open_engine
    from gateway.tenants import ensure_tenant
    from workers.isolation import remove_instance

    signal.signal(signal.SIGINT, _raise_stopped)
    signal.signal(signal.SIGTERM, _raise_stopped)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    endpoints_path = settings.data_dir / ENDPOINTS_FILE
    endpoints_path.unlink(missing_ok=True)
    supervisor = Supervisor(settings)
    # Children get absolute paths, whatever directory they start in.
    env = {"REFLOW_DATA_DIR": str(settings.data_dir.resolve())}
    if demo:
        env |= demo_overrides(settings)
    try:
        engine = open_engine(settings.resolved_database_url)
        migrate(engine)
        ensure_tenant(engine, "default", resolve_api_key(settings, console))
        engine.dispose()
        registry = Registry.from_settings(settings)
        ensure_base_model(settings, registry, console)

        bootstrap = settings.kafka_bootstrap
        if not bootstrap:  # the embedded broker
            port = free_port()
            supervisor.spawn("kafka", tansu_command(port), env, ready=False)
            wait_listening("127.0.0.1", port)
            bootstrap = f"127.0.0.1:{port}"
        ensure_topics(bootstrap, settings.kafka_partitions)
        env["REFLOW_KAFKA_BOOTSTRAP"] = bootstrap
        # Stopped after the gateway (children stop newest first), so it stores the last events.
        consumer = supervisor.spawn("consumer", ["feedback", "consume"], env)
        supervisor.spawn("scheduler", ["scheduler"], env, ready=False)  # fine-tunes from new feedback

        mlflow_url = settings.mlflow_tracking_uri
        if not mlflow_url:  # serve the UI over the embedded store
            port = settings.mlflow_ui_port or free_port()
            mlflow_url = f"http://127.0.0.1:{port}"
            supervisor.spawn(
                "mlflow",
                [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                 "--backend-store-uri", settings.resolved_tracking_uri,
                 "--default-artifact-root", str(settings.resolved_artifact_root), "--workers", "1"],
                {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # the UI only; no job runners
                ready=False,
            )  # fmt: skip

        gpus = cuda_device_count() if settings.device == "auto" else 0
        workers = []
        for i in range(n_workers):
            worker_env = {**env, "REFLOW_DEVICE": f"cuda:{i % gpus}"} if gpus else env
            workers.append(supervisor.spawn(f"worker-{i}", ["worker"], worker_env))
        with console.status("loading the model in the workers"):
            ready = {child.name: supervisor.wait_ready(child) for child in workers}
        supervisor.wait_ready(consumer)
        addresses = [r["address"] for r in ready.values()]
        gateway = supervisor.spawn(
            "gateway",
            ["gateway", "--port", str(settings.gateway_port)],
            {**env, "REFLOW_WORKERS": ",".join(addresses)},
        )
        ready["gateway"] = supervisor.wait_ready(gateway)
        gateway_address = ready["gateway"]["address"]
        wait_serving(gateway_address)
        if mlflow_url.startswith("http") and not wait_http(f"{mlflow_url}/health"):
            console.print(f"[yellow]the MLflow UI at {mlflow_url} is not answering yet[/]")

        endpoints = {
            "gateway": gateway_address,
            "mlflow": mlflow_url,
            "kafka": bootstrap,
            "database": engine.url.render_as_string(hide_password=True),
            "api_key_file": str((settings.data_dir / API_KEY_FILE).resolve()),
            "workers": addresses,
            "metrics": {name: r["metrics"] for name, r in ready.items()},
            "logs": str(supervisor.log_dir.resolve()),
        }
        write_json_atomically(endpoints_path, endpoints)
        if demo:
            supervisor.spawn("simulate", ["simulate", *DEMO_SIMULATION, "--target", gateway_address], env,
                             ready=False)  # fmt: skip

        table = Table(title="reflow is up", show_header=False)
        for key, value in endpoints.items():
            if isinstance(value, dict):
                value = "\n".join(f"{k}: {v}" for k, v in value.items())
            table.add_row(key, ", ".join(value) if isinstance(value, list) else value)
        console.print(table)
        console.print(f'try: reflow generate "47+38="   (stop with Ctrl-C; endpoints in {endpoints_path})')
        if demo:
            console.print(
                "demo: simulated users are rating answers; watch `reflow experiments list` and "
                "`reflow models list` (a turn of the loop takes a few minutes)"
            )
        while True:
            supervisor.check_alive()
            time.sleep(0.5)
    except Stopped as stop:
        console.print(f"{stop}: stopping")
        return 0
    except RuntimeError as error:
        console.print(f"[red]error:[/] {error}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        supervisor.stop()
        remove_instance(settings)
        endpoints_path.unlink(missing_ok=True)
        console.print("stopped")
