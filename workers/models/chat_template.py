"""A model's Jinja chat template, compiled once, rendered as transformers' `apply_chat_template` renders it.

Mirrors transformers 5's `utils/chat_template_utils.py` (`_cached_compile_jinja_template`,
`render_jinja_template`) and `PreTrainedTokenizerBase.apply_chat_template` (`tokenization_utils_base.py`):
the template runs in an ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and the loop controls,
a `tojson` that escapes no HTML, `raise_exception`, `strftime_now` and the `{% generation %}` block; it sees
`messages`, `tools` and `documents` (None), `add_generation_prompt` and the tokenizer's named special tokens
(`bos_token`, `eos_token`, ...).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks: kept as is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


_ENVIRONMENT = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
)
_ENVIRONMENT.filters["tojson"] = _tojson
_ENVIRONMENT.globals["raise_exception"] = _raise_exception
_ENVIRONMENT.globals["strftime_now"] = _strftime_now


class ChatTemplate:
    """A chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        """Compiles `source`; `special_tokens` maps names (`bos_token`, ...) to the tokens' text."""
        self.source = source
        self._template = _ENVIRONMENT.from_string(source)
        self._special_tokens = dict(special_tokens)

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """The prompt of `messages`, ready for the assistant's turn (`add_generation_prompt`), with `tools`
        (transformers' `tools=`: OpenAI's function entries); ValueError for an empty conversation or one the
        template refuses (its `raise_exception` message)."""
        if not messages:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        try:
            return self._template.render(
                messages=[dict(message) for message in messages],
                tools=None if tools is None else [dict(tool) for tool in tools],
                documents=None,
                add_generation_prompt=True,
                **self._special_tokens,
            )
        except TemplateError as error:
            raise ValueError(str(error)) from error
