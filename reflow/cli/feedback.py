"""`reflow feedback`: consume the pipeline into the store, ingest files onto it, inspect it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from gateway.tenants import list_tenants
from reflow.cli.common import (
    ReadyFile,
    create_topics,
    current_db,
    err_console,
    fail,
    kafka_bootstrap,
    load_settings,
    stop_on_signal,
)
from reflow.request_ids import RequestIds

if TYPE_CHECKING:
    from reflow.kafka_settings import PublisherConfig
    from reflow.settings import Settings

app = typer.Typer(
    help="The feedback pipeline: consume it into the store, ingest files, inspect it.", no_args_is_help=True
)


def kafka_config(settings: Settings) -> PublisherConfig:
    """How the Kafka clients connect (TLS, SASL) and publish; incomplete settings end the command,
    exit status 2."""
    from reflow.errors import ReflowError  # with PublisherConfig, grpc: 20 ms off `reflow --help`
    from reflow.kafka_settings import PublisherConfig

    try:
        return PublisherConfig.from_settings(settings)
    except ReflowError as error:
        fail(f"{error}", 2, label="bad settings")


@app.command("consume")
def feedback_consume(ready_file: ReadyFile = None) -> None:
    """Write inference events and feedback from Kafka to the store, until Ctrl-C or SIGTERM."""
    from feedback.intake.consumer import consume  # kafka-python: 115 ms off `reflow --help`
    from reflow.serving import write_ready_file  # grpc, prometheus: 75 ms off `reflow --help`

    settings = load_settings()
    db = current_db(settings)
    bootstrap = kafka_bootstrap(settings)
    security = kafka_config(settings).security
    create_topics(settings, bootstrap, security)
    stop = stop_on_signal()
    write_ready_file(ready_file, kafka=bootstrap)
    consume(
        bootstrap, db, settings.consumer_batch_size, stop, drain_s=settings.shutdown_grace_s,
        security=security,
    )  # fmt: skip


@app.command("ingest")
def feedback_ingest(
    file: Annotated[str, typer.Argument(help="JSONL file of Feedback objects, or - for stdin.")],
    tenant: Annotated[str, typer.Option(help="The tenant whose completions are rated.")] = "default",
) -> None:
    """Publish feedback from a JSONL file; a bad line is reported with its number and skipped."""
    from feedback.bus.publisher import Publisher  # with ingest, kafka-python: 100 ms off `reflow --help`
    from feedback.intake.ingest import ingest

    settings = load_settings()
    db = current_db(settings)
    if not any(info.name == tenant and not revoked for info, _, revoked in list_tenants(db)):
        fail(f"no active tenant named {tenant!r} (see `reflow tenants list`)", 2)
    source = sys.stdin if file == "-" else Path(file).open(encoding="utf-8")  # noqa: SIM115
    total = None if file == "-" else Path(file).stat().st_size
    config = kafka_config(settings)  # incomplete settings end the command before the file is read
    publisher = Publisher(kafka_bootstrap(settings), settings.outbox_path, config)
    columns = (TextColumn("ingesting"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    try:
        with source, Progress(*columns, console=err_console) as progress:
            task = progress.add_task("ingest", total=total)
            report = ingest(
                source, tenant, RequestIds.from_store(db), publisher, lambda n: progress.advance(task, n)
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


@app.command("stats")
def feedback_stats(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Counts of stored inferences and feedback, joined feedback, DLQ records and consumer lag."""
    from kafka.errors import KafkaError  # with the three below, kafka-python: 100 ms off `reflow --help`

    from feedback.bus.kafka import resolve_bootstrap
    from feedback.intake.stats import kafka_stats, store_counts
    from reflow.errors import Unavailable

    settings = load_settings()
    security = kafka_config(settings).security
    stats: dict[str, Any] = store_counts(current_db(settings))
    try:
        bootstrap = resolve_bootstrap(settings.kafka_bootstrap, settings.data_dir)
        stats.update(kafka_stats(bootstrap, security=security))
    except (KafkaError, Unavailable) as error:  # the store's counts are still worth showing
        stats.update(dlq_messages=None, consumer_lag=None, kafka_error=str(error))
    if as_json:
        print(json.dumps(stats))
        return
    for key, value in stats.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
        print(f"{key}\t{value}")


@app.command("dead-letters")
def feedback_dead_letters(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON list.")] = False,
) -> None:
    """Records Kafka refused for good (too large, not authorized), kept in the data dir's outbox with why."""
    from feedback.bus.outbox import Outbox  # kafka-python: 95 ms off `reflow --help`

    settings = load_settings()
    path = settings.outbox_path
    letters = []
    if path.exists():
        outbox = Outbox(path)
        letters = outbox.dead_letters()
        outbox.close()
    rows = [
        {
            "time": letter.time, "topic": letter.record.topic,
            "key": (letter.record.key or b"").decode(errors="replace"), "bytes": len(letter.record.value),
            "reason": letter.reason,
        }
        for letter in letters
    ]  # fmt: skip
    if as_json:
        print(json.dumps(rows))
        return
    if not rows:
        err_console.print(f"no dead letters in {path}", highlight=False, markup=False, soft_wrap=True)
    for row in rows:
        print("\t".join(str(value) for value in row.values()))
