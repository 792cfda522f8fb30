"""`reflow up`: prepares the data dir, starts every process on this machine as a child, on
embedded defaults, and stops them all on Ctrl-C or SIGTERM (the steps: reflow/cli/up_steps.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gateway.tenants import Limits
from reflow.cli.common import console, load_settings


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
    settings = load_settings(data_dir=data_dir, gateway_port=port, http_port=http_port, api_key=api_key)
    from reflow.cli import up_steps  # torch, the gateway, kafka-python: 2.8 s off `reflow --help`

    if model is not None:
        settings = up_steps.served_model(settings, model)
    count = workers or up_steps.gpus(settings) or 1
    limits = Limits(max_streams, rpm, tpm)
    up_steps.run_up(settings, count, console, demo=demo, n_gateways=gateways, limits=limits)
