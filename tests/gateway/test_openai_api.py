"""The OpenAI-compatible HTTP face, driven by the real `openai` SDK (sync and async, streamed and
whole), curl and httpx, against a gateway and in-process workers: the same answers, usage, quotas
and feedback as the gRPC face, and each error as the status and SDK exception users expect."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import shutil
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pydantic
import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from sqlalchemy import Engine

from feedback.intake.stats import store_counts
from feedback.tasks.task import Example
from feedback.training.dataset import load_new
from gateway.tenants import create_tenant
from reflow.settings import Settings
from reflow.store.database import open_db
from reflow.v1 import inference_pb2
from tests.support.hf import transformers
from tests.support.kafka import Broker, consuming
from tests.support.registry import local_registry
from tests.support.stack import Stack, generate, held_stream, request, start_stack, stop_stack
from tests.support.waiting import eventually, wait_for

P = inference_pb2
CHAT = "chat"
QWEN = "qwen"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 16}


def client(stack: Stack, api_key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=api_key or stack.api_key, max_retries=0)


def async_client(stack: Stack, api_key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{stack.http_url}/v1", api_key=api_key or stack.api_key, max_retries=0
    )


def grpc_chat(**sampling: object) -> P.GenerateRequest:
    """The gRPC request asking what CONVERSATION with `sampling` asks over HTTP."""
    return P.GenerateRequest(
        model=CHAT,
        messages=[P.ChatMessage(**m) for m in CONVERSATION],
        sampling=P.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


@contextlib.asynccontextmanager
async def serving(settings: Settings, checkpoint: Path, tmp_path: Path, name: str) -> AsyncIterator[Stack]:
    """A gateway in front of a worker serving `checkpoint` as `name` v1 @champion."""
    registry = local_registry(tmp_path, f"{name}-registry")
    registry.register(name, checkpoint, params={}, metrics={}, alias="champion")
    model_settings = settings.model_copy(
        update={"mlflow_tracking_uri": registry.tracking_uri, "mlflow_artifact_root": registry.artifact_root,
                "model_name": name}
    )  # fmt: skip
    stack = await start_stack(model_settings, model=name)
    try:
        yield stack
    finally:
        await stop_stack(stack)


@pytest.fixture
async def chat_stack(settings: Settings, chat_checkpoint: Path, tmp_path: Path) -> AsyncIterator[Stack]:
    """The chat model (SmolLM2's tokenizer and template, which takes no tools) as `chat`."""
    async with serving(settings, chat_checkpoint, tmp_path, CHAT) as stack:
        yield stack


@pytest.fixture
async def qwen_stack(settings: Settings, qwen3_checkpoint: Path, tmp_path: Path) -> AsyncIterator[Stack]:
    """A tiny Qwen3 whose template takes tools as `qwen`."""
    async with serving(settings, qwen3_checkpoint, tmp_path, QWEN) as stack:
        yield stack


async def test_a_chat_completion_is_the_grpc_answer_with_its_usage_and_where_it_ran(
    chat_stack: Stack,
) -> None:
    answer = await generate(chat_stack, grpc_chat(**SAMPLED))
    sdk = client(chat_stack)
    raw = await asyncio.to_thread(
        sdk.chat.completions.with_raw_response.create,
        model=CHAT,
        messages=CONVERSATION,
        user="u42",
        **SAMPLED,
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == "".join(m.text for m in answer)
    assert completion.choices[0].finish_reason == "length"
    usage = answer[-1].usage
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
        usage.prompt_tokens, usage.completion_tokens,
    )  # fmt: skip
    assert completion.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert completion.usage.completion_tokens_details.reasoning_tokens == 0
    assert len(completion.id) == 48 and raw.headers["x-request-id"] == completion.id
    assert (raw.headers["x-reflow-model-version"], raw.headers["x-reflow-arm"]) == ("1", "champion")
    assert completion.system_fingerprint == "chat/1@champion" and completion.model == CHAT
    pinned = await asyncio.to_thread(
        sdk.chat.completions.create, model="chat/1", messages=CONVERSATION, **SAMPLED
    )
    assert pinned.system_fingerprint == "chat/1" and pinned.choices[0].message.content == (
        completion.choices[0].message.content
    )


async def test_a_streamed_chat_completion_with_usage_gives_the_same_text_and_counts(
    chat_stack: Stack,
) -> None:
    answer = await generate(chat_stack, grpc_chat(**SAMPLED))
    sdk = async_client(chat_stack)
    stream = await sdk.chat.completions.create(
        model=CHAT, messages=CONVERSATION, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )
    chunks = [chunk async for chunk in stream]
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == "".join(m.text for m in answer)
    assert [c.choices[0].finish_reason for c in deltas][-1] == "length"
    assert all(c.usage is None for c in deltas) and last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        answer[-1].usage.prompt_tokens, answer[-1].usage.completion_tokens,
    )  # fmt: skip
    assert len({c.id for c in chunks}) == 1 and len(deltas) > 1  # streamed, not sent whole
    await sdk.close()


async def test_logprobs_come_with_each_token_whole_and_streamed_and_equal_the_grpc_ones(
    chat_stack: Stack,
) -> None:
    greedy = {"max_tokens": 8, "temperature": 0}
    asked = grpc_chat(**greedy)
    asked.logprobs, asked.top_logprobs = True, 3
    answer = await generate(chat_stack, asked)
    tokens = [entry for m in answer for entry in m.logprobs]
    assert len(tokens) == answer[-1].usage.completion_tokens > 0
    for e in tokens:  # greedy: the token is the likeliest, and the alternatives come likeliest first
        likelihoods = [t.logprob for t in e.top_logprobs]
        assert likelihoods == sorted(likelihoods, reverse=True) and len(likelihoods) == 3
        assert e.top_logprobs[0].token_id == e.token_id and e.logprob == likelihoods[0]
    sdk = async_client(chat_stack)
    whole = await sdk.chat.completions.create(
        model=CHAT, messages=CONVERSATION, logprobs=True, top_logprobs=3, **greedy
    )
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [(c.token, c.logprob) for c in content] == [(e.token, pytest.approx(e.logprob)) for e in tokens]
    assert [[t.token for t in c.top_logprobs] for c in content] == [
        [t.token for t in e.top_logprobs] for e in tokens
    ]
    stream = await sdk.chat.completions.create(
        model=CHAT, messages=CONVERSATION, logprobs=True, top_logprobs=3, stream=True, **greedy
    )
    streamed = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    plain = await sdk.chat.completions.create(model=CHAT, messages=CONVERSATION, **greedy)
    assert plain.choices[0].logprobs is None
    text = await sdk.completions.create(model=CHAT, prompt="Hello there", logprobs=2, **greedy)
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.text_offset
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == text.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(top) <= 2 for top in logprobs.top_logprobs or [])  # two tokens may decode alike
    assert logprobs.text_offset == list(
        itertools.accumulate((len(t) for t in logprobs.tokens[:-1]), initial=0)
    )
    echoed = await sdk.completions.create(model=CHAT, prompt="Hello there", logprobs=1, echo=True, **greedy)
    echo = echoed.choices[0].logprobs
    assert echoed.choices[0].text == "Hello there" + text.choices[0].text
    assert echo is not None and echo.tokens and echo.token_logprobs and echo.top_logprobs
    assert len(echo.tokens) == echoed.usage.prompt_tokens + echoed.usage.completion_tokens  # type: ignore[union-attr]
    assert echo.token_logprobs[0] is None and echo.top_logprobs[0] is None  # nothing predicts the first
    assert all(isinstance(p, float) for p in echo.token_logprobs[1:])
    assert echo.token_logprobs[-len(logprobs.token_logprobs) :] == pytest.approx(logprobs.token_logprobs)
    scored = await sdk.completions.create(
        model=CHAT, prompt="Hello there", logprobs=1, echo=True, temperature=0, max_tokens=0
    )  # the prompt only, as evaluation harnesses score a text
    [only] = scored.choices
    assert (only.text, only.finish_reason, scored.usage and scored.usage.completion_tokens) == (
        "Hello there",
        "length",
        0,
    )
    prompt_tokens = echoed.usage.prompt_tokens  # type: ignore[union-attr]
    assert only.logprobs is not None and only.logprobs.tokens == echo.tokens[:prompt_tokens]
    assert only.logprobs.token_logprobs[0] is None
    assert only.logprobs.token_logprobs[1:] == pytest.approx(echo.token_logprobs[1:prompt_tokens])
    with pytest.raises(openai.BadRequestError) as nothing:
        await sdk.completions.create(model=CHAT, prompt="Hello there", max_tokens=0)
    assert nothing.value.param == "max_tokens"
    plain_echo = await sdk.completions.create(model=CHAT, prompt="Hello there", echo=True, **greedy)
    assert plain_echo.choices[0].text == echoed.choices[0].text and plain_echo.choices[0].logprobs is None
    for refused in ({"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as error:
            await sdk.chat.completions.create(model=CHAT, messages=CONVERSATION, **refused, **greedy)  # type: ignore[call-overload]
        assert error.value.body["param"] == "top_logprobs"  # type: ignore[index]
    await sdk.close()


async def test_text_completions_stream_and_not_with_reasoning_apart(stack: Stack) -> None:
    answer = await generate(stack, request("47+38=", max_tokens=24))
    text, reasoning = "".join(m.text for m in answer), "".join(m.reasoning_text for m in answer)
    whole = await asyncio.to_thread(
        client(stack).completions.create, model="arith", prompt="47+38=", max_tokens=24, temperature=0
    )
    assert whole.choices[0].text == text
    assert (whole.choices[0].model_extra or {}).get("reasoning_content", "") == reasoning
    assert whole.usage.completion_tokens_details.reasoning_tokens == answer[-1].usage.reasoning_tokens
    sdk = async_client(stack)
    stream = await sdk.completions.create(
        model="arith", prompt=["47+38="], max_tokens=24, temperature=0, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks) == text
    assert "".join((c.choices[0].model_extra or {}).get("reasoning_content", "") for c in chunks) == reasoning
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].usage is None
    await sdk.close()


async def test_a_logit_bias_and_penalties_reach_the_model_and_bad_ones_are_refused_by_name(
    stack: Stack,
) -> None:
    sdk = client(stack)
    ask = {"model": "arith", "prompt": "47+38=", "max_tokens": 6, "temperature": 0}
    five = await asyncio.to_thread(sdk.completions.create, **ask, logit_bias={"53": 100})  # the byte "5"
    assert five.choices[0].text == "555555" and five.usage.completion_tokens == 6
    plain = await asyncio.to_thread(sdk.completions.create, **ask)
    repeated = await asyncio.to_thread(
        sdk.completions.create, **ask, logit_bias={"53": 100}, frequency_penalty=2,
        extra_body={"repetition_penalty": 10},
    )  # fmt: skip
    assert repeated.choices[0].text != five.choices[0].text  # a "5" is penalised once it has been said
    with pytest.raises(openai.BadRequestError) as refused:
        await asyncio.to_thread(sdk.completions.create, **ask, presence_penalty=2.5)
    assert refused.value.body["param"] == "presence_penalty"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        await asyncio.to_thread(sdk.completions.create, **ask, logit_bias={"9999999": 1})
    assert "sampling.logit_bias holds 9999999, past the vocabulary of arith/1" in refused.value.message
    assert plain.choices[0].text != five.choices[0].text


async def test_curl_shows_the_stream_as_a_person_reads_it(stack: Stack) -> None:
    if shutil.which("curl") is None:
        pytest.skip("needs curl")
    body = json.dumps(
        {"model": "arith", "prompt": "12+30=", "max_tokens": 8, "temperature": 0, "stream": True}
    )
    command = ["curl", "-N", "-sS", f"{stack.http_url}/v1/completions",
               "-H", "content-type: application/json", "-H", f"authorization: Bearer {stack.api_key}",
               "-d", body]  # fmt: skip
    shown = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60)
    events = [line for line in shown.stdout.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    expected = "".join(m.text for m in await generate(stack, request("12+30=", max_tokens=8)))
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected


async def test_models_list_every_id_a_request_may_name(stack: Stack) -> None:
    sdk = async_client(stack)
    models = {m.id: m for m in (await sdk.models.list()).data}
    assert set(models) == {"arith", "arith/1", "arith@champion"}
    assert (models["arith@champion"].model_extra or {})["version"] == "1"
    assert (await sdk.models.retrieve("arith/1")).id == "arith/1"
    with pytest.raises(openai.NotFoundError):
        await sdk.models.retrieve("arith/7")
    await sdk.close()


class Colour(pydantic.BaseModel):
    """What a client asks the model for: bounded, so that even a random model's answer ends."""

    name: str = pydantic.Field(max_length=12)
    red: int = pydantic.Field(ge=0, le=255)
    warm: bool


async def test_structured_outputs_hold_the_text_to_a_schema_a_pattern_or_a_choice(chat_stack: Stack) -> None:
    sdk = async_client(chat_stack)
    greedy = {"max_tokens": 64, "temperature": 0}
    parsed = await sdk.chat.completions.parse(
        model=CHAT, messages=CONVERSATION, response_format=Colour, **greedy
    )
    [choice] = parsed.choices
    assert isinstance(choice.message.parsed, Colour) and choice.finish_reason == "stop"
    free = await sdk.chat.completions.create(model=CHAT, messages=CONVERSATION, **greedy)
    with pytest.raises(ValueError):  # the tiny random model, free, writes no JSON at all
        json.loads(free.choices[0].message.content or "")
    stream = await sdk.chat.completions.create(
        model=CHAT, messages=CONVERSATION, stream=True, response_format=openai_format(Colour), **greedy
    )
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == choice.message.content
    held = grpc_chat(max_tokens=64)
    held.structured_output.regex = "[0-9]{3}-[a-z]{2}"
    over_grpc = "".join(m.text for m in await generate(chat_stack, held))
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", over_grpc)
    texts = ["yes", "no", 'maybe "so"']
    text = await sdk.completions.create(
        model=CHAT, prompt="Is it warm?", extra_body={"structured_outputs": {"choice": texts}}, **greedy
    )
    assert text.choices[0].text in texts
    pattern = {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}
    text = await sdk.completions.create(model=CHAT, prompt="Hi", extra_body=pattern, **greedy)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text.choices[0].text)
    json_object = await sdk.completions.create(
        model=CHAT, prompt="Hi", extra_body={"response_format": {"type": "json_object"}}, **greedy
    )  # vLLM takes it on text completions too
    assert json_object.choices[0].text.startswith("{")
    await sdk.close()


def openai_format(model: type[pydantic.BaseModel]) -> dict[str, object]:
    """`response_format` as the SDK sends it for `model` (a strict JSON Schema)."""
    return type_to_response_format_param(model)  # type: ignore[return-value]


def request_id_of(choice: pydantic.BaseModel) -> str:
    """A choice's own request id (reflow's field beside OpenAI's, kept by the SDK as an extra)."""
    return str((choice.model_extra or {})["request_id"])


async def test_n_choices_are_the_seeded_requests_reusing_the_prompts_blocks_with_it_counted_once(
    chat_stack: Stack,
) -> None:
    sdk = async_client(chat_stack)
    conversation = [{"role": "system", "content": "Answer in one word. " * 12}, *CONVERSATION[1:]]
    metrics = chat_stack.workers[0].engine.metrics
    assert metrics is not None
    reused_before = metrics.cached_prompt_tokens._value.get()
    raw = await sdk.chat.completions.with_raw_response.create(
        model=CHAT, messages=conversation, n=4, **SAMPLED
    )
    several = raw.parse()
    block = chat_stack.pool.workers[0].loaded[0].kv_block_size
    prompt = several.usage.prompt_tokens
    assert prompt > 2 * block
    # the first choice prefilled the prompt; the other three found its full blocks in the prefix cache
    assert metrics.cached_prompt_tokens._value.get() - reused_before == 3 * ((prompt - 1) // block * block)
    ids = [request_id_of(c) for c in several.choices]
    assert [c.index for c in several.choices] == [0, 1, 2, 3] and len(set(ids)) == 4
    assert several.id == ids[0] == raw.headers["x-request-id"]
    alone = [
        await sdk.chat.completions.create(
            model=CHAT, messages=conversation, **SAMPLED | {"seed": SAMPLED["seed"] + i}
        )
        for i in range(4)
    ]
    assert [c.message.content for c in several.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in several.choices}) > 1  # sampled with seeds of their own
    assert (several.usage.prompt_tokens, several.usage.completion_tokens) == (
        alone[0].usage.prompt_tokens, sum(a.usage.completion_tokens for a in alone),
    )  # fmt: skip
    streamed = await sdk.chat.completions.create(
        model=CHAT, messages=conversation, n=4, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )
    texts, named = ["", "", "", ""], [None] * 4
    async for chunk in streamed:
        if not chunk.choices:
            assert (
                chunk.usage is not None and chunk.usage.completion_tokens == several.usage.completion_tokens
            )
            continue
        [choice] = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        named[choice.index] = named[choice.index] or (choice.model_extra or {}).get("request_id")
    assert texts == [c.message.content for c in several.choices]
    assert None not in named and len(set(named)) == 4
    await sdk.close()


async def test_best_of_returns_the_completion_with_the_highest_mean_logprob_per_token(stack: Stack) -> None:
    sdk = async_client(stack)
    asked = {"model": "arith", "prompt": "47+38=", "temperature": 1.0, "max_tokens": 6}
    best = await sdk.completions.create(**asked, best_of=3, seed=7)  # type: ignore[call-overload]
    alone = [await sdk.completions.create(**asked, seed=7 + i, logprobs=0) for i in range(3)]  # type: ignore[call-overload]
    mean = [
        sum(c.choices[0].logprobs.token_logprobs) / len(c.choices[0].logprobs.token_logprobs) for c in alone
    ]
    assert len(best.choices) == 1 and best.choices[0].text == alone[mean.index(max(mean))].choices[0].text
    assert best.choices[0].logprobs is None  # ranked by them, shown only when asked for
    assert best.usage is not None and best.usage.completion_tokens == sum(
        c.usage.completion_tokens for c in alone if c.usage
    )  # every completion generated counts
    assert best.id == request_id_of(best.choices[0])  # rating the completion rates the one shown
    two = await sdk.completions.create(**asked, best_of=3, n=2, seed=7, logprobs=0)  # type: ignore[call-overload]
    ranked = sorted(mean, reverse=True)[:2]
    assert [
        sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in two.choices
    ] == pytest.approx(ranked)
    await sdk.close()


async def test_a_format_that_cannot_be_enforced_is_refused_naming_it(chat_stack: Stack) -> None:
    sdk = async_client(chat_stack)
    unique = {
        "type": "json_schema",
        "json_schema": {"name": "tags", "schema": {"type": "array", "uniqueItems": True}},
    }
    refusals = [
        ({"response_format": unique}, "response_format.json_schema.schema", "uniqueItems"),
        ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex", "unclosed"),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
            "structured_outputs",
            "one of",
        ),
        (
            {
                "response_format": {"type": "json_object"},
                "extra_body": {"structured_outputs": {"regex": "a"}},
            },
            "structured_outputs",
            "not both",
        ),
    ]
    for ask, param, reason in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.chat.completions.create(model=CHAT, messages=CONVERSATION, **ask)  # type: ignore[call-overload]
        assert refused.value.param == param and reason in refused.value.message, ask
    bad = grpc_chat()
    bad.structured_output.json_schema = json.dumps({"not": {"type": "string"}})
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(chat_stack, bad)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'structured_output.json_schema cannot be enforced: Unimplemented keys: ["not"]' in (
        error.value.details() or ""
    )
    unknown = grpc_chat()  # a grammar only the model's vocabulary can refuse: the worker's check
    unknown.structured_output.grammar = "start: <|no_such_token|>"
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(chat_stack, unknown)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'unknown special token: "<|no_such_token|>"' in (error.value.details() or "")
    await sdk.close()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}  # no arguments
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]


async def test_a_tool_call_streams_its_name_first_and_round_trips_with_its_result(
    qwen_stack: Stack, qwen3_checkpoint: Path
) -> None:
    sdk = async_client(qwen_stack)
    ask = {"model": QWEN, "messages": ASKED, "tools": [WEATHER, CLOCK], "max_tokens": 64, "temperature": 0}
    stream = await sdk.chat.completions.create(**ask, tool_choice="required", stream=True)  # type: ignore[call-overload]
    chunks = [chunk async for chunk in stream]
    pieces = [piece for c in chunks for piece in c.choices[0].delta.tool_calls or []]
    first = pieces[0]
    assert (
        first.id
        and first.type == "function"
        and first.function
        and first.function.name in ("get_weather", "get_time")
    )
    later = [p for p in pieces[1:] if p.index == first.index]
    assert all(p.id is None and p.function and p.function.name is None for p in later)
    arguments = json.loads("".join(p.function.arguments or "" for p in [first, *later] if p.function))
    assert isinstance(arguments, dict)  # whole: the next call, if any, starts after it
    assert chunks[-1].choices[0].finish_reason in ("tool_calls", "length")  # a random model may go on calling
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = await sdk.chat.completions.create(**ask, tool_choice=named)  # type: ignore[call-overload]
    [choice] = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}
    conversation = [*ASKED, choice.message.model_dump(exclude_none=True), result]
    answer = await sdk.chat.completions.create(**{**ask, "messages": conversation, "max_tokens": 4})  # type: ignore[call-overload]
    # the prompt it answered is the conversation as transformers renders it, tools, call and result
    arguments = json.loads(call.function.arguments)  # as a chat template takes them: an object
    called = {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    rendered = [*ASKED, {"role": "assistant", "content": "", "tool_calls": [called]}, result]
    tokenizer = transformers().AutoTokenizer.from_pretrained(qwen3_checkpoint)
    expected = tokenizer.apply_chat_template(
        rendered, tools=[WEATHER, CLOCK], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert answer.usage is not None and answer.usage.prompt_tokens == len(expected)
    over_grpc = P.GenerateRequest(
        model=QWEN, messages=[P.ChatMessage(**m) for m in ASKED], tools=[P.Tool(name="get_time")],
        tool_choice=P.ToolChoice(mode="function", function="get_time"),
        sampling=P.SamplingParams(max_tokens=48),
    )  # fmt: skip
    messages = await generate(qwen_stack, over_grpc)
    first, *rest = [piece for m in messages for piece in m.tool_calls]
    assert (
        (first.index, first.name) == (0, "get_time") and first.id and not any(p.id or p.index for p in rest)
    )
    assert first.arguments + "".join(p.arguments for p in rest) == "{}"  # no parameters: no arguments
    assert messages[-1].finish_reason == P.FINISH_REASON_TOOL_CALLS
    await sdk.close()


async def test_tools_on_a_model_whose_template_takes_none_are_refused(chat_stack: Stack) -> None:
    sdk = async_client(chat_stack)
    with pytest.raises(openai.BadRequestError, match="chat template takes no tools"):
        await sdk.chat.completions.create(model=CHAT, messages=ASKED, tools=[CLOCK])  # type: ignore[list-item]
    plain = await sdk.chat.completions.create(
        model=CHAT, messages=ASKED, tools=[CLOCK], tool_choice="none", max_tokens=2
    )  # type: ignore[list-item]
    assert plain.choices[0].message.tool_calls is None  # "none": the model is shown no tools
    await sdk.close()


async def test_each_error_has_its_status_and_the_sdks_exception(stack: Stack) -> None:
    sdk = async_client(stack)
    complete = sdk.completions.create
    with pytest.raises(openai.AuthenticationError) as unauthenticated:
        await async_client(stack, api_key="not-a-key-0123456789").completions.create(
            model="arith", prompt="1+1="
        )
    assert unauthenticated.value.body["type"] == "authentication_error"  # type: ignore[index]
    refused = {
        "n": {"n": 9}, "logprobs": {"logprobs": 21}, "best_of": {"best_of": 2, "n": 3},
        "temperature": {"temperature": -1}, "max_tokens": {"max_tokens": 0},
    }  # fmt: skip
    for param, ask in refused.items():
        with pytest.raises(openai.BadRequestError) as bad:
            await complete(model="arith", prompt="1+1=", **ask)  # type: ignore[arg-type]
        assert bad.value.param == param, ask
    with pytest.raises(openai.BadRequestError, match="functions"):
        await sdk.chat.completions.create(
            model="arith", messages=[{"role": "user", "content": "hi"}],
            functions=[{"name": "f", "parameters": {}}],
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="temperature must be 0"):  # reflow's own check
        await complete(model="arith", prompt="1+1=", temperature=0.001)
    with pytest.raises(openai.BadRequestError, match="no chat template"):  # the worker's, before a token
        await sdk.chat.completions.create(model="arith", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="no worker serves model gpt-4o"):
        await complete(model="gpt-4o", prompt="1+1=")
    with pytest.raises(openai.InternalServerError) as late:
        await complete(model="arith", prompt="1+1=", max_tokens=60, extra_body={"latency_budget_ms": 1})
    assert late.value.status_code == 504
    assert late.value.response.headers["x-should-retry"] == "false"  # it would run out again
    await sdk.close()


async def test_the_stream_quota_is_shared_by_both_faces(settings: Settings) -> None:
    stack = await start_stack(settings, max_concurrent_streams=1)
    try:
        with pytest.raises(openai.BadRequestError, match="may hold 1 concurrent streams") as many:
            await async_client(stack).completions.create(model="arith", prompt="1+1=", n=2)  # never fits
        assert many.value.param == "n"
        async with held_stream(stack):  # a gRPC stream holds the tenant's one slot
            with pytest.raises(openai.RateLimitError, match="its 1 concurrent streams"):
                await async_client(stack).completions.create(model="arith", prompt="1+1=")
    finally:
        await stop_stack(stack)


async def test_a_rate_limited_request_says_when_to_retry(settings: Settings) -> None:
    stack = await start_stack(settings, requests_per_minute=1)
    try:
        sdk = async_client(stack)
        await sdk.completions.create(model="arith", prompt="1+1=", max_tokens=2)
        with pytest.raises(openai.RateLimitError) as limited:
            await sdk.completions.create(model="arith", prompt="1+1=", max_tokens=2)
        assert int(limited.value.response.headers["retry-after"]) >= 1
        await sdk.close()
    finally:
        await stop_stack(stack)


async def test_no_worker_is_503_and_health_says_so(settings: Settings) -> None:
    stack = await start_stack(settings, n_workers=0, extra_addresses=("127.0.0.1:1",))
    try:
        with pytest.raises(openai.InternalServerError) as unavailable:
            await async_client(stack).completions.create(model="arith", prompt="1+1=")
        assert unavailable.value.status_code == 503
        async with httpx.AsyncClient(base_url=stack.http_url) as http:
            health = await http.get("/health")
        assert (health.status_code, health.json()["status"]) == (503, "not serving")
    finally:
        await stop_stack(stack)


def generated_tokens(stack: Stack) -> float:
    """Tokens the stack's worker has generated so far."""
    metrics = stack.workers[0].engine.metrics
    assert metrics is not None
    return metrics.tokens._value.get()


@pytest.mark.parametrize(("stream", "n"), [(True, 1), (False, 1), (True, 3), (False, 3)])
async def test_a_client_gone_mid_completion_frees_its_sequences(stack: Stack, stream: bool, n: int) -> None:
    engine = stack.workers[0].engine
    longest = stack.pool.workers[0].loaded[0].max_sequence_length - 8  # room for the prompt
    body = {
        "model": "arith",
        "prompt": "47+38=",
        "max_tokens": longest,
        "temperature": 0,
        "stream": stream,
        "n": n,
    }
    headers = {"authorization": f"Bearer {stack.api_key}"}
    async with httpx.AsyncClient(base_url=stack.http_url, headers=headers, timeout=60) as http:
        before = generated_tokens(stack)
        whole = (await http.post("/v1/completions", json={**body, "stream": False})).json()
        tokens = whole["usage"]["completion_tokens"]
        assert generated_tokens(stack) - before == tokens > 40 * n  # what a request run to its end costs
        before = generated_tokens(stack)
        if stream:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                await anext(response.aiter_lines())
                assert engine.running == n  # every choice began before the response did
        else:
            posting = asyncio.create_task(http.post("/v1/completions", json=body))
            await eventually(lambda: engine.running == n, what="the sequences to start")
            posting.cancel()  # httpx closes the connection
    await eventually(lambda: engine.running == 0, what="the worker to drop the sequence")
    assert generated_tokens(stack) - before < tokens / 2  # cut short, not run to its end
    await eventually(lambda: stack.metrics.in_flight._value.get() == 0, what="the relay to end")
    again = await async_client(stack).completions.create(model="arith", prompt="1+1=", max_tokens=2)
    assert again.choices[0].finish_reason in ("stop", "length")


async def test_a_client_gone_before_its_first_token_frees_its_place_and_its_quota(settings: Settings) -> None:
    stack = await start_stack(settings, max_concurrent_streams=1)
    engine = stack.workers[0].engine
    headers = {"authorization": f"Bearer {stack.api_key}"}
    body = {"model": "arith", "prompt": "47+38=", "max_tokens": 8, "temperature": 0}
    release = threading.Event()
    stalled = asyncio.create_task(asyncio.to_thread(engine.run, release.wait))  # no step runs meanwhile
    try:
        async with httpx.AsyncClient(base_url=stack.http_url, headers=headers, timeout=60) as http:
            queued = asyncio.create_task(http.post("/v1/completions", json=body))
            await eventually(lambda: engine.waiting == 1, what="the request to queue at the worker")
            queued.cancel()  # gone before its first token, holding the tenant's only stream
            await eventually(lambda: stack.metrics.in_flight._value.get() == 0, what="the relay to end")
            answered = asyncio.create_task(http.post("/v1/completions", json=body))
            # the one gone is dropped at the engine's next step
            await eventually(lambda: engine.waiting == 2, what="the next request to queue")
            before = generated_tokens(stack)
            release.set()
            reply = await answered
        assert reply.status_code == 200  # the slot was free: not a 429
        await eventually(lambda: engine.waiting == engine.running == 0, what="the queue to empty")
        assert generated_tokens(stack) - before == reply.json()["usage"]["completion_tokens"]  # none for it
    finally:
        release.set()
        await stalled
        await stop_stack(stack)


async def test_bodies_that_would_cost_memory_or_a_crash_are_refused(stack: Stack) -> None:
    headers = {"authorization": f"Bearer {stack.api_key}", "content-type": "application/x-ndjson"}
    nested = "[" * 100_000 + "]" * 100_000
    async with httpx.AsyncClient(base_url=stack.http_url, headers=headers, timeout=60) as http:
        huge = await http.post("/v1/chat/completions", content=b" " * (17 * 2**20))
        json_nested = await http.post(
            "/v1/feedback", content=nested, headers={"content-type": "application/json"}
        )
        line_nested = await http.post("/v1/feedback", content=nested + "\n")
    assert huge.status_code == 413  # whatever content type it claims
    assert json_nested.status_code == 400 and "too deeply" in json_nested.json()["error"]["message"]
    assert line_nested.status_code == 400 and "too deeply" in line_nested.json()["error"]["message"]


async def test_health_and_the_openapi_document(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.http_url) as http:
        health = await http.get("/health")
        document = (await http.get("/openapi.json")).json()
        missing = await http.get("/v1/nothing-here")
    assert (health.status_code, health.json()) == (200, {"status": "serving", "detail": "serving arith"})
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/feedback", "/health"} <= set(
        document["paths"]
    )
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


@pytest.fixture
def store_consumer(stack: Stack, kafka: Broker) -> Iterator[Engine]:
    db = open_db(stack.settings.resolved_database_url)
    with consuming(kafka.bootstrap, db):
        yield db


async def test_feedback_in_each_body_form_lands_once_also_when_sent_twice(
    stack: Stack, store_consumer: Engine
) -> None:
    sdk = async_client(stack)
    ids = [(await sdk.completions.create(model="arith", prompt=f"{i}+1=", max_tokens=4)).id for i in range(4)]
    one = {"feedback_id": "fb-one", "request_id": ids[0], "rating": 1}
    array = [{"request_id": ids[1], "rating": -1, "correction": "2"}, {"request_id": ids[2], "rating": 0}]
    lines = "\n".join(json.dumps({"request_id": ids[3], "rating": r, "user_id": "u"}) for r in (1, -1)) + "\n"
    headers = {"authorization": f"Bearer {stack.api_key}"}
    async with httpx.AsyncClient(base_url=stack.http_url, headers=headers) as http:
        for _ in range(2):
            acks = [
                (await http.post("/v1/feedback", json=one)).json(),
                (await http.post("/v1/feedback", json=array)).json(),
                (await http.post("/v1/feedback", content=lines,
                                 headers={"content-type": "application/x-ndjson"})).json(),
            ]  # fmt: skip
            assert [(a["accepted"], a["rejected"]) for a in acks] == [(1, 0), (2, 0), (2, 0)]
        mixed = await http.post(
            "/v1/feedback", content=f'{{"request_id": "{ids[0]}", "rating": 7}}\nnot json\n[1]\n',
            headers={"content-type": "application/x-ndjson"},
        )  # fmt: skip
    assert mixed.status_code == 400 and "item 0: rating" in mixed.json()["error"]["message"]
    everything = {"inferences": 4, "feedback": 5, "joined_feedback": 5}
    await asyncio.to_thread(
        wait_for, lambda: store_counts(store_consumer) == everything, 60, "the feedback rows"
    )
    await sdk.close()


async def test_the_choice_a_user_kept_over_another_becomes_a_preference_pair_to_train_on(
    stack: Stack, store_consumer: Engine
) -> None:
    sdk = async_client(stack)
    two = await sdk.completions.create(
        model="arith", prompt="47+38=", n=2, temperature=1.0, seed=3, max_tokens=4
    )
    kept, other = (request_id_of(c) for c in reversed(two.choices))
    ack = await sdk.post(
        "/feedback", body={"request_id": kept, "preferred_over": other}, cast_to=httpx.Response
    )
    assert ack.json()["accepted"] == 1
    await asyncio.to_thread(
        wait_for, lambda: store_counts(store_consumer)["joined_feedback"] == 1, 60, "the preference"
    )
    [item] = load_new(store_consumer, "arith", limit=10)
    assert (item.completion, item.preferred_over) == (
        two.choices[1].text, Example("47+38=", None, two.choices[0].text),
    )  # fmt: skip
    await sdk.close()


async def test_feedback_on_another_tenants_completion_is_403_and_rejected_items_are_listed(
    stack: Stack,
) -> None:
    db = open_db(stack.settings.resolved_database_url)
    _, other_key = create_tenant(db, "globex")
    theirs = (
        await async_client(stack, other_key).completions.create(model="arith", prompt="1+1=", max_tokens=2)
    ).id
    mine = (await async_client(stack).completions.create(model="arith", prompt="1+1=", max_tokens=2)).id
    sdk = async_client(stack)
    with pytest.raises(openai.PermissionDeniedError, match="not served to this tenant"):
        await sdk.post("/feedback", body={"request_id": theirs, "rating": 1}, cast_to=httpx.Response)
    ack = (
        await sdk.post(
            "/feedback",
            body=[{"request_id": mine, "rating": 1}, {"request_id": theirs, "rating": 1}, "x", {"rating": 1}],
            cast_to=httpx.Response,
        )
    ).json()
    assert (ack["accepted"], ack["rejected"]) == (1, 3)
    assert [(e["index"], e["code"]) for e in ack["errors"]] == [
        (1, "PERMISSION_DENIED"), (2, "INVALID_ARGUMENT"), (3, "INVALID_ARGUMENT"),
    ]  # fmt: skip
    assert "JSON object" in ack["errors"][1]["reason"] and "request_id" in ack["errors"][2]["reason"]
    await sdk.close()
    db.dispose()


async def test_a_feedback_body_past_the_bound_is_413_once_the_items_before_it_were_taken(
    settings: Settings, kafka: Broker
) -> None:
    """The bound counts items by position, ones that are no object too, in an array as in NDJSON."""
    stack = await start_stack(settings.model_copy(update={"max_feedback_items": 3}))
    db = open_db(settings.resolved_database_url)
    try:
        sdk = async_client(stack)
        ids = [
            (await sdk.completions.create(model="arith", prompt=f"{i}+1=", max_tokens=4)).id for i in range(2)
        ]
        await sdk.close()
        first = [{"feedback_id": "fb-a", "request_id": ids[0], "rating": 1}, "x",
                 {"feedback_id": "fb-b", "request_id": ids[1], "rating": -1}]  # fmt: skip
        past = [{"feedback_id": f"past-{i}", "request_id": ids[0], "rating": 1} for i in range(2)]
        lines = "\n".join(json.dumps(item) for item in first + past)
        headers = {"authorization": f"Bearer {stack.api_key}"}
        async with httpx.AsyncClient(base_url=stack.http_url, headers=headers) as http:
            refused = [
                await http.post("/v1/feedback", json=first + past),
                await http.post(
                    "/v1/feedback", content=lines, headers={"content-type": "application/x-ndjson"}
                ),
            ]
        for response in refused:
            assert response.status_code == 413 and "retry-after" not in response.headers
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "resource_exhausted")
            assert "at most 3 items" in error["message"] and "(2 accepted, 1 rejected)" in error["message"]
        with consuming(kafka.bootstrap, db):
            everything = {"inferences": 2, "feedback": 2, "joined_feedback": 2}
            await asyncio.to_thread(
                wait_for, lambda: store_counts(db) == everything, 60, "the items before the bound"
            )
    finally:
        db.dispose()
        await stop_stack(stack)


async def test_a_drained_gateway_finishes_open_http_streams_and_takes_no_new_ones(stack: Stack) -> None:
    body = {"model": "arith", "prompt": "47+38=", "max_tokens": 60, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {stack.api_key}"}
    async with (
        httpx.AsyncClient(base_url=stack.http_url) as http,
        http.stream("POST", "/v1/completions", json=body, headers=headers) as response,
    ):
        lines = response.aiter_lines()
        await anext(lines)
        draining = asyncio.create_task(stack.gateway.drain(10))
        rest = [line async for line in lines if line]
        await draining
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    with pytest.raises(grpc.aio.AioRpcError):
        await generate(stack, request())
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=stack.http_url) as http:
            await http.get("/health")
