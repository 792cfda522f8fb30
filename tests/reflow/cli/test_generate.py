"""`reflow generate` against a real gateway: a PROMPT or a conversation (`--chat`, `--system`)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.cli import reflow
from tests.support.stack import Stack


def one_line(text: str) -> str:
    """`text` with rich's line wrapping undone."""
    return " ".join(text.split())


async def test_chat_on_a_model_without_a_chat_template_is_invalid_argument(stack: Stack) -> None:
    target = ("--target", stack.address, "--api-key", stack.api_key)
    result = await asyncio.to_thread(
        reflow, "generate", "--chat", "47+38=", "--system", "Add.", *target, timeout_s=60
    )
    assert result.returncode == 1
    assert "INVALID_ARGUMENT: arith/1: this model has no chat template" in one_line(result.stderr)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "give either a PROMPT or --chat TEXT"),
        (("47+38=", "--chat", "hi"), "give either a PROMPT or --chat TEXT"),
        (("47+38=", "--system", "Add."), "--system goes with --chat, not with a PROMPT"),
    ],
)
def test_a_prompt_or_a_chat_message_not_both(args: tuple[str, ...], message: str) -> None:
    result = reflow("generate", *args, "--target", "127.0.0.1:1", timeout_s=60)
    assert result.returncode == 1
    assert one_line(result.stderr) == f"error: {message}"
