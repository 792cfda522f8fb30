"""OpenAI's bodies as GenerateRequests, and a stream's messages as OpenAI's completions and chunks:
every field that maps, every default that differs from gRPC's, reasoning kept apart."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from gateway.http.translation import (
    ChatShape,
    Served,
    TextShape,
    choice_counts,
    chunk,
    completion,
    generate_request,
    usage_chunk,
)
from reflow.errors import InvalidArgument
from reflow.v1 import inference_pb2

P = inference_pb2
HEADER = P.GenerateResponse(request_id="r1", model="chat", model_version="3", arm="challenger")


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "chat", "messages": [{"role": "user", "content": "hi"}]} | fields
    )


def test_a_chat_body_becomes_the_generate_request_it_asks_for() -> None:
    request = generate_request(
        chat(
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "u"}]},
            ],
            max_tokens=9, max_completion_tokens=7, top_p=0.5, seed=11, stop="\n", user="u42",
            metadata={"app": "docs"}, top_k=5, reasoning_budget=16, latency_budget_ms=900,
        )
    )  # fmt: skip
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("user", "Hi u")]
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, list(s.stop)) == (
        7,
        1.0,
        0.5,
        5,
        11,
        ["\n"],
    )
    assert (request.user_id, dict(request.labels), request.reasoning_budget, request.latency_budget_ms) == (
        "u42", {"app": "docs"}, 16, 900,
    )  # fmt: skip
    assert generate_request(chat(temperature=0)).sampling.temperature == 0.0  # greedy, asked for
    assert generate_request(chat(seed=-1)).sampling.seed == 2**64 - 1  # the SDK allows negative seeds
    with pytest.raises(ValidationError, match="top_p"):  # 0 is not "off" here, as it is on gRPC
        chat(top_p=0)


def test_penalties_and_a_logit_bias_are_what_openai_and_vllm_clients_send() -> None:
    sampling = generate_request(
        chat(
            presence_penalty=0.5,
            frequency_penalty=-1.5,
            repetition_penalty=1.2,
            logit_bias={"53": 100, "7": -2.5},
        )
    ).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.5)
    assert sampling.repetition_penalty == pytest.approx(1.2)
    assert dict(sampling.logit_bias) == {53: 100.0, 7: -2.5}
    too_many = {str(i): 1.0 for i in range(1025)}
    for fields in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                   {"logit_bias": {"1": 101}}, {"logit_bias": too_many}):  # fmt: skip
        with pytest.raises(ValidationError, match=next(iter(fields))):
            chat(**fields)


def test_a_text_body_takes_a_prompt_or_a_list_of_one() -> None:
    assert generate_request(CompletionRequest(prompt="1+1=")).prompt == "1+1="
    assert generate_request(CompletionRequest(prompt=["1+1="], stop=["a", "b"])).sampling.stop == ["a", "b"]
    with pytest.raises(InvalidArgument) as two:
        generate_request(CompletionRequest(prompt=["a", "b"]))
    assert two.value.param == "prompt"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"one": 2.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 2.0}}, "logit_bias"),
        ({"logit_bias": {str(2**32): 2.0}}, "logit_bias"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "function", "name": "f", "content": "42"}]}, "messages.0"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {}}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "grammar": "start: 'a'"}}, "structured_outputs"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ],
)
def test_what_reflow_does_not_do_is_refused_by_name(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        generate_request(chat(**fields))
    assert refused.value.param == param


def test_each_format_becomes_the_structured_output_it_asks_for() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    named = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
    formats = [
        ({"response_format": named}, P.StructuredOutput(json_schema=json.dumps(schema))),
        ({"response_format": {"type": "json_object"}}, P.StructuredOutput(json_object=True)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
            P.StructuredOutput(json_object=True),
        ),
        ({"response_format": {"type": "text"}}, P.StructuredOutput()),
        ({"structured_outputs": {"json": schema}}, P.StructuredOutput(json_schema=json.dumps(schema))),
        ({"structured_outputs": {"regex": "[0-9]+"}}, P.StructuredOutput(regex="[0-9]+")),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, P.StructuredOutput(grammar='start: "a"')),
        (
            {"structured_outputs": {"choice": ["yes", 'a "b"\n']}},
            P.StructuredOutput(grammar='start: "yes" | "a \\"b\\"\\n"'),
        ),
    ]
    for fields, expected in formats:
        assert generate_request(chat(**fields)).structured_output == expected, fields  # unset: empty
    text = CompletionRequest.model_validate({"prompt": "hi", "response_format": {"type": "json_object"}})
    assert generate_request(text).structured_output == P.StructuredOutput(json_object=True)


def test_tools_their_choice_and_the_calls_of_a_conversation_become_their_fields() -> None:
    weather = {"name": "get_weather", "description": "Now.", "parameters": {"type": "object"}}
    called = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    conversation = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [called]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Snow"},
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    tools = [{"type": "function", "function": weather}]
    request = generate_request(chat(messages=conversation, tools=tools, tool_choice=named))
    assert list(request.tools) == [
        P.Tool(name="get_weather", description="Now.", parameters='{"type": "object"}')
    ]
    assert request.tool_choice == P.ToolChoice(mode="function", function="get_weather")
    assert request.messages[1] == P.ChatMessage(
        role="assistant",
        tool_calls=[P.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')],
    )
    assert request.messages[2] == P.ChatMessage(role="tool", content="Snow", tool_call_id="call_1")
    for mode in ("none", "auto", "required"):
        assert generate_request(chat(tool_choice=mode)).tool_choice == P.ToolChoice(mode=mode)
    assert not generate_request(chat()).HasField("tool_choice")


def test_a_streamed_call_and_a_whole_one_take_openais_shapes() -> None:
    pieces = [
        P.ToolCallDelta(index=0, id="call_1", name="get_time"),
        P.ToolCallDelta(index=0, arguments="{}"),
    ]
    first, last = (
        P.GenerateResponse(tool_calls=pieces[:1]),
        P.GenerateResponse(tool_calls=pieces[1:], finish_reason=P.FINISH_REASON_TOOL_CALLS),
    )
    header = P.GenerateResponse()
    header.CopyFrom(HEADER)
    header.MergeFrom(first)
    events = [
        json.loads(chunk(ChatShape, Served.of(HEADER), m, i == 0, False)[6:])
        for i, m in enumerate((header, last))
    ]
    assert events[0]["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": ""}}
    ]
    assert events[1]["choices"][0]["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": "{}"}}]
    assert events[1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = completion(ChatShape, Served.of(HEADER), [[header, last]])["choices"][0]
    assert whole["message"]["content"] is None and whole["finish_reason"] == "tool_calls"
    assert whole["message"]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    ]


def test_what_openai_clients_send_by_default_is_accepted() -> None:
    request = generate_request(
        chat(n=1, presence_penalty=0, frequency_penalty=0, logprobs=False, tool_choice="none", stream=False,
             response_format={"type": "text"}, parallel_tool_calls=True, store=False)
    )  # fmt: skip
    assert request.messages[0].content == "hi"


def test_a_lone_surrogate_is_a_clear_error_not_a_crash() -> None:
    # FastAPI parses with json.loads, which takes the escape (pydantic's own parser would not)
    body = ChatCompletionRequest.model_validate(
        json.loads(r'{"messages": [{"role": "user", "content": "a\ud800"}]}')
    )
    with pytest.raises(InvalidArgument, match="lone surrogate"):
        generate_request(body)


def test_reasoning_comes_apart_from_the_answer_in_messages_chunks_and_usage() -> None:
    served = Served.of(HEADER)
    first = P.GenerateResponse(reasoning_text="7+8=15")
    first.MergeFrom(HEADER)
    last = P.GenerateResponse(
        text="15", finish_reason=P.FINISH_REASON_STOP,
        usage=P.Usage(prompt_tokens=5, completion_tokens=9, reasoning_tokens=6, cached_tokens=4),
    )  # fmt: skip
    whole = completion(ChatShape, served, [[first, last]])
    assert whole["choices"][0]["message"] == {
        "role": "assistant",
        "content": "15",
        "reasoning_content": "7+8=15",
    }
    assert (
        whole["choices"][0]["finish_reason"] == "stop" and whole["system_fingerprint"] == "chat/3@challenger"
    )
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                              "prompt_tokens_details": {"cached_tokens": 4},
                              "completion_tokens_details": {"reasoning_tokens": 6}}  # fmt: skip
    events = [chunk(ChatShape, served, first, True, True), chunk(ChatShape, served, last, False, True)]
    deltas = [json.loads(e.removeprefix("data: ")) for e in events]
    assert [d["choices"][0]["delta"] for d in deltas] == [
        {"role": "assistant", "content": "", "reasoning_content": "7+8=15"}, {"content": "15"},
    ]  # fmt: skip
    assert [d["usage"] for d in deltas] == [None, None]
    assert (
        json.loads(usage_chunk(ChatShape, served, [last]).removeprefix("data: "))["usage"]["total_tokens"]
        == 14
    )
    text = completion(TextShape, served, [[first, last]])
    assert (text["object"], text["choices"][0]["text"], text["choices"][0]["reasoning_content"]) == (
        "text_completion", "15", "7+8=15",
    )  # fmt: skip
    assert Served.of(P.GenerateResponse(model="chat", model_version="3")).fingerprint == "chat/3"  # pinned


def test_max_tokens_0_with_echo_asks_for_the_prompt_only() -> None:
    scored = generate_request(
        CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 1})
    )
    assert scored.prompt_only and scored.prompt_logprobs
    assert not generate_request(
        CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 1})
    ).prompt_only
    with pytest.raises(InvalidArgument) as nothing:
        generate_request(CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 0}))
    assert nothing.value.param == "max_tokens"


def test_several_choices_each_have_their_index_and_request_id_and_count_the_prompt_once() -> None:
    served = Served.of(HEADER)
    choices = []
    for request_id, text, completion_tokens, cached in (("r1", "red", 2, 0), ("r2", "blue", 3, 16)):
        # the second reused the first one's prompt
        first = P.GenerateResponse(text=text[:1])
        first.MergeFrom(HEADER)
        first.request_id = request_id
        last = P.GenerateResponse(
            text=text[1:], finish_reason=P.FINISH_REASON_STOP,
            usage=P.Usage(prompt_tokens=20, completion_tokens=completion_tokens, reasoning_tokens=1,
                          cached_tokens=cached),
        )  # fmt: skip
        choices.append([first, last])
    whole = completion(ChatShape, served, choices)
    assert [(c["index"], c["request_id"], c["message"]["content"]) for c in whole["choices"]] == [
        (0, "r1", "red"), (1, "r2", "blue"),
    ]  # fmt: skip
    assert whole["usage"] == {
        "prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,  # the prompt once
        "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 2},
    }  # fmt: skip
    second = [
        json.loads(chunk(TextShape, served, m, i == 0, False, index=1)[6:]) for i, m in enumerate(choices[1])
    ]
    assert [c["choices"][0]["index"] for c in second] == [1, 1]
    assert [c["choices"][0].get("request_id") for c in second] == ["r2", None]  # named in its first chunk


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"best_of": 2, "n": 3}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"best_of": 3, "max_tokens": 0, "echo": True}, "best_of"),
    ],
)
def test_best_of_is_refused_where_it_cannot_rank(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        generate_request(CompletionRequest.model_validate({"prompt": "hi"} | fields))
    assert refused.value.param == param


def test_how_many_choices_are_generated_and_returned() -> None:
    assert choice_counts(chat()) == (1, 1)
    assert choice_counts(chat(n=8)) == (8, 8)
    assert choice_counts(CompletionRequest(prompt="hi", n=2, best_of=5)) == (2, 5)
    assert choice_counts(CompletionRequest(prompt="hi", best_of=2, stream=True, n=2)) == (2, 2)  # not ranked
    generate_request(CompletionRequest(prompt="hi", best_of=2, stream=True, n=2))  # so it may stream
    for fields in ({"n": 0}, {"n": 9}):
        with pytest.raises(ValidationError, match="n"):
            chat(**fields)
    with pytest.raises(ValidationError, match="best_of"):
        CompletionRequest.model_validate({"prompt": "hi", "best_of": 9})
