"""What the commands share: consoles, settings and logging, start-up failures as one line, the
store, the registry, Kafka, the gateway's address and key."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.text import Text
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from typer.core import TyperGroup

from reflow.endpoints import API_KEY_FILE, read_endpoints
from reflow.registry import Registry
from reflow.settings import Settings

if TYPE_CHECKING:
    from typer._click import Context  # the click typer vendors, whose Context TyperGroup.invoke takes

    from reflow.kafka_settings import KafkaSecurity

console = Console()
err_console = Console(stderr=True)

ReadyFile = Annotated[
    Path | None,
    typer.Option(help="Write a JSON file here once running (a server's {'address': ...}; for supervisors)."),
]
GatewayCaFile = Annotated[
    str | None,
    typer.Option(
        envvar="REFLOW_GATEWAY_CA_FILE",
        help="CA certificate (PEM) to trust for the gateway's TLS certificate [default: plaintext].",
        show_default=False,
    ),
]


def fail(message: object, status: int = 1, *, label: str = "error") -> NoReturn:
    """Ends the command: `label: message` on stderr, and exit status `status`. The message is
    printed as it is, never read as rich markup: one quoting a name or path with `[bold]` in it
    would lose it, one with `[/x]` would raise. It stays one line (soft_wrap): rich would break it
    at 80 columns where stderr is no terminal, as in a log."""
    err_console.print(Text.assemble((f"{label}:", "red"), " ", str(message)), soft_wrap=True)
    raise typer.Exit(status) from None


class Commands(TyperGroup):
    """The `reflow` command group: a ReflowError out of any command (a start-up failure: a port
    taken, a service out of reach, a model not registered) ends it in one line, exit status 2."""

    def invoke(self, ctx: Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as error:
            from reflow.errors import ReflowError  # grpc: 25 ms off `reflow --help`

            if not isinstance(error, ReflowError):
                raise
            fail(error, 2)


def settings_with(**overrides: Any) -> Settings:
    """Settings from the environment and REFLOW_CONFIG, with the command-line options given (not
    None) on top; a bad one ends the command in one line, exit status 2."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as error:
        fail(_settings_problems(error), 2, label="bad settings")


def _settings_problems(error: ValidationError) -> str:
    """Pydantic's report on the settings as one line, each problem after the variable it is about."""
    problems = []
    for problem in error.errors(include_url=False):
        # a validator's own message reads without pydantic's "Value error, " before it
        message = str(problem["ctx"]["error"]) if problem["type"] == "value_error" else problem["msg"]
        name = f"REFLOW_{str(problem['loc'][0]).upper()}" if problem["loc"] else ""
        # messages that name their variable already (REFLOW_API_KEY needs …) are not named twice
        problems.append(f"{name}: {message}" if name and name not in message else message)
    return "; ".join(problems)


def load_settings(**overrides: Any) -> Settings:
    """`settings_with(overrides)`, for a command that logs: reflow's logging set up as well."""
    settings = settings_with(**overrides)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # kafka-python logs every failed connection attempt, each second of an outage; reflow logs
    # what they mean instead (records going to the outbox, a batch the store refused).
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    return settings


def stop_on_signal() -> threading.Event:
    """An event set by Ctrl-C or SIGTERM, for a command that runs until either."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def default_target(settings: Settings) -> str:
    """The gateway `reflow up` started (its endpoints.json), else REFLOW_GATEWAY_HOST:PORT."""
    endpoints = read_endpoints(settings.data_dir)
    return endpoints["gateway"] if endpoints else f"{settings.gateway_host}:{settings.gateway_port}"


def default_api_key(settings: Settings) -> str:
    """REFLOW_API_KEY, else the key `reflow up` wrote; neither is a usage error."""
    if settings.api_key is not None:
        return settings.api_key.get_secret_value()
    key_file = settings.data_dir / API_KEY_FILE
    if key_file.is_file():
        return key_file.read_text().strip()
    fail("pass --api-key, set REFLOW_API_KEY, or run `reflow up` first", 2, label="no API key")


def store_db(settings: Settings | None = None) -> Engine:
    """The store the settings name, its schema as it is (for the commands that migrate it); one out
    of reach ends the command in one line."""
    from reflow.store.database import open_db  # alembic: 120 ms off `reflow --help`

    settings = settings or load_settings()
    db = open_db(settings.resolved_database_url)
    with reaching_store(settings):
        db.connect().close()
    return db


def current_db(settings: Settings) -> Engine:
    """The store, refusing one whose schema is out of date or that is out of reach."""
    # alembic: 120 ms off `reflow --help`
    from reflow.store.database import open_db, require_current_schema

    db = open_db(settings.resolved_database_url)
    with reaching_store(settings):
        try:
            require_current_schema(db)
        except RuntimeError as error:
            fail(f"{error}", 2)
    return db


@contextlib.contextmanager
def reaching_store(settings: Settings) -> Iterator[None]:
    """Ends the command in one line, exit status 2, when the store does not answer inside."""
    try:
        yield
    except OperationalError as error:
        from reflow.serving import unreachable  # grpc, protobuf: 75 ms, spent only on this failure

        reason = str(error.orig or error).splitlines()[0]
        fail(unreachable("the store", settings.resolved_database_url, "REFLOW_DATABASE_URL", reason), 2)


def kafka_bootstrap(settings: Settings) -> str:
    """REFLOW_KAFKA_BOOTSTRAP, or the embedded broker `reflow up` started; neither is a ReflowError
    (one line, exit status 2)."""
    from feedback.bus.kafka import resolve_bootstrap  # kafka-python: 190 ms off `reflow --help`

    return resolve_bootstrap(settings.kafka_bootstrap, settings.data_dir)


def create_topics(settings: Settings, bootstrap: str, security: KafkaSecurity) -> None:
    """reflow's topics on the brokers at `bootstrap`; brokers that do not answer end the command in
    one line, exit status 2."""
    from kafka.errors import KafkaError  # with feedback.bus.kafka, kafka-python: 190 ms off `reflow --help`

    from feedback.bus.kafka import ensure_topics

    try:
        ensure_topics(bootstrap, settings.kafka_partitions, security=security)
    except KafkaError as error:
        fail(
            f"cannot reach Kafka at {bootstrap} over {security.protocol} (is it running there, "
            "REFLOW_KAFKA_BOOTSTRAP, and is that what its listener speaks, REFLOW_KAFKA_SECURITY_PROTOCOL?): "
            f"{error}",
            2,
        )


def open_registry(settings: Settings) -> Registry:
    """The model registry (MLflow) the settings name; a server that does not answer ends the command
    in one line, exit status 2, at once rather than after MLflow's minutes of retries."""
    from reflow.serving import check_registry  # grpc, protobuf: 75 ms off `reflow --help`

    check_registry(settings.resolved_tracking_uri)
    return Registry.from_settings(settings)
