"""`reflow generate`: stream one completion to the terminal."""

from __future__ import annotations

from typing import Annotated

import typer

from reflow.cli.common import (
    GatewayCaFile,
    console,
    default_api_key,
    default_target,
    err_console,
    fail,
    settings_with,
)


def generate(
    prompt: Annotated[
        str | None, typer.Argument(help='The prompt, e.g. "47+38="; or give --chat.', show_default=False)
    ] = None,
    chat: Annotated[
        str | None, typer.Option(help="Send TEXT as a user message instead of a prompt.", show_default=False)
    ] = None,
    system: Annotated[
        str | None, typer.Option(help="With --chat: a system message before it.", show_default=False)
    ] = None,
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
    ca_file: GatewayCaFile = None,
) -> None:
    """Stream a completion to the terminal: reasoning dimmed, then the answer and usage."""
    import grpc  # with the client and its messages: 30 ms off `reflow --help`

    from reflow.client import Client
    from reflow.v1 import inference_pb2

    messages = chat_messages(prompt, chat, system)
    settings = settings_with(api_key=api_key or None, gateway_ca_file=ca_file)
    sampling = inference_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop or []
    )
    last = None
    thinking = False  # the answer starts on a line of its own after the thought
    try:
        target = target or default_target(settings)
        with Client(target, default_api_key(settings), settings.gateway_ca_file) as client:
            for message in client.generate(
                prompt or "",
                messages=messages,
                model=model,
                sampling=sampling,
                reasoning_budget=reasoning_budget,
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


def chat_messages(prompt: str | None, chat: str | None, system: str | None) -> list[dict[str, str]]:
    """The conversation `--chat` (after `--system`) sends; [] for a PROMPT; fails on neither or both."""
    if (prompt is None) == (chat is None):
        fail("give either a PROMPT or --chat TEXT")
    if chat is None:
        if system is not None:
            fail("--system goes with --chat, not with a PROMPT")
        return []
    system_turn = [{"role": "system", "content": system}] if system is not None else []
    return [*system_turn, {"role": "user", "content": chat}]
