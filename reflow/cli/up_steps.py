"""The steps of `reflow up`, in the order `run_up` takes them: refuse settings that cannot work,
migrate the store, give the default tenant its key, make sure the registry serves a model, then start
Kafka, the feedback pipeline, MLflow, the workers and the gateways as children, write and show the
endpoints, and watch the children until a signal stops them all."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from sqlalchemy import Engine

from feedback.tasks import BUILTIN_MODEL_TASK
from feedback.training.bootstrap import BaseModelSpec, ensure_base_model
from feedback.training.pretrain import PretrainConfig
from gateway.auth import announce_key_change
from gateway.server import redis_config
from gateway.tenants import UNLIMITED, Limits, ensure_tenant
from reflow.api_keys import hash_key, new_key
from reflow.cgroups import remove_instance
from reflow.cli.common import console as default_console
from reflow.cli.common import create_topics, fail, open_registry, store_db
from reflow.cli.models import import_checkpoint, name_of
from reflow.cli.supervisor import Child, ChildFailed, Supervisor, wait_http, wait_serving
from reflow.endpoints import API_KEY_FILE, ENDPOINTS_FILE, write_endpoints
from reflow.kafka_settings import KafkaSecurity
from reflow.private_files import private_dir, private_file
from reflow.redaction import redact_url
from reflow.serving import free_port
from reflow.settings import Settings
from reflow.store.database import migrate
from workers.models.builtin import MODEL_TYPE as BUILTIN
from workers.models.loader import model_type, resolve_device

# `reflow up --demo`: fine-tune every minute, send half the users to a challenger, decide every
# 10 s; users (8 requests and ratings a second, under no quota) ask the task's live traffic (for
# arith, sums over 0-99), where the base model is mostly wrong and learns from their corrections.
DEMO_SETTINGS = {"finetune_interval_s": "60", "ab_traffic": "0.5", "ab_evaluate_s": "10"}
DEMO_SIMULATION = ["--rate", "8", "--duration", "0", "--users", "1000"]
CHAT_TASK = "terse"  # what a chat model's simulated users ask in the demo unless REFLOW_TASK says otherwise
Ready = dict[str, dict[str, str]]  # what each child wrote to its ready file (address, metrics), by name


def run_up(
    settings: Settings,
    n_workers: int,
    console: Console = default_console,
    demo: bool = False,
    n_gateways: int = 1,
    limits: Limits = UNLIMITED,
) -> None:
    """Runs everything on one machine until a signal, the default tenant with `limits`. With `demo`,
    the schedule is shortened and simulated users send traffic, so the learning loop turns by
    itself. A child that exits (and may not restart) or never gets ready ends it, exit status 1."""
    check_settings(settings)
    stop_on_signals()
    private_dir(settings.data_dir)
    (settings.data_dir / ENDPOINTS_FILE).unlink(missing_ok=True)  # until this run writes its own
    supervisor = Supervisor(settings)
    try:
        store = migrated_store(settings)
        add_default_tenant(settings, store, resolve_api_key(settings, console), limits)
        warn_unshared_quotas(settings, n_gateways, console)
        chat = ensure_model(settings, console)
        env = children_env(settings, demo, chat)
        env["REFLOW_KAFKA_BOOTSTRAP"] = kafka = start_kafka(supervisor, settings, env)
        consumer = start_pipeline(supervisor, env)
        mlflow = start_mlflow(supervisor, settings, env)
        workers = start_workers(supervisor, settings, n_workers, env, console)
        supervisor.wait_ready(consumer)
        gateways = start_gateways(supervisor, settings, n_gateways, env, workers)
        check_mlflow_ui(mlflow, console)
        started = endpoints_of(
            settings, store=store, kafka=kafka, mlflow=mlflow, workers=workers, gateways=gateways,
            logs=supervisor.log_dir,
        )  # fmt: skip
        endpoints = write_endpoints(settings.data_dir, started)  # shown as written: no credentials
        if demo:
            start_simulation(supervisor, env, endpoints["gateway"])
        show_endpoints(console, endpoints, settings, chat=chat, demo=demo)
        watch(supervisor)
    except Stopped as stop:
        console.print(f"{stop}: stopping")
    except ChildFailed as error:
        fail(error)
    finally:
        stop_everything(supervisor, settings, console)


class Stopped(Exception):
    """Raised in the main thread by SIGINT or SIGTERM, so any step of start-up can be interrupted."""


def _raise_stopped(signum: int, _frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def served_model(settings: Settings, model: str) -> Settings:
    """`--model`: a checkpoint path is imported (once) under a name made from it; a name must be
    registered at REFLOW_MODEL_ALIAS. Ends the command otherwise."""
    path, alias = Path(model), settings.model_alias
    if path.exists():
        name = name_of(path)
        version, new = import_checkpoint(settings, path, name, alias)
        default_console.print(f"{path} is {name} version {version}" + ("" if new else " (imported before)"))
    else:
        name = model
        if not open_registry(settings).has_alias(name, alias):
            fail(
                f"no model {name}@{alias} in the registry and no file {path}; import a checkpoint "
                f"first (reflow models import PATH --name {name}) or pass its path to --model"
            )
    return settings.model_copy(update={"model_name": name})


def gpus(settings: Settings) -> int:
    """The CUDA devices workers spread over: every one torch sees when REFLOW_DEVICE is auto, else none."""
    return torch.cuda.device_count() if settings.device == "auto" else 0


def check_settings(settings: Settings) -> None:
    """Refuses, before anything is made, settings `reflow up` cannot work with; exit status 2."""
    if settings.gateway_tls and not settings.gateway_ca_file:
        # up's own calls to the gateway (its health check; --demo's users, who inherit the
        # variable) verify its certificate, and which CA signed it is not up's to guess
        fail(
            "the gateway serves TLS: set REFLOW_GATEWAY_CA_FILE to the CA certificate that signed "
            "REFLOW_GATEWAY_TLS_CERT_FILE (the certificate itself when self-signed)",
            2,
        )
    if settings.kafka_security_protocol != "PLAINTEXT" and not settings.kafka_bootstrap:
        # the embedded broker speaks neither TLS nor SASL: the children would never reach it
        fail(
            f"REFLOW_KAFKA_SECURITY_PROTOCOL={settings.kafka_security_protocol} needs your own brokers: "
            "set REFLOW_KAFKA_BOOTSTRAP, or leave the protocol PLAINTEXT for the embedded broker",
            2,
        )
    try:
        resolve_device(settings.device)
    except RuntimeError as error:  # a device torch cannot see: the base model and the workers need it
        fail(error, 2)


def stop_on_signals() -> None:
    """From now on, SIGINT and SIGTERM raise Stopped in the main thread, whatever step it is in."""
    signal.signal(signal.SIGINT, _raise_stopped)
    signal.signal(signal.SIGTERM, _raise_stopped)


def migrated_store(settings: Settings) -> Engine:
    """The store, brought to the newest schema (as `reflow db upgrade` does)."""
    db = store_db(settings)
    migrate(db)
    return db


def resolve_api_key(settings: Settings, console: Console) -> str:
    """The configured key, else the one saved in the data dir, else a new one; saved there 0600."""
    path = settings.data_dir / API_KEY_FILE
    if settings.api_key is not None:
        key = settings.api_key.get_secret_value()
    elif path.is_file():
        key = path.read_text().strip()
    else:
        key = new_key()
        console.print(f"new API key for tenant [bold]default[/]: {key}", markup=True, highlight=False)
    private_file(path).write_text(key + "\n")  # also when an older file was readable by others
    return key


def add_default_tenant(settings: Settings, store: Engine, key: str, limits: Limits) -> None:
    """The tenant `default` holding `key` with `limits`; replicas of an earlier run may share Redis
    with this one, so they are told that the key (or its limits) changed, and that a key it
    replaced is revoked. A key it cannot hold (revoked, too short) ends the command, exit status 2."""
    try:
        _, retired = ensure_tenant(store, "default", key, limits)
    except ValueError as error:
        fail(error, 2)
    finally:
        store.dispose()
    announce_key_change(redis_config(settings), hash_key(key), revoked=False)
    if retired is not None:
        announce_key_change(redis_config(settings), retired, revoked=True)


def warn_unshared_quotas(settings: Settings, n_gateways: int, console: Console) -> None:
    """Says so when gateway replicas have no Redis to share quotas through."""
    if n_gateways > 1 and not settings.redis_url:
        console.print(f"[yellow]{n_gateways} gateways without REFLOW_REDIS_URL: each has its own quotas[/]")


def ensure_model(settings: Settings, console: Console) -> bool:
    """The served model, trained and registered first when the registry has none (the demo base
    model); whether it is a chat model (a real one) rather than the built-in one."""
    registry = open_registry(settings)
    served = ensure_base_model(base_model_of(settings), registry, console)
    return model_type(registry.download(served, settings.model_cache_dir)) != BUILTIN


def base_model_of(settings: Settings) -> BaseModelSpec:
    """The base model an empty registry gets: REFLOW_MODEL_NAME@REFLOW_MODEL_ALIAS, trained on
    REFLOW_TASK with the recipe's defaults but REFLOW_MODEL_PRESET and REFLOW_BOOTSTRAP_STEPS."""
    recipe = replace(PretrainConfig(), preset=settings.model_preset)
    if settings.bootstrap_steps:
        recipe = replace(recipe, steps=settings.bootstrap_steps)
    return BaseModelSpec(
        settings.model_name,
        settings.model_alias,
        settings.task or BUILTIN_MODEL_TASK,
        recipe,
        settings.device,
        tuple(settings.variants),
    )


def children_env(settings: Settings, demo: bool, chat: bool) -> dict[str, str]:
    """What every child gets on top of this environment: absolute paths (whatever directory it starts
    in) and the served model; with `demo`, a faster schedule and the simulated users' task (whose
    oracle the fine-tune job reports too)."""
    env = {"REFLOW_DATA_DIR": str(settings.data_dir.resolve()), "REFLOW_MODEL_NAME": settings.model_name}
    if demo:
        env |= demo_overrides(settings)
        if not settings.task:
            env["REFLOW_TASK"] = CHAT_TASK if chat else BUILTIN_MODEL_TASK
    return env


def demo_overrides(settings: Settings) -> dict[str, str]:
    """`reflow up --demo`: a faster turn of the loop, for each setting the user left at its default."""
    return {
        f"REFLOW_{name.upper()}": value for name, value in DEMO_SETTINGS.items()
        if name not in settings.model_fields_set
    }  # fmt: skip


def start_kafka(supervisor: Supervisor, settings: Settings, env: dict[str, str]) -> str:
    """REFLOW_KAFKA_BOOTSTRAP, else an embedded broker started as a child, with reflow's topics."""
    bootstrap = settings.kafka_bootstrap or supervisor.spawn_broker(env)
    create_topics(settings, bootstrap, KafkaSecurity.from_settings(settings))
    return bootstrap


def start_pipeline(supervisor: Supervisor, env: dict[str, str]) -> Child:
    """The consumer, to wait for (stopped after the gateways, as children stop newest first, so it
    stores their last events), and the scheduler, which fine-tunes from new feedback."""
    consumer = supervisor.spawn("consumer", ["feedback", "consume"], env)
    supervisor.spawn("scheduler", ["scheduler"], env, ready=False)
    return consumer


def start_mlflow(supervisor: Supervisor, settings: Settings, env: dict[str, str]) -> str:
    """REFLOW_MLFLOW_TRACKING_URI, else the URL of the MLflow UI a child serves over the embedded store."""
    if settings.mlflow_tracking_uri:
        return settings.mlflow_tracking_uri
    port = settings.mlflow_ui_port or free_port()
    supervisor.spawn(
        "mlflow",
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", settings.resolved_tracking_uri,
         "--default-artifact-root", str(settings.resolved_artifact_root), "--workers", "1"],
        {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # the UI only; no job runners
        ready=False,
    )  # fmt: skip
    return f"http://127.0.0.1:{port}"


def start_workers(
    supervisor: Supervisor, settings: Settings, n_workers: int, env: dict[str, str], console: Console
) -> Ready:
    """`n_workers` workers, spread over the GPUs; once each has loaded the model, one that exits is
    started again on the address it had."""
    devices = gpus(settings)
    workers = [
        supervisor.spawn(f"worker-{i}", ["worker"], worker_env(env, i, devices)) for i in range(n_workers)
    ]
    with console.status("loading the model in the workers"):
        ready = {child.name: supervisor.wait_ready(child) for child in workers}
    for child in workers:
        supervisor.restart_on_exit(child, "--port", ready[child.name]["address"].rpartition(":")[2])
    return ready


def worker_env(env: dict[str, str], i: int, gpus: int) -> dict[str, str]:
    """Worker `i`'s environment: on GPU i modulo `gpus` where there are any."""
    return {**env, "REFLOW_DEVICE": f"cuda:{i % gpus}"} if gpus else env


def start_gateways(
    supervisor: Supervisor, settings: Settings, n_gateways: int, env: dict[str, str], workers: Ready
) -> Ready:
    """`n_gateways` replicas in front of `workers`, each serving before the next starts."""
    addresses = ",".join(r["address"] for r in workers.values())
    ready = {}
    for i in range(n_gateways):
        name = "gateway" if i == 0 else f"gateway-{i}"
        grpc_port, http_port = replica_ports(settings, i)
        gateway = supervisor.spawn(
            name, ["gateway", "--port", grpc_port, "--http-port", http_port],
            {**env, "REFLOW_WORKERS": addresses},
        )  # fmt: skip
        ready[name] = supervisor.wait_ready(gateway)
        wait_serving(ready[name]["address"], ca_file=settings.gateway_ca_file)
    return ready


def replica_ports(settings: Settings, i: int) -> tuple[str, str]:
    """Gateway replica `i`'s gRPC and HTTP ports: the configured ones + i (0 stays "a free one")."""
    grpc_port, http_port = (str(p + i if p else 0) for p in (settings.gateway_port, settings.http_port))
    return grpc_port, http_port


def check_mlflow_ui(url: str, console: Console) -> None:
    """Says so when the MLflow UI at `url` does not answer within a minute (it keeps starting)."""
    if url.startswith("http") and not wait_http(f"{url}/health"):
        console.print(f"[yellow]the MLflow UI at {redact_url(url)} is not answering yet[/]")


def endpoints_of(
    settings: Settings, *, store: Engine, kafka: str, mlflow: str, workers: Ready, gateways: Ready, logs: Path
) -> dict[str, Any]:
    """What endpoints.json lists: the first gateway's addresses, every replica's and worker's, each
    process's metrics, and where the store, Kafka, MLflow, the API key and the logs are."""
    first = gateways["gateway"]
    return {
        "gateway": first["address"],
        "http": first["http"],
        "mlflow": mlflow,
        "kafka": kafka,
        "database": store.url.render_as_string(hide_password=True),
        "api_key_file": str((settings.data_dir / API_KEY_FILE).resolve()),
        "gateways": [{"address": r["address"], "http": r["http"]} for r in gateways.values()],
        "workers": [r["address"] for r in workers.values()],
        "metrics": {name: r["metrics"] for name, r in (workers | gateways).items()},
        "logs": str(logs.resolve()),
    }


def start_simulation(supervisor: Supervisor, env: dict[str, str], gateway: str) -> None:
    """`--demo`'s simulated users, asking `gateway` until stopped."""
    supervisor.spawn("simulate", ["simulate", *DEMO_SIMULATION, "--target", gateway], env, ready=False)


def show_endpoints(
    console: Console, endpoints: dict[str, Any], settings: Settings, *, chat: bool, demo: bool
) -> None:
    """The endpoints as a table, then how to try them."""
    table = Table(title="reflow is up", show_header=False)
    for key, value in endpoint_rows(endpoints):
        table.add_row(key, value)
    console.print(table)
    for line in how_to_try(endpoints, settings, chat=chat, demo=demo):
        console.print(line)


def endpoint_rows(endpoints: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's rows: one per endpoint, a dict's items on lines of their own, and the replicas'
    row only when there is more than the one of the first rows."""
    rows = []
    for key, value in endpoints.items():
        if isinstance(value, dict):
            value = "\n".join(f"{k}: {v}" for k, v in value.items())
        if key == "gateways":
            if len(value) < 2:
                continue
            value = [f"{r['address']} + {r['http']}" for r in value]
        rows.append((key, ", ".join(value) if isinstance(value, list) else value))
    return rows


def how_to_try(endpoints: dict[str, Any], settings: Settings, *, chat: bool, demo: bool) -> list[str]:
    """A `reflow generate` to run and what an OpenAI client needs (with the CA when the gateway
    serves TLS); with `demo`, what to watch."""
    example = (
        f'reflow generate --model {settings.model_name} --chat "What is the capital of France?"'
        if chat
        else 'reflow generate "47+38="'
    )
    ca = f" --ca-file {settings.gateway_ca_file}" if settings.gateway_tls else ""
    path = settings.data_dir / ENDPOINTS_FILE
    base_url, key_file = f"{endpoints['http']}/v1", endpoints["api_key_file"]
    trust = f", trusting the CA in {settings.gateway_ca_file}" if settings.gateway_tls else ""
    lines = [
        f"try: {example}{ca}   (stop with Ctrl-C; endpoints in {path})",
        f"or any OpenAI client: base_url {base_url}, API key in {key_file}{trust}",
    ]
    if demo:
        lines.append(
            "demo: simulated users are rating answers; watch `reflow experiments list` and "
            "`reflow models list` (a turn of the loop takes a few minutes)"
        )
    return lines


def watch(supervisor: Supervisor) -> None:
    """Watches the children until a signal: a worker that exits is started again; RuntimeError when
    another child exits."""
    while True:
        supervisor.check_alive()
        time.sleep(0.5)


def stop_everything(supervisor: Supervisor, settings: Settings, console: Console) -> None:
    """Stops the children, newest first, deaf to further signals meanwhile; removes the workers'
    isolation instance and endpoints.json."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    supervisor.stop()
    if settings.isolation != "none":
        remove_instance(settings.data_dir)
    (settings.data_dir / ENDPOINTS_FILE).unlink(missing_ok=True)
    console.print("stopped")
