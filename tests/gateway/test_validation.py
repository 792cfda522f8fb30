"""What the gateway accepts of a GenerateRequest before a worker sees it (the refusals through a
running gateway are in test_generate.py)."""

from __future__ import annotations

import pytest

from gateway.validation import MAX_TEMPERATURE, MIN_TEMPERATURE, RequestLimits, check_request
from reflow.errors import InvalidArgument
from reflow.v1 import inference_pb2

P = inference_pb2
LIMITS = RequestLimits(max_prompt_chars=512, default_max_tokens=16, max_stop_strings=8)


def sampled(temperature: float) -> P.GenerateRequest:
    return P.GenerateRequest(prompt="1+1=", sampling=P.SamplingParams(temperature=temperature))


@pytest.mark.parametrize("temperature", [0.0, MIN_TEMPERATURE, 1.0, MAX_TEMPERATURE])
def test_the_documented_temperatures_pass_as_float32_carries_them(temperature: float) -> None:
    check_request(sampled(temperature), LIMITS)  # 0.01 arrives as 0.009999999776...: found by fuzzing


@pytest.mark.parametrize("temperature", [0.0099, -0.01, 100.01, float("nan"), float("inf")])
def test_temperatures_out_of_range_are_refused(temperature: float) -> None:
    with pytest.raises(InvalidArgument, match=r"sampling\.temperature must be 0"):
        check_request(sampled(temperature), LIMITS)


@pytest.mark.parametrize(
    ("sampling", "refused"),
    [
        ({"presence_penalty": 2.01}, r"sampling\.presence_penalty must be in \[-2\.0, 2\.0\]"),
        ({"frequency_penalty": float("nan")}, r"sampling\.frequency_penalty must be in"),
        ({"repetition_penalty": -0.5}, r"sampling\.repetition_penalty must be in \(0, 10\.0\]"),
        ({"repetition_penalty": 10.5}, r"sampling\.repetition_penalty"),
        ({"logit_bias": {7: 100.5}}, r"sampling\.logit_bias\[7\] must be in \[-100\.0, 100\.0\]"),
        ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, r"sampling\.logit_bias has 1025 entries"),
    ],
)
def test_penalties_and_logit_biases_out_of_range_are_refused(
    sampling: dict[str, object], refused: str
) -> None:
    with pytest.raises(InvalidArgument, match=refused):
        check_request(P.GenerateRequest(prompt="1+1=", sampling=P.SamplingParams(**sampling)), LIMITS)


def test_penalties_and_logit_biases_at_their_bounds_pass() -> None:
    bounds = P.SamplingParams(
        presence_penalty=-2, frequency_penalty=2, repetition_penalty=10, logit_bias={0: -100, 5: 100}
    )
    check_request(P.GenerateRequest(prompt="1+1=", sampling=bounds), LIMITS)


CITY = '{"type": "object", "properties": {"city": {"type": "string"}}}'
ASKING = [P.ChatMessage(role="user", content="Weather in Paris?")]
CALL = P.ToolCall(id="call_1", name="f", arguments="{}")
NOT_AN_OBJECT = P.ToolCall(id="call_2", name="f", arguments="1")


def with_tools(
    tools: list[P.Tool], mode: str = "", function: str = "", **fields: object
) -> P.GenerateRequest:
    request = P.GenerateRequest(messages=fields.pop("messages", ASKING), tools=tools, **fields)  # type: ignore[arg-type]
    if mode or function:
        request.tool_choice.CopyFrom(P.ToolChoice(mode=mode, function=function))
    return request


@pytest.mark.parametrize(
    ("request_", "param", "refused"),
    [
        (P.GenerateRequest(prompt="hi", tools=[P.Tool(name="f")]), "tools", "send messages, not a prompt"),
        (with_tools([P.Tool(name="get weather")]), "tools.0.name", "letters, digits"),
        (with_tools([P.Tool(name="f"), P.Tool(name="f")]), "tools.1.name", "two tools are named 'f'"),
        (with_tools([P.Tool(name="f", parameters="[1]")]), "tools.0.parameters", "must be a JSON object"),
        (with_tools([P.Tool(name="f")], "sometimes"), "tool_choice", "one of auto, none, required, function"),
        (with_tools([P.Tool(name="f")], "function", "g"), "tool_choice", "'g', which is not among the tools"),
        (with_tools([P.Tool(name="f")], "required", "f"), "tool_choice", "mode 'function', and only then"),
        (with_tools([], "required"), "tool_choice", "needs tools"),
        (with_tools([P.Tool(name="f", parameters='{"type": "array", "uniqueItems": true}')], "required"),
         "tools.0.parameters", "uniqueItems"),
        (with_tools([P.Tool(name="f")], "required", structured_output=P.StructuredOutput(json_object=True)),
         None, "drop structured_output"),
        (with_tools([], messages=[P.ChatMessage(role="user", content="x", tool_calls=[CALL])]),
         "messages.0", "only an assistant's turn makes tool calls"),
        (with_tools([], messages=[P.ChatMessage(role="assistant", tool_calls=[NOT_AN_OBJECT])]),
         "messages.0.tool_calls.0.arguments", "must be a JSON object"),
        (with_tools([], messages=[P.ChatMessage(role="user", content="x", tool_call_id="call_1")]),
         "messages.0", "only a tool's turn answers a call"),
    ],
)  # fmt: skip
def test_tools_and_tool_choices_a_worker_should_never_see_are_refused_by_name(
    request_: P.GenerateRequest, param: str | None, refused: str
) -> None:
    with pytest.raises(InvalidArgument, match=refused) as error:
        check_request(request_, LIMITS)
    assert error.value.param == param


def test_tools_a_conversation_uses_and_its_calls_pass() -> None:
    calls = [P.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')]
    conversation = [*ASKING, P.ChatMessage(role="assistant", tool_calls=calls),
                    P.ChatMessage(role="tool", content="Sunny", tool_call_id="call_1")]  # fmt: skip
    for mode in ("", "auto", "none", "required"):
        check_request(
            with_tools([P.Tool(name="get_weather", parameters=CITY)], mode, messages=conversation), LIMITS
        )
    check_request(with_tools([P.Tool(name="get_time")], "function", "get_time"), LIMITS)
    check_request(with_tools([], "none"), LIMITS)  # what SDKs send by default
