"""Prompts as a model sees them: text after its beginning-of-sequence token, or a conversation
rendered with its chat template (which carries its own start tokens)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from workers.models.interface import Tokenizer

Conversation = tuple[tuple[str, str], ...]  # (role, content) of each message, in order
Prompt = str | Conversation


def conversation(messages: Iterable[Mapping[str, str]]) -> Conversation:
    """A conversation of `{"role", "content"}` messages (as the wire and the store carry them)."""
    return tuple((m["role"], m["content"]) for m in messages)


def user_turn(text: str) -> Conversation:
    """A conversation of one user message."""
    return (("user", text),)


def prompt_ids(tokenizer: Tokenizer, prompt: Prompt) -> list[int]:
    """The token ids the model is fed for `prompt`, ready for its answer; ValueError for a
    conversation when the model has no chat template (or its template refuses the conversation)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return chat_ids(tokenizer, [{"role": role, "content": content} for role, content in prompt])


def chat_ids(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The token ids of a conversation (as chat templates take messages) rendered with the model's
    chat template and `tools`, ready for its answer; ValueError as `prompt_ids`."""
    return tokenizer.encode(tokenizer.render_chat(messages, tools), bos=False)
