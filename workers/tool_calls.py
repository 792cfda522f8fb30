"""Tool calls in a model's own format: which format its chat template speaks, the grammar that holds
an answer to the calls it must make, and the parser that turns the calls in an answer's text into
OpenAI's streamed pieces (a call's name first, then its arguments as they are written).

Two formats are spoken, each by the templates that teach it (docs/tool-calls.md):
- Hermes's: calls inside `<tool_call>` tags, `{"name": ..., "arguments": {...}}` each, any number,
  text before them (Qwen2, Qwen2.5, Qwen3, Hermes and the models trained on their template);
- Llama 3.1's JSON: the whole answer is one call, `{"name": ..., "parameters": {...}}`.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reflow.structured_output import JSON_LAYOUT

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}  # what a tool without parameters takes


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None  # the JSON Schema of its arguments; None: it takes none

    def rendered(self) -> dict[str, Any]:
        """As a chat template sees it (transformers' `tools=` entries: OpenAI's shape), with what the
        client gave: no description or parameters where it gave none."""
        given = {"description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": {"name": self.name} | {k: v for k, v in given.items() if v}}


@dataclass(frozen=True)
class CallPiece:
    """A piece of a tool call: its first has the call's id and name, later ones more arguments."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class ToolFormat:
    """How a family of models calls tools: the tags around each call ("" where the whole answer is
    one call) and the key its arguments go under."""

    opens: str
    closes: str
    arguments_key: str

    def grammar(self, tools: Sequence[Tool], one: bool) -> str:
        """llguidance's (Lark) grammar of an answer that calls `tools` and nothing else: exactly one
        call where `one`, else one or more (where the format takes several)."""
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, self.arguments_key: t.parameters or NO_ARGUMENTS},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        call = f"%json {json.dumps({'anyOf': calls, 'x-guidance': JSON_LAYOUT})}"
        if self.opens:
            call = f"{json.dumps(self.opens + chr(10))} {call} {json.dumps(chr(10) + self.closes)}"
        many = "" if one or not self.opens else ' ("\\n" call)*'
        return f"start: call{many}\ncall: {call}"


@dataclass(frozen=True)
class ToolUse:
    """A request's tools on a model that speaks `format`, and those it must call: one of `forced`
    (exactly one call where `one`); none forced = it decides."""

    tools: tuple[Tool, ...]
    format: ToolFormat
    forced: tuple[Tool, ...] = ()
    one: bool = False

    def grammar(self) -> str | None:
        """The grammar holding the answer to the calls it must make; None where it decides."""
        return self.format.grammar(self.forced, self.one) if self.forced else None


HERMES = ToolFormat("<tool_call>", "</tool_call>", "arguments")
LLAMA3_JSON = ToolFormat("", "", "parameters")


def format_of(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches its model; None for one that takes no tools (or
    teaches a format reflow does not parse)."""
    if template is None or not re.search(r"\btools\b", template):
        return None
    if HERMES.opens in template:
        return HERMES
    if '"parameters"' in template and "<|eot_id|>" in template:
        return LLAMA3_JSON
    return None


# The start of a call object up to its arguments: its name, then the arguments key
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(\w+)"\s*:\s*(?=\S)')
_OBJECT_END = re.compile(r"\s*\}?\s*$")  # what may close the call object after its arguments


@dataclass
class _Call:
    """One call object's text as it arrives, and what of it was given out."""

    index: int
    text: str = ""
    arguments_at: int = -1  # where its arguments start in `text`, once its name is known
    given: int = 0  # of its arguments, the characters given out


@dataclass
class CallParser:
    """Turns the text of an answer, as it streams, into its own text and its tool calls' pieces.

    A call's name is given out as soon as its object reaches its arguments; the arguments follow as
    they are written, their last characters held back until it is clear they are not the object's
    closing brace. A call whose object does not start with its name is given out whole when it
    ends; a "call" that is no JSON object with a name and arguments is given back as text. After a
    call, text that is only whitespace (what separates calls) is dropped."""

    format: ToolFormat
    calls: int = 0  # calls given out so far
    _held: str = ""  # text that may be the start of a tag (untagged: leading whitespace)
    _call: _Call | None = None  # the call being read
    _decided: bool = False  # untagged: whether the answer is known to be a call or text

    def push(self, text: str) -> tuple[str, list[CallPiece]]:
        """The answer's own text and the calls' pieces that `text`, the answer's next part, completes."""
        if not self.format.opens:
            return self._push_untagged(text)
        pending, self._held = self._held + text, ""
        out, pieces = [], []
        while pending:
            tag = self.format.opens if self._call is None else self.format.closes
            at = pending.find(tag)
            if at < 0:  # all of it but an end that may be the start of the tag, held back
                keep = len(pending) - _partial_suffix(pending, tag)
                before, self._held, pending = pending[:keep], pending[keep:], ""
            else:
                before, pending = pending[:at], pending[at + len(tag) :]
            if self._call is None:
                out.append(self._own_text(before))
                if at >= 0:
                    self._call = _Call(self.calls)
            else:
                pieces += self._feed(before)
                if at >= 0:
                    more, back = self._end_call()
                    pieces += more
                    out.append(back)
        return "".join(out), pieces

    def finish(self) -> tuple[str, list[CallPiece]]:
        """What is held back when the answer ends (a call cut short is given out as it stands)."""
        held, self._held = self._held, ""
        if self._call is None:
            return self._own_text(held), []
        pieces = self._feed(held)
        more, text = self._end_call()
        return text, pieces + more

    def _push_untagged(self, text: str) -> tuple[str, list[CallPiece]]:
        """The whole answer is one call when it starts with `{`: decided at its first character."""
        if self._decided:
            return ("", self._feed(text)) if self._call is not None else (text, [])
        pending, self._held = self._held + text, ""
        if not pending.strip():
            self._held = pending
            return "", []
        self._decided = True
        if not pending.lstrip().startswith("{"):
            return pending, []
        self._call = _Call(self.calls)
        return "", self._feed(pending.lstrip())

    def _feed(self, text: str) -> list[CallPiece]:
        call = self._call
        assert call is not None
        call.text += text
        pieces = []
        if call.arguments_at < 0:
            head = _CALL_HEAD.match(call.text)
            if head is None or head.group(2) != self.format.arguments_key:
                return []
            call.arguments_at = head.end()
            pieces.append(CallPiece(call.index, _call_id(), json.loads(f'"{head.group(1)}"')))
        arguments = call.text[call.arguments_at :]
        end = len(arguments) - len(_OBJECT_END.search(arguments).group())  # type: ignore[union-attr]
        if end > call.given:
            pieces.append(CallPiece(call.index, arguments=arguments[call.given : end]))
            call.given = end
        return pieces

    def _end_call(self) -> tuple[list[CallPiece], str]:
        """The call's last pieces, and text to give back: a call whose name never came first is
        parsed whole, and given back as the text it was where it is not a call."""
        call, self._call = self._call, None
        assert call is not None
        if call.arguments_at >= 0:
            rest = call.text[call.arguments_at :].rstrip()
            rest = rest[:-1].rstrip() if rest.endswith("}") else rest  # the call object's own brace
            self.calls += 1
            return (
                [CallPiece(call.index, arguments=rest[call.given :])] if len(rest) > call.given else []
            ), ""
        try:
            whole = json.loads(call.text)
            name, arguments = whole["name"], whole[self.format.arguments_key]
            assert isinstance(name, str) and isinstance(arguments, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            return [], self.format.opens + call.text + self.format.closes
        self.calls += 1
        return [CallPiece(call.index, _call_id(), name, json.dumps(arguments, ensure_ascii=False))], ""

    def _own_text(self, text: str) -> str:
        """The answer's own text: after calls, none where it is only whitespace."""
        return "" if self.calls and not text.strip() else text


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    return max((n for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"
