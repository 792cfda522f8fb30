"""The long-running processes: `reflow gateway`, `reflow worker` and `reflow scheduler`."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

import typer

from reflow.cli.common import ReadyFile, current_db, load_settings, stop_on_signal
from workers.threads import spin_briefly, wait_passively


def gateway(
    port: Annotated[int | None, typer.Option(help="Port [default: REFLOW_GATEWAY_PORT or 50051].")] = None,
    http_port: Annotated[
        int | None, typer.Option(help="OpenAI-compatible HTTP port [default: REFLOW_HTTP_PORT or 8000].")
    ] = None,
    ready_file: ReadyFile = None,
) -> None:
    """Serve the public Inference API over gRPC and the OpenAI-compatible HTTP API, routing to
    REFLOW_WORKERS."""
    from gateway.server import serve  # FastAPI, kafka-python, psutil: 750 ms off `reflow --help`

    settings = load_settings(gateway_port=port, http_port=http_port)
    current_db(settings).dispose()  # a store out of date or out of reach: one line, before it serves
    asyncio.run(serve(settings, ready_file=ready_file))


def worker(
    version: Annotated[str, typer.Option(help="Load this version instead of REFLOW_MODEL_ALIAS.")] = "",
    port: Annotated[int | None, typer.Option(help="Port [default: REFLOW_WORKER_PORT, 0 = free].")] = None,
    ready_file: ReadyFile = None,
) -> None:
    """Serve the internal Worker API for REFLOW_MODEL_NAME on REFLOW_DEVICE."""
    spin_briefly()  # before torch loads
    from workers.server import serve  # torch, after spin_briefly: 1.9 s off `reflow --help`

    asyncio.run(serve(load_settings(worker_port=port), version=version, ready_file=ready_file))


def scheduler(ready_file: ReadyFile = None) -> None:
    """Run the scheduled jobs (fine-tune, evaluate experiments) until Ctrl-C or SIGTERM; their
    schedule is kept in the store."""
    wait_passively()  # before torch loads: it trains beside the workers
    from feedback.job_scheduler import run_scheduler  # APScheduler: 25 ms off `reflow --help`
    from reflow.serving import write_ready_file  # grpc, prometheus: 75 ms off `reflow --help`

    settings = load_settings()
    # two lines per run of every job, every few seconds: the jobs log what they did instead
    logging.getLogger("apscheduler.executors.default").setLevel(logging.WARNING)
    db = current_db(settings)
    stop = stop_on_signal()
    write_ready_file(ready_file, store=db.url.render_as_string(hide_password=True))
    run_scheduler(settings, db, stop)
