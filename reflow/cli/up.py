"""`reflow up`: prepares the data dir, starts every process on this machine as a child, on
embedded defaults, and stops them all on Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from reflow.cli.common import console, fail, load_settings, open_registry
from reflow.endpoints import API_KEY_FILE, ENDPOINTS_FILE, write_endpoints
from reflow.settings import Settings

if TYPE_CHECKING:
    from feedback.training.bootstrap import BaseModelSpec
    from gateway.tenants import Limits

# `reflow up --demo`: fine-tune every minute, send half the users to a challenger, decide every
# 10 s; users (8 requests and ratings a second, under no quota) ask the task's live traffic (for
# arith, sums over 0-99), where the base model is mostly wrong and learns from their corrections.
DEMO_SETTINGS = {"finetune_interval_s": "60", "ab_traffic": "0.5", "ab_evaluate_s": "10"}
DEMO_SIMULATION = ["--rate", "8", "--duration", "0", "--users", "1000"]
CHAT_TASK = "terse"  # what a chat model's simulated users ask in the demo unless REFLOW_TASK says otherwise


def up(
    data_dir: Annotated[Path | None, typer.Option(help="Data directory [default: ./.reflow].")] = None,
    port: Annotated[int | None, typer.Option(help="Gateway port [default: 50051].")] = None,
    http_port: Annotated[
        int | None, typer.Option(help="OpenAI-compatible HTTP port [default: REFLOW_HTTP_PORT or 8000].")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Workers [default: one per GPU, else 1].")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="REFLOW_API_KEY", help="API key of the default tenant.", show_default=False),
    ] = None,
    demo: Annotated[
        bool, typer.Option("--demo", help="Also run simulated users, on a faster schedule: the loop turns.")
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            help="A registered model NAME, or a checkpoint PATH (a Hugging Face directory or a .gguf "
            "file) to import and serve [default: REFLOW_MODEL_NAME].",
            show_default=False,
        ),
    ] = None,
    gateways: Annotated[
        int,
        typer.Option(
            min=1,
            help="Gateway replicas, on the ports given and the next ones; they share keys and quotas "
            "through REFLOW_REDIS_URL when it is set.",
        ),
    ] = 1,
    max_streams: Annotated[
        int, typer.Option(min=0, help="The default tenant's concurrent streams; 0 = unlimited.")
    ] = 0,
    rpm: Annotated[
        int, typer.Option(min=0, help="The default tenant's requests per minute; 0 = unlimited.")
    ] = 0,
    tpm: Annotated[
        int, typer.Option(min=0, help="The default tenant's tokens per minute; 0 = unlimited.")
    ] = 0,
) -> None:
    """Run everything on this machine with embedded defaults until Ctrl-C or SIGTERM.

    The default tenant is one local user: no quota unless given (the workers' queues still say
    429 when full); tenants made with `reflow tenants create` get 32 streams and 600 rpm."""
    from gateway.tenants import Limits

    settings = load_settings(data_dir=data_dir, gateway_port=port, http_port=http_port, api_key=api_key)
    if model is not None:
        settings = served_model(settings, model)
    count = workers or (cuda_device_count() if settings.device == "auto" else 0) or 1
    limits = Limits(max_streams, rpm, tpm)
    raise typer.Exit(run_up(settings, count, console, demo=demo, n_gateways=gateways, limits=limits))


class Stopped(Exception):
    """Raised in the main thread by SIGINT or SIGTERM, so any step of start-up can be interrupted."""


def _raise_stopped(signum: int, _frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def served_model(settings: Settings, model: str) -> Settings:
    """`--model`: a checkpoint path is imported (once) under a name made from it; a name must be
    registered at REFLOW_MODEL_ALIAS. Ends the command otherwise."""
    from reflow.cli.models import import_checkpoint, name_of

    path, alias = Path(model), settings.model_alias
    if path.exists():
        name = name_of(path)
        version, new = import_checkpoint(settings, path, name, alias)
        console.print(f"{path} is {name} version {version}" + ("" if new else " (imported before)"))
    else:
        name = model
        if not open_registry(settings).has_alias(name, alias):
            fail(
                f"no model {name}@{alias} in the registry and no file {path}; import a checkpoint "
                f"first (reflow models import PATH --name {name}) or pass its path to --model"
            )
    return settings.model_copy(update={"model_name": name})


def resolve_api_key(settings: Settings, console: Console) -> str:
    """The configured key, else the one saved in the data dir, else a new one; saved there 0600."""
    from reflow.api_keys import new_key
    from reflow.private_files import private_file

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


def cuda_device_count() -> int:
    """CUDA devices torch can see (0 on a CPU-only machine)."""
    import torch

    return torch.cuda.device_count()


def base_model_of(settings: Settings) -> BaseModelSpec:
    """The base model an empty registry gets: REFLOW_MODEL_NAME@REFLOW_MODEL_ALIAS, trained on
    REFLOW_TASK with the recipe's defaults but REFLOW_MODEL_PRESET and REFLOW_BOOTSTRAP_STEPS."""
    from feedback.tasks import BUILTIN_MODEL_TASK
    from feedback.training.bootstrap import BaseModelSpec
    from feedback.training.pretrain import PretrainConfig

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


def demo_overrides(settings: Settings) -> dict[str, str]:
    """`reflow up --demo`: a faster turn of the loop, for each setting the user left at its default."""
    return {
        f"REFLOW_{name.upper()}": value for name, value in DEMO_SETTINGS.items()
        if name not in settings.model_fields_set
    }  # fmt: skip


def run_up(
    settings: Settings,
    n_workers: int,
    console: Console,
    demo: bool = False,
    n_gateways: int = 1,
    limits: Limits | None = None,
) -> int:
    """Runs everything on one machine until a signal, the default tenant with `limits` (none by
    default); returns the exit status. With `demo`, the schedule is shortened and simulated users
    send traffic, so the learning loop turns by itself."""
    from feedback.bus.kafka import ensure_topics
    from feedback.tasks import BUILTIN_MODEL_TASK
    from feedback.training.bootstrap import ensure_base_model
    from gateway.auth import announce_key_change
    from gateway.server import redis_config
    from gateway.tenants import UNLIMITED, ensure_tenant
    from reflow.api_keys import hash_key
    from reflow.cgroups import remove_instance
    from reflow.cli.supervisor import Supervisor, wait_http, wait_serving
    from reflow.kafka_settings import KafkaSecurity
    from reflow.private_files import private_dir
    from reflow.redaction import redact_url
    from reflow.registry import Registry
    from reflow.serving import free_port
    from reflow.store.database import migrate, open_engine
    from workers.models.builtin import MODEL_TYPE as BUILTIN
    from workers.models.loader import model_type

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
    signal.signal(signal.SIGINT, _raise_stopped)
    signal.signal(signal.SIGTERM, _raise_stopped)
    private_dir(settings.data_dir)
    endpoints_path = settings.data_dir / ENDPOINTS_FILE
    endpoints_path.unlink(missing_ok=True)
    supervisor = Supervisor(settings)
    # Children get absolute paths, whatever directory they start in.
    env = {"REFLOW_DATA_DIR": str(settings.data_dir.resolve()), "REFLOW_MODEL_NAME": settings.model_name}
    if demo:
        env |= demo_overrides(settings)
    try:
        engine = open_engine(settings.resolved_database_url)
        migrate(engine)
        key = resolve_api_key(settings, console)
        _, retired = ensure_tenant(engine, "default", key, limits or UNLIMITED)
        engine.dispose()
        # replicas of an earlier run may share Redis with this one: the key's limits or the key changed
        announce_key_change(redis_config(settings), hash_key(key), revoked=False)
        if retired is not None:
            announce_key_change(redis_config(settings), retired, revoked=True)
        if n_gateways > 1 and not settings.redis_url:
            console.print(
                f"[yellow]{n_gateways} gateways without REFLOW_REDIS_URL: each has its own quotas[/]"
            )
        registry = Registry.from_settings(settings)
        served = ensure_base_model(base_model_of(settings), registry, console)
        chat = model_type(registry.download(served, settings.model_cache_dir)) != BUILTIN  # a real model
        if demo and not settings.task:  # the simulated users' task, whose oracle the job reports too
            env["REFLOW_TASK"] = CHAT_TASK if chat else BUILTIN_MODEL_TASK

        bootstrap = settings.kafka_bootstrap
        if not bootstrap:
            bootstrap = supervisor.spawn_broker(env)
        ensure_topics(bootstrap, settings.kafka_partitions, security=KafkaSecurity.from_settings(settings))
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
        for child, address in zip(workers, addresses, strict=True):  # a crashed worker comes back there
            supervisor.restart_on_exit(child, "--port", address.rpartition(":")[2])
        replicas = []
        for i in range(n_gateways):  # replica i on the configured ports + i (0 stays "a free one")
            ports = [str(p + i if p else 0) for p in (settings.gateway_port, settings.http_port)]
            name = "gateway" if i == 0 else f"gateway-{i}"
            gateway = supervisor.spawn(
                name,
                ["gateway", "--port", ports[0], "--http-port", ports[1]],
                {**env, "REFLOW_WORKERS": ",".join(addresses)},
            )
            ready[name] = supervisor.wait_ready(gateway)
            replicas.append({"address": ready[name]["address"], "http": ready[name]["http"]})
            wait_serving(ready[name]["address"], ca_file=settings.gateway_ca_file)
        gateway_address = ready["gateway"]["address"]
        if mlflow_url.startswith("http") and not wait_http(f"{mlflow_url}/health"):
            console.print(f"[yellow]the MLflow UI at {redact_url(mlflow_url)} is not answering yet[/]")

        endpoints: dict[str, Any] = {
            "gateway": gateway_address,
            "http": ready["gateway"]["http"],
            "mlflow": mlflow_url,
            "kafka": bootstrap,
            "database": engine.url.render_as_string(hide_password=True),
            "api_key_file": str((settings.data_dir / API_KEY_FILE).resolve()),
            "gateways": replicas,  # every replica; "gateway" and "http" are the first's
            "workers": addresses,
            "metrics": {name: r["metrics"] for name, r in ready.items()},
            "logs": str(supervisor.log_dir.resolve()),
        }
        endpoints = write_endpoints(settings.data_dir, endpoints)  # shown as written: no credentials
        if demo:
            supervisor.spawn("simulate", ["simulate", *DEMO_SIMULATION, "--target", gateway_address], env,
                             ready=False)  # fmt: skip

        table = Table(title="reflow is up", show_header=False)
        for key, value in endpoints.items():
            if isinstance(value, dict):
                value = "\n".join(f"{k}: {v}" for k, v in value.items())
            if key == "gateways":  # a row only when there is more than the one above
                if len(value) < 2:
                    continue
                value = [f"{r['address']} + {r['http']}" for r in value]
            table.add_row(key, ", ".join(value) if isinstance(value, list) else value)
        console.print(table)
        example = (
            f'reflow generate --model {settings.model_name} --chat "What is the capital of France?"'
            if chat
            else 'reflow generate "47+38="'
        )
        ca = f" --ca-file {settings.gateway_ca_file}" if settings.gateway_tls else ""
        console.print(f"try: {example}{ca}   (stop with Ctrl-C; endpoints in {endpoints_path})")
        base_url, key_file = f"{endpoints['http']}/v1", endpoints["api_key_file"]
        trust = f", trusting the CA in {settings.gateway_ca_file}" if settings.gateway_tls else ""
        console.print(f"or any OpenAI client: base_url {base_url}, API key in {key_file}{trust}")
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
        if settings.isolation != "none":
            remove_instance(settings.data_dir)
        endpoints_path.unlink(missing_ok=True)
        console.print("stopped")
