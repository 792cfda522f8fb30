"""The `reflow` command line: run the processes, manage tenants and the store, stream completions."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from reflow.settings import Settings

app = typer.Typer(
    help="reflow: a streaming inference gateway that learns from its users.", no_args_is_help=True
)
tenants_app = typer.Typer(help="Manage tenants and their API keys.", no_args_is_help=True)
db_app = typer.Typer(help="Manage the store's schema.", no_args_is_help=True)
feedback_app = typer.Typer(
    help="The feedback pipeline: consume it into the store, ingest files, inspect it.", no_args_is_help=True
)
app.add_typer(tenants_app, name="tenants")
app.add_typer(db_app, name="db")
app.add_typer(feedback_app, name="feedback")
finetune_app = typer.Typer(help="Fine-tune the champion on new feedback.", no_args_is_help=True)
app.add_typer(finetune_app, name="finetune")
models_app = typer.Typer(help="Registered model versions and their aliases.", no_args_is_help=True)
app.add_typer(models_app, name="models")
experiments_app = typer.Typer(help="A/B experiments of challengers against champions.", no_args_is_help=True)
app.add_typer(experiments_app, name="experiments")
workers_app = typer.Typer(help="The running workers.", no_args_is_help=True)
app.add_typer(workers_app, name="workers")
console = Console()
err_console = Console(stderr=True)

SHOWN_EVALUATIONS = 20  # `experiments show` lists the latest ones; `report` plots them all
ReadyFile = Annotated[
    Path | None, typer.Option(help="Write {'address': ...} here once serving (used by `reflow up`).")
]


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment and REFLOW_CONFIG, with command-line options on top."""
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # kafka-python logs every failed connection attempt, each second of an outage; reflow logs
    # what they mean instead (records going to the outbox, a batch the store refused).
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    return settings


@app.command()
def up(
    data_dir: Annotated[Path | None, typer.Option(help="Data directory [default: ./.reflow].")] = None,
    port: Annotated[int | None, typer.Option(help="Gateway port [default: 50051].")] = None,
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
) -> None:
    """Run everything on this machine with embedded defaults until Ctrl-C or SIGTERM."""
    from reflow.supervisor import cuda_device_count, run_up

    settings = load_settings(data_dir=data_dir, gateway_port=port, api_key=api_key)
    count = workers or (cuda_device_count() if settings.device == "auto" else 0) or 1
    raise typer.Exit(run_up(settings, count, console, demo=demo))


def _serve(server: Coroutine[Any, Any, None]) -> None:
    """Runs a server until it stops; a configuration problem is one line on stderr, exit status 2."""
    from reflow.errors import ReflowError

    try:
        asyncio.run(server)
    except ReflowError as error:
        err_console.print(f"[red]error:[/] {error}", highlight=False)
        raise typer.Exit(2) from None


@app.command()
def gateway(
    port: Annotated[int | None, typer.Option(help="Port [default: REFLOW_GATEWAY_PORT or 50051].")] = None,
    ready_file: ReadyFile = None,
) -> None:
    """Serve the public Inference API, routing to REFLOW_WORKERS."""
    from gateway.server import serve

    _serve(serve(load_settings(gateway_port=port), ready_file=ready_file))


@app.command()
def worker(
    version: Annotated[str, typer.Option(help="Load this version instead of REFLOW_MODEL_ALIAS.")] = "",
    port: Annotated[int | None, typer.Option(help="Port [default: REFLOW_WORKER_PORT, 0 = free].")] = None,
    ready_file: ReadyFile = None,
) -> None:
    """Serve the internal Worker API for REFLOW_MODEL_NAME on REFLOW_DEVICE."""
    from workers.server import serve

    _serve(serve(load_settings(worker_port=port), version=version, ready_file=ready_file))


def _default_target(settings: Settings) -> str:
    from reflow.supervisor import read_endpoints

    endpoints = read_endpoints(settings.data_dir)
    return endpoints["gateway"] if endpoints else f"{settings.gateway_host}:{settings.gateway_port}"


def _default_api_key(settings: Settings) -> str:
    if settings.api_key is not None:
        return settings.api_key.get_secret_value()
    key_file = settings.data_dir / "api_key"
    if key_file.is_file():
        return key_file.read_text().strip()
    err_console.print("[red]no API key:[/] pass --api-key, set REFLOW_API_KEY, or run `reflow up` first")
    raise typer.Exit(2)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help='The prompt, e.g. "47+38=".')],
    model: Annotated[str, typer.Option(help="NAME, NAME@ALIAS or NAME/VERSION.")] = "",
    max_tokens: Annotated[int, typer.Option(min=0, help="0 = server default.")] = 0,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="0 = off.")] = 0.0,
    top_k: Annotated[int, typer.Option(min=0, help="0 = off.")] = 0,
    seed: Annotated[int, typer.Option(min=0, help="0 = random.")] = 0,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    reasoning_budget: Annotated[int, typer.Option(min=0, help="Most thinking tokens; 0 = no own cap.")] = 0,
    target: Annotated[
        str | None, typer.Option(help="Gateway host:port [default: from endpoints.json].")
    ] = None,
    api_key: Annotated[str | None, typer.Option(envvar="REFLOW_API_KEY", show_default=False)] = None,
) -> None:
    """Stream a completion to the terminal: reasoning dimmed, then the answer and usage."""
    import grpc

    from reflow.client import Client
    from reflow.v1 import inference_pb2

    settings = Settings(**({"api_key": api_key} if api_key else {}))
    sampling = inference_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop or []
    )
    last = None
    thinking = False  # the answer starts on a line of its own after the thought
    try:
        with Client(target or _default_target(settings), _default_api_key(settings)) as client:
            for message in client.generate(
                prompt, model=model, sampling=sampling, reasoning_budget=reasoning_budget
            ):
                if message.reasoning_text:
                    thinking = True
                    console.print(
                        message.reasoning_text, style="dim", end="", soft_wrap=True, highlight=False
                    )
                if message.text:
                    if thinking:
                        console.print()
                        thinking = False
                    console.print(message.text, end="", soft_wrap=True, highlight=False, markup=False)
                last = message if message.finish_reason else last
    except grpc.RpcError as error:
        err_console.print(f"\n[red]{error.code().name}:[/] {error.details()}")
        raise typer.Exit(1) from None
    console.print()
    console.file.flush()  # the usage line goes to stderr: keep the order when both are piped
    if last is not None:
        u = last.usage
        reason = inference_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        err_console.print(
            f"[dim]{reason} · {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens "
            f"({u.reasoning_tokens} reasoning) · first token {u.time_to_first_token_ms:.1f} ms · "
            f"total {u.total_ms:.1f} ms[/]",
            soft_wrap=True,
        )


def _engine() -> Any:
    from feedback.store import open_engine

    return open_engine(load_settings().resolved_database_url)


@tenants_app.command("create")
def tenants_create(
    name: str,
    max_streams: Annotated[int, typer.Option(help="Concurrent streams per gateway.")] = 32,
    rpm: Annotated[int, typer.Option(help="Requests per minute per gateway; 0 = unlimited.")] = 600,
) -> None:
    """Create a tenant and print its new API key (shown only once; stored hashed)."""
    from feedback.store import migrate
    from gateway.tenants import create_tenant

    engine = _engine()
    migrate(engine)
    try:
        _, key = create_tenant(engine, name, max_concurrent_streams=max_streams, requests_per_minute=rpm)
    except ValueError as error:
        err_console.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    print(key)


@tenants_app.command("revoke")
def tenants_revoke(name: str) -> None:
    """Disable a tenant's key (gateways notice within REFLOW_AUTH_CACHE_TTL_S)."""
    from gateway.tenants import revoke_tenant

    if not revoke_tenant(_engine(), name):
        err_console.print(f"[red]error:[/] no active tenant named {name!r}")
        raise typer.Exit(1)


@tenants_app.command("list")
def tenants_list() -> None:
    """List tenants with their key prefix, quotas and state."""
    from gateway.tenants import list_tenants

    for info, prefix, revoked in list_tenants(_engine()):
        state = "revoked" if revoked else "active"
        quotas = f"{info.max_concurrent_streams} streams\t{info.requests_per_minute} rpm"
        print(f"{info.name}\t{prefix}…\t{quotas}\t{state}")


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Bring the store's schema up to REVISION (default: the newest)."""
    from feedback.store import migrate

    migrate(_engine(), revision)


@db_app.command("downgrade")
def db_downgrade(revision: str) -> None:
    """Take the store's schema back to REVISION ("base" drops every table)."""
    from feedback.store import downgrade

    downgrade(_engine(), revision)


def _current_engine(settings: Settings) -> Any:
    """The store, refusing one whose schema is out of date."""
    from feedback.store import open_engine, require_current_schema

    engine = open_engine(settings.resolved_database_url)
    try:
        require_current_schema(engine)
    except RuntimeError as error:
        err_console.print(f"[red]error:[/] {error}")
        raise typer.Exit(2) from None
    return engine


def _bootstrap(settings: Settings) -> str:
    from feedback.kafka import resolve_bootstrap
    from reflow.errors import Unavailable

    try:
        return resolve_bootstrap(settings)
    except Unavailable as error:
        err_console.print(f"[red]error:[/] {error}")
        raise typer.Exit(2) from None


@feedback_app.command("consume")
def feedback_consume(ready_file: ReadyFile = None) -> None:
    """Write inference events and feedback from Kafka to the store, until Ctrl-C or SIGTERM."""
    import signal
    import threading

    from kafka.errors import KafkaError

    from feedback.consumer import consume
    from feedback.kafka import ensure_topics
    from reflow.serving import write_ready_file

    settings = load_settings()
    engine = _current_engine(settings)
    bootstrap = _bootstrap(settings)
    try:
        ensure_topics(bootstrap, settings.kafka_partitions)
    except KafkaError as error:
        err_console.print(f"[red]error:[/] cannot reach Kafka at {bootstrap}: {error}", highlight=False)
        raise typer.Exit(2) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    write_ready_file(ready_file, kafka=bootstrap)
    consume(bootstrap, engine, settings.consumer_batch_size, stop, drain_s=settings.shutdown_grace_s)


@feedback_app.command("ingest")
def feedback_ingest(
    file: Annotated[str, typer.Argument(help="JSONL file of Feedback objects, or - for stdin.")],
    tenant: Annotated[str, typer.Option(help="The tenant whose completions are rated.")] = "default",
) -> None:
    """Publish feedback from a JSONL file; a bad line is reported with its number and skipped."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from feedback.ingest import ingest
    from feedback.publisher import Publisher
    from gateway.request_ids import RequestIds
    from gateway.tenants import list_tenants

    settings = load_settings()
    engine = _current_engine(settings)
    if not any(info.name == tenant and not revoked for info, _, revoked in list_tenants(engine)):
        err_console.print(f"[red]error:[/] no active tenant named {tenant!r} (see `reflow tenants list`)")
        raise typer.Exit(2)
    source = sys.stdin if file == "-" else Path(file).open(encoding="utf-8")  # noqa: SIM115
    total = None if file == "-" else Path(file).stat().st_size
    publisher = Publisher(_bootstrap(settings), settings.outbox_path, settings.kafka_handover_timeout_s)
    columns = (TextColumn("ingesting"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    try:
        with source, Progress(*columns, console=err_console) as progress:
            task = progress.add_task("ingest", total=total)
            report = ingest(
                source, tenant, RequestIds.from_store(engine), publisher, lambda n: progress.advance(task, n)
            )
    finally:
        waiting = publisher.close()
    for number, reason in report.rejected:
        err_console.print(f"line {number}: {reason}", highlight=False, markup=False, soft_wrap=True)
    note = (
        f" ({waiting} wait in the outbox for Kafka: a gateway on this data dir sends them)" if waiting else ""
    )
    err_console.print(f"accepted {report.accepted}{note}, rejected {len(report.rejected)}")
    if report.rejected:
        raise typer.Exit(1)


@feedback_app.command("stats")
def feedback_stats(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Counts of stored inferences and feedback, joined feedback, DLQ records and consumer lag."""
    from kafka.errors import KafkaError

    from feedback.kafka import resolve_bootstrap
    from feedback.stats import kafka_stats, store_counts
    from reflow.errors import Unavailable

    settings = load_settings()
    stats: dict[str, Any] = store_counts(_current_engine(settings))
    try:
        stats.update(kafka_stats(resolve_bootstrap(settings)))
    except (KafkaError, Unavailable) as error:  # the store's counts are still worth showing
        stats.update(dlq_messages=None, consumer_lag=None, kafka_error=str(error))
    if as_json:
        print(json.dumps(stats))
        return
    for key, value in stats.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
        print(f"{key}\t{value}")


@app.command()
def scheduler() -> None:
    """Run the scheduled jobs (fine-tune, evaluate experiments) until Ctrl-C or SIGTERM; their
    schedule is kept in the store."""
    import signal
    import threading

    from feedback.scheduler import run_scheduler

    settings = load_settings()
    # two lines per run of every job, every few seconds: the jobs log what they did instead
    logging.getLogger("apscheduler.executors.default").setLevel(logging.WARNING)
    engine = _current_engine(settings)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    run_scheduler(settings, engine, stop)


@finetune_app.command("run")
def finetune_run(
    model: Annotated[str | None, typer.Option(help="Registered model [default: REFLOW_MODEL_NAME].")] = None,
) -> None:
    """Fine-tune now, in the foreground, on the labelled feedback that arrived since the last run."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from feedback.jobs import run_finetune

    settings = load_settings()
    engine = _current_engine(settings)
    registry = _registry(settings)
    columns = (
        TextColumn("[bold]fine-tuning"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, console=err_console) as progress:
        task = progress.add_task("finetune", total=settings.finetune_steps, loss=float("nan"))
        outcome = run_finetune(
            settings, engine, registry, model=model, min_samples=1,
            progress=lambda step, _total, loss: progress.update(task, completed=step, loss=loss),
        )  # fmt: skip
    err_console.print(f"{outcome.status}: {outcome.message}", highlight=False, soft_wrap=True)
    if outcome.version:
        print(f"registered version {outcome.version} as @challenger")
    if outcome.metrics:
        for key in ("held_out_accuracy", "regression_accuracy", "wide_range_accuracy"):
            print(f"{key}\tchampion {outcome.metrics[f'champion_{key}']:.1%}"
                  f"\tcandidate {outcome.metrics[f'candidate_{key}']:.1%}")  # fmt: skip
    if outcome.status in ("failed", "skipped"):
        raise typer.Exit(1)


@app.command()
def simulate(
    rate: Annotated[float, typer.Option(min=0.01, help="Requests per second.")] = 5.0,
    duration: Annotated[float, typer.Option(min=0.0, help="Seconds to run; 0 = until stopped.")] = 60.0,
    lo: Annotated[int, typer.Option(min=0, help="Smallest operand.")] = 0,
    hi: Annotated[int, typer.Option(min=0, help="Largest operand.")] = 99,
    users: Annotated[int, typer.Option(min=1, help="Distinct simulated users.")] = 500,
    seed: Annotated[int, typer.Option(help="Seed of the operands and users.")] = 0,
    target: Annotated[
        str | None, typer.Option(help="Gateway host:port [default: from endpoints.json].")
    ] = None,
    api_key: Annotated[str | None, typer.Option(envvar="REFLOW_API_KEY", show_default=False)] = None,
) -> None:
    """Simulated users: `arith` prompts through the gateway, each answer rated by the oracle."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from feedback.simulate import simulate as run_simulation

    if lo > hi:
        err_console.print(f"[red]error:[/] --lo {lo} is above --hi {hi}")
        raise typer.Exit(2)
    settings = Settings(**({"api_key": api_key} if api_key else {}))
    columns = (
        TextColumn("[bold]simulating"), BarColumn(), TextColumn("{task.completed}/{task.total} requests"),
        TextColumn("accuracy {task.fields[accuracy]:.1%}"), TimeElapsedColumn(),
    )  # fmt: skip
    with Progress(*columns, console=err_console) as progress:
        task = progress.add_task("simulate", total=int(rate * duration) or None, accuracy=0.0)
        report = asyncio.run(
            run_simulation(
                target or _default_target(settings), _default_api_key(settings), rate=rate,
                duration_s=duration, lo=lo, hi=hi, users=users, seed=seed,
                on_request=lambda r: progress.update(task, completed=r.finished, accuracy=r.accuracy),
            )
        )  # fmt: skip
    print(f"requests {report.requests}, accuracy {report.accuracy:.1%}, rated {report.rated}")
    for version, (right, answered) in sorted(report.by_version.items()):
        print(f"version {version}: {right}/{answered} right ({right / answered:.1%})")
    failures = {**report.errors, **report.feedback_errors}
    if failures:
        print("errors: " + ", ".join(f"{code} {n}" for code, n in sorted(failures.items())))
        raise typer.Exit(1)


def _registry(settings: Settings) -> Any:
    from feedback.registry import Registry

    return Registry.from_settings(settings)


@models_app.command("list")
def models_list(
    name: Annotated[str | None, typer.Argument(help="Registered model [default: REFLOW_MODEL_NAME].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON array.")] = False,
) -> None:
    """Versions of a registered model, newest first, with their aliases and where they came from."""
    settings = load_settings()
    try:
        versions = _registry(settings).versions(name or settings.model_name)
    except LookupError as error:
        err_console.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(versions))
        return
    for v in versions:
        tags = v["tags"]
        origin = tags.get("reflow.source", "") + (
            f" from v{tags['reflow.parent_version']}" if "reflow.parent_version" in tags else ""
        )
        print(f"{v['version']}\t{','.join(v['aliases']) or '-'}\t{origin or '-'}\t{v['run_id'] or '-'}")


def _follow_aliases(settings: Settings, registry: Any, name: str) -> None:
    """After a move by hand: ends the experiment on the old aliases (opening one when a challenger
    remains) and tells the running workers to follow now; they poll anyway."""
    from feedback.experiments import reconcile
    from feedback.promotion import push_to_workers
    from feedback.store import open_engine, require_current_schema

    engine = open_engine(settings.resolved_database_url)
    try:
        require_current_schema(engine)
        reconcile(engine, registry, name, settings.ab_traffic)
    except Exception as error:  # the aliases moved all the same; the scheduler catches up
        err_console.print(
            f"[yellow]experiments not updated ({error}); the scheduler's next evaluation will[/]"
        )
    finally:
        engine.dispose()

    pushed = push_to_workers(settings)
    failed = {a: why for a, why in pushed.items() if why != "ok"}
    for address, why in failed.items():
        err_console.print(f"[yellow]worker {address} did not answer ({why}); it follows within "
                          f"REFLOW_REGISTRY_POLL_S={settings.registry_poll_s:g}s[/]")  # fmt: skip
    if pushed and not failed:
        print(f"{len(pushed)} worker(s) now follow it")


@models_app.command("promote")
def models_promote(name: str, version: str) -> None:
    """Make VERSION the champion (no longer the challenger); the workers follow at once."""
    from feedback.promotion import promote

    settings = load_settings()
    registry = _registry(settings)
    try:
        promote(registry, name, version)
    except LookupError as error:
        err_console.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None
    print(f"{name}@champion -> version {version}")
    _follow_aliases(settings, registry, name)


@models_app.command("rollback")
def models_rollback(name: str) -> None:
    """Remove the challenger alias: workers stop serving it, the champion keeps all traffic."""
    from feedback.promotion import roll_back

    settings = load_settings()
    registry = _registry(settings)
    if not roll_back(registry, name):
        err_console.print(f"[red]error:[/] {name} has no challenger to roll back")
        raise typer.Exit(1)
    print(f"{name}@challenger removed")
    _follow_aliases(settings, registry, name)


def _arm_summary(look: Any) -> dict[str, Any]:
    """The numbers of one evaluation, per arm, as JSON-ready values."""
    from dataclasses import asdict

    return {
        "decided_at": look.at.isoformat(), "outcome": look.outcome, "reason": look.reason,
        "champion": asdict(look.champion), "challenger": asdict(look.challenger),
        "likelihood_ratio": look.likelihood_ratio, "difference": look.difference, "srm_p": look.srm_p,
    }  # fmt: skip


def _experiment_summary(experiment: Any) -> dict[str, Any]:
    from feedback.experiments import aware

    return {
        "id": experiment.id, "model": experiment.model, "champion_version": experiment.champion_version,
        "challenger_version": experiment.challenger_version, "traffic": experiment.traffic,
        "status": experiment.status, "reason": experiment.reason,
        "started_at": aware(experiment.started_at).isoformat(),
        "ended_at": aware(experiment.ended_at).isoformat() if experiment.ended_at else None,
    }  # fmt: skip


@experiments_app.command("list")
def experiments_list(
    name: Annotated[str | None, typer.Argument(help="Only this model's experiments.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON array.")] = False,
) -> None:
    """Experiments, newest first: versions, split, status and the latest numbers per arm."""
    from feedback.experiments import experiments

    found = experiments(_current_engine(load_settings()), name)
    if as_json:
        rows = [
            {**_experiment_summary(e), "latest": _arm_summary(look) if look else None} for e, look in found
        ]
        print(json.dumps(rows))
        return
    for e, look in found:
        numbers = "-"
        if look is not None:
            numbers = (f"champion {look.champion.positive}/{look.champion.rated}, "
                       f"challenger {look.challenger.positive}/{look.challenger.rated} positive")  # fmt: skip
        print(f"{e.id}\t{e.model}\tv{e.champion_version} vs v{e.challenger_version}\t"
              f"{e.traffic:.0%}\t{e.status}\t{e.started_at:%Y-%m-%d %H:%M:%S}\t{numbers}")  # fmt: skip


def _history(experiment_id: int) -> tuple[Any, list[Any]]:
    """An experiment and its evaluations; exit status 1 when there is no such experiment."""
    from feedback.experiments import history

    try:
        return history(_current_engine(load_settings()), experiment_id)
    except LookupError as error:
        err_console.print(f"[red]error:[/] {error}")
        raise typer.Exit(1) from None


@experiments_app.command("show")
def experiments_show(experiment_id: int) -> None:
    """One experiment: its versions, its status and why, and every evaluation with its numbers."""
    from rich.table import Table

    experiment, looks = _history(experiment_id)
    for key, value in _experiment_summary(experiment).items():
        print(f"{key}\t{value if value is not None else '-'}")
    shown = looks[-SHOWN_EVALUATIONS:]
    table = Table(title=f"the last {len(shown)} of {len(looks)} evaluation(s)")
    for column in ("time", "outcome", "champion +/rated", "challenger +/rated", "LR", "SRM p", "reason"):
        table.add_column(column)
    for look in shown:
        table.add_row(
            f"{look.at:%Y-%m-%d %H:%M:%S}", look.outcome,
            f"{look.champion.positive}/{look.champion.rated}",
            f"{look.challenger.positive}/{look.challenger.rated}",
            f"{look.likelihood_ratio:.3g}", f"{look.srm_p:.2g}", look.reason,
        )  # fmt: skip
    console.print(table)


@experiments_app.command("report")
def experiments_report(
    experiment_id: int,
    out: Annotated[Path, typer.Option("--out", help="PNG file to write.")],
) -> None:
    """Plot an experiment: per-arm positive rate over time with 95% bands, samples, the decision."""
    from feedback.report import plot_experiment

    experiment, looks = _history(experiment_id)
    plot_experiment(experiment, looks, out)
    print(f"wrote {out}")


@workers_app.command("status")
def workers_status(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON array.")] = False,
) -> None:
    """Each worker: loaded versions, queue, memory, its isolation and the connections it refused."""
    from reflow.v1 import worker_pb2
    from reflow.worker_calls import call_workers

    settings = load_settings()
    statuses = call_workers(settings, "Status", worker_pb2.WorkerStatusRequest(), timeout_s=5)
    if not statuses:
        err_console.print(
            "[red]error:[/] no workers: set REFLOW_WORKERS or start `reflow up` in this data dir"
        )
        raise typer.Exit(1)
    rows: list[dict[str, Any]] = []
    for address, status in statuses.items():
        if isinstance(status, str):
            rows.append({"address": address, "error": status})
            continue
        rows.append({
            "address": address, "isolation": status.isolation,
            "connections_dropped": status.connections_dropped, "connects_denied": status.connects_denied,
            "running": status.running, "waiting": status.waiting, "memory_bytes": status.memory_bytes,
            "loaded": [{"model": v.model, "version": v.version, "aliases": list(v.aliases)}
                       for v in status.loaded],
        })  # fmt: skip
    if as_json:
        print(json.dumps(rows))
    else:
        for row in rows:
            if "error" in row:
                print(f"{row['address']}\tunreachable: {row['error']}")
                continue
            served = ", ".join(f"{v['model']}/{v['version']}" + "".join(f" @{a}" for a in v["aliases"])
                               for v in row["loaded"])  # fmt: skip
            print(f"{row['address']}\t{served or '-'}\trunning {row['running']}, waiting {row['waiting']}\t"
                  f"isolation {row['isolation']}: {row['connections_dropped']} connections dropped, "
                  f"{row['connects_denied']} connects denied")  # fmt: skip
    if any("error" in row for row in rows):
        raise typer.Exit(1)
