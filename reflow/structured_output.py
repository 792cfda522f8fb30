"""A request's structured output (inference.proto's StructuredOutput) as the llguidance grammar that
holds a completion to it: the gateway checks it at the edge, the worker compiles it against the
version's vocabulary (workers/grammar.py). Both read it here, so they agree on what it means."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher

from reflow.errors import InvalidArgument
from reflow.v1 import inference_pb2

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# How JSON is laid out: as Python's json.dumps writes it on one line (", " and ": ", no other
# whitespace). llguidance's default admits any whitespace between tokens, and small models then fill
# their budget with newlines and spaces; a schema's own "x-guidance" options still take precedence.
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_JSON_OBJECT = {"type": "object"}
MAX_FORMAT_CHARS = 64 * 1024  # a schema, expression or grammar; past it, compiling costs the worker too much


def grammar(structured: inference_pb2.StructuredOutput, param: str | None = None) -> str | None:
    """llguidance's grammar of `structured`, None when no format is set; InvalidArgument naming
    `param` (the field as the client's API calls it; the gRPC field by default) for one that is not
    well formed (a JSON Schema that is no JSON object, say). Whether the grammar compiles is
    `check`'s to tell."""
    kind = structured.WhichOneof("format")
    if kind is None:
        return None
    param = param or f"structured_output.{kind}"
    if kind == "json_object":
        if not structured.json_object:
            message = "json_object must be true when set; leave the format unset for free text"
            raise InvalidArgument(message, param)
        return LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_LAYOUT)
    source: str = getattr(structured, kind)
    if not source:
        raise InvalidArgument(f"{param} is empty", param)
    if len(source) > MAX_FORMAT_CHARS:
        raise InvalidArgument(f"{param} is {len(source)} characters; the limit is {MAX_FORMAT_CHARS}", param)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(json_object(source, param), defaults=JSON_LAYOUT)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    return LLMatcher.grammar_from_lark(source)


def check(structured: inference_pb2.StructuredOutput, param: str | None = None) -> None:
    """InvalidArgument naming `param` (as `grammar` does), with llguidance's reason (an unimplemented
    JSON Schema keyword by name, a regular expression's error and where it is), for a format no
    worker could enforce."""
    text = grammar(structured, param)
    if text is None:
        return
    error = LLMatcher.validate_grammar(text)
    if error:
        param = param or f"structured_output.{structured.WhichOneof('format')}"
        raise InvalidArgument(f"{param} cannot be enforced: {error}", param)


def json_object(source: str, param: str) -> dict[str, Any]:
    """The JSON object `source` holds (a schema, a call's arguments); InvalidArgument naming `param`
    for text that is not one."""
    try:
        value = json.loads(source)
    except ValueError as error:
        raise InvalidArgument(f"{param} is not JSON: {error}", param) from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{param} must be a JSON object; got {source[:40]!r}", param)
    return value
