"""Tool calls in a model's own format: which templates speak which format, the grammar of the calls
a model must make, and the parser that turns an answer's calls into OpenAI's pieces however the
answer's text arrives."""

from __future__ import annotations

import json
from itertools import combinations

import llguidance
import pytest

from tests.support.templates import LLAMA3, QWEN3
from workers.grammar import vocabulary
from workers.models.builtin import TOKENIZER
from workers.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    NO_ARGUMENTS,
    CallParser,
    CallPiece,
    Tool,
    ToolFormat,
    format_of,
)

WEATHER = Tool(
    "get_weather",
    "The weather now.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CLOCK = Tool("get_time", "The time now.", NO_ARGUMENTS)


def parsed(
    format: ToolFormat, text: str, cuts: tuple[int, ...] = ()
) -> tuple[str, list[dict[str, str]], list[CallPiece]]:
    """The answer's own text, its whole calls and the pieces they came in, `text` pushed in parts
    cut at `cuts`."""
    parser, out, pieces = CallParser(format), "", []
    for start, end in zip((0, *cuts), (*cuts, len(text)), strict=True):
        more_text, more = parser.push(text[start:end])
        out, pieces = out + more_text, pieces + more
    rest, more = parser.finish()
    calls: list[dict[str, str]] = []
    for piece in (*pieces, *more):
        if piece.id:
            calls.append({"name": piece.name, "arguments": ""})
        calls[piece.index]["arguments"] += piece.arguments
    return out + rest, calls, [*pieces, *more]


CALLS = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "on": {"day": 1}}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
NONE = "<tool_call>\nnot json\n</tool_call>!"
ANSWERS = {  # format, answer, its own text, its calls
    "two calls after text": (
        HERMES, CALLS, "Let me look.\n", [("get_weather", {"city": "Paris", "on": {"day": 1}}),
                                          ("get_time", {})]
    ),
    "no call, tag-like text": (HERMES, "a < b, <tool is no tag", "a < b, <tool is no tag", []),
    "arguments first": (HERMES, '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', "",
                        [("f", {"x": 1})]),
    "a call that is none": (HERMES, NONE, NONE, []),
    "llama 3 call": (LLAMA3_JSON, ' {"name": "f", "parameters": {"on": "UTC"}}', "", [("f", {"on": "UTC"})]),
    "llama 3 text": (LLAMA3_JSON, 'Sunny {"a": 1}', 'Sunny {"a": 1}', []),
    "llama 3 object that is no call": (LLAMA3_JSON, '{"not": "a call"}', '{"not": "a call"}', []),
}  # fmt: skip


@pytest.mark.parametrize("name", ANSWERS)
def test_an_answers_calls_are_the_same_however_its_text_arrives(name: str) -> None:
    format, text, own_text, calls = ANSWERS[name]
    whole = parsed(format, text)
    assert whole[0] == own_text
    assert [(c["name"], json.loads(c["arguments"])) for c in whole[1]] == calls
    for n in (1, 2):  # every way of cutting it in two and in three
        for cuts in combinations(range(1, len(text)), n):
            assert parsed(format, text, cuts)[:2] == whole[:2], cuts


def test_a_calls_name_comes_first_then_its_arguments_as_they_are_written() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _, _, pieces = parsed(HERMES, text, tuple(range(1, len(text))))  # a character at a time
    first, *rest = pieces
    assert (first.name, first.arguments, first.id.startswith("call_")) == ("get_weather", "", True)
    assert len(rest) > 5 and all(not p.id and not p.name for p in rest)  # pieces, no id or name again
    assert "".join(p.arguments for p in rest) == '{"city": "Paris"}'
    cut_at = text.index("Paris") + 2  # max_tokens cut it: given out as it stands
    cut = parsed(HERMES, text[:cut_at], tuple(range(1, cut_at)))
    assert cut[1] == [{"name": "get_weather", "arguments": '{"city": "Pa'}]


def test_templates_are_known_by_the_format_they_teach() -> None:
    assert format_of(QWEN3) is HERMES and format_of(LLAMA3) is LLAMA3_JSON
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None  # takes no tools
    assert format_of(None) is None


@pytest.mark.parametrize("format", [HERMES, LLAMA3_JSON], ids=["hermes", "llama3_json"])
def test_the_grammar_of_calls_a_model_must_make_takes_them_and_nothing_else(format: ToolFormat) -> None:
    table = vocabulary(TOKENIZER, TOKENIZER.vocab_size)

    def takes(grammar: str, text: str) -> bool:
        matcher, ids = llguidance.LLMatcher(table, grammar), TOKENIZER.encode(text, bos=False)
        return (
            matcher.validate_tokens(ids) == len(ids)
            and matcher.consume_tokens(ids)
            and matcher.is_accepting()
        )

    def call(tool: str, arguments: dict[str, str]) -> str:
        body = json.dumps({"name": tool, format.arguments_key: arguments})
        return f"{format.opens}\n{body}\n{format.closes}" if format.opens else body

    weather, clock = call("get_weather", {"city": "Paris"}), call("get_time", {})
    either, one = format.grammar([WEATHER, CLOCK], one=False), format.grammar([CLOCK], one=True)
    assert takes(either, weather) and takes(either, clock) and takes(one, clock)
    assert not takes(one, weather) and not takes(either, "It is sunny.")
    assert not takes(either, call("get_weather", {"town": "Paris"}))  # held to the tool's schema
    assert takes(either, f"{weather}\n{clock}") == bool(format.opens)  # several, where the format takes them
    assert not takes(one, f"{clock}\n{clock}")
