"""OpenAI's request bodies as reflow's GenerateRequest, and a Generate stream's messages as OpenAI's
completions, chunks and usage, for chat (`/v1/chat/completions`) and text (`/v1/completions`)."""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.http.schemas import (
    UINT32,
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    StructuredOutputs,
)
from reflow import structured_output
from reflow.errors import InvalidArgument
from reflow.v1 import inference_pb2

P = inference_pb2
Logprobs = Sequence[inference_pb2.TokenLogprob]
Messages = list[inference_pb2.GenerateResponse]  # one choice's stream
FINISH_REASONS = {
    P.FINISH_REASON_STOP: "stop",
    P.FINISH_REASON_LENGTH: "length",
    P.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
OPENAI_DEFAULT_TEMPERATURE = 1.0  # what OpenAI's API documents for an omitted temperature
ROLES = {"developer": "system"}  # OpenAI's newer name for the system role, which templates know
NOTHING_TO_SEND = (
    "max_tokens 0 generates nothing: send echo with it (and logprobs, for the prompt's log probabilities), "
    "or at least 1"
)


def generate_request(body: ChatCompletionRequest | CompletionRequest) -> inference_pb2.GenerateRequest:
    """The GenerateRequest asking what `body` asks; InvalidArgument, naming the field, for what
    reflow does not do."""
    _refuse_unsupported(body)
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    temperature = OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    try:  # a string holding a lone surrogate (JSON's "\ud800") cannot be a protobuf string
        request = P.GenerateRequest(
            model=body.model,
            sampling=P.SamplingParams(
                max_tokens=max_tokens or 0, temperature=temperature, top_p=body.top_p or 0.0,
                top_k=body.top_k or 0, seed=(body.seed or 0) % 2**64, stop=stop,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=body.repetition_penalty or 0.0, logit_bias=_logit_bias(body),
            ),
            user_id=body.user or "",
            reasoning_budget=body.reasoning_budget or 0,
            latency_budget_ms=body.latency_budget_ms or 0,
            variant=body.variant or "",
            labels=body.metadata or {},
            structured_output=_structured_output(body),
            **_logprobs_asked(body),
        )  # fmt: skip
        if isinstance(body, ChatCompletionRequest):
            request.messages.extend(_messages(body))
            request.tools.extend(_tools(body))
            if body.tool_choice is not None:
                request.tool_choice.CopyFrom(_tool_choice(body))
        else:
            request.prompt = _prompt(body)
            request.prompt_only = body.max_tokens == 0
    except UnicodeEncodeError:
        raise InvalidArgument("text must be valid Unicode; a string holds a lone surrogate") from None
    return request


def _refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """InvalidArgument for the first parameter asking for something reflow does not do."""
    refusals: list[tuple[str, bool, str]] = [
        (
            "stream_options",
            body.stream_options is not None and not body.stream,
            "stream_options is for streamed completions; send stream: true with it",
        ),
    ]
    if isinstance(body, ChatCompletionRequest):
        old_tools = "functions, the old form of tools, are not supported: send tools"
        refusals.append(("functions", bool(body.functions), old_tools))
    else:
        n, generated = choice_counts(body)
        ranked = generated > n
        refusals += [
            ("best_of", generated < n, "best_of must be at least n (or omitted)"),
            ("best_of", ranked and body.stream, "best_of ranks whole completions: not streamed"),
            ("best_of", ranked and body.max_tokens == 0, "best_of ranks tokens: none at max_tokens 0"),
            ("max_tokens", body.max_tokens == 0 and not body.echo, NOTHING_TO_SEND),
            ("suffix", bool(body.suffix), "suffix (insertion) is not supported; omit it"),
        ]  # fmt: skip
    for param, refused, message in refusals:
        if refused:
            raise InvalidArgument(message, param=param)


def choice_counts(body: ChatCompletionRequest | CompletionRequest) -> tuple[int, int]:
    """How many choices to return (`n`) and how many to generate (`best_of` on text completions,
    else as many)."""
    n = body.n or 1
    return n, (body.best_of or n) if isinstance(body, CompletionRequest) else n


def _structured_output(
    body: ChatCompletionRequest | CompletionRequest,
) -> inference_pb2.StructuredOutput | None:
    """The format the text is held to: `response_format`'s, or `structured_outputs`'s (vLLM's), None
    for free text; InvalidArgument naming the field for one that cannot be enforced, or for both."""
    response_format, asked = body.response_format, body.structured_outputs
    if isinstance(response_format, JsonObjectFormat | JsonSchemaFormat):
        if asked is not None:
            raise InvalidArgument(
                "send response_format or structured_outputs, not both", "structured_outputs"
            )
        format, param = _openai_format(response_format)
    elif asked is not None:
        format, param = _vllm_format(asked)
    else:
        return None
    structured_output.check(format, param)
    return format


def _openai_format(
    response_format: JsonObjectFormat | JsonSchemaFormat,
) -> tuple[inference_pb2.StructuredOutput, str]:
    """OpenAI's `response_format` as a StructuredOutput, and the field that set it."""
    schema = None if isinstance(response_format, JsonObjectFormat) else response_format.json_schema.schema_
    if schema is None:
        return P.StructuredOutput(json_object=True), "response_format"
    return P.StructuredOutput(json_schema=json.dumps(schema)), "response_format.json_schema.schema"


def _vllm_format(asked: StructuredOutputs) -> tuple[inference_pb2.StructuredOutput, str]:
    """vLLM's `structured_outputs` as a StructuredOutput, and the field that set it; a choice of
    texts becomes the grammar of their alternation (Lark's strings take JSON's escapes)."""
    given = {name: value for name, value in asked.model_dump(by_alias=True).items() if value is not None}
    if len(given) != 1:
        names = "json, json_object, regex, grammar and choice"
        raise InvalidArgument(
            f"structured_outputs takes one of {names}; got {sorted(given)}", "structured_outputs"
        )
    [(name, value)] = given.items()
    param = f"structured_outputs.{name}"
    if name == "json":
        return P.StructuredOutput(json_schema=json.dumps(value)), param
    if name == "choice":
        alternatives = " | ".join(json.dumps(text, ensure_ascii=False) for text in value)
        return P.StructuredOutput(grammar=f"start: {alternatives}"), param
    return P.StructuredOutput(**{name: value}), param


def _logprobs_asked(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """GenerateRequest's logprobs and top_logprobs: a chat body's as they are; a text body's
    `logprobs` is how many alternatives it wants (0: the tokens' own log probabilities only)."""
    if isinstance(body, ChatCompletionRequest):
        return {"logprobs": bool(body.logprobs), "top_logprobs": body.top_logprobs or 0}
    asked = body.logprobs is not None
    return {
        "logprobs": asked,
        "top_logprobs": body.logprobs or 0,
        "prompt_logprobs": asked and bool(body.echo),
    }


def echoed(body: ChatCompletionRequest | CompletionRequest) -> str:
    """The text a completion starts with before its own: a text body's prompt with `echo`."""
    return _prompt(body) if isinstance(body, CompletionRequest) and body.echo else ""


def _logit_bias(body: ChatCompletionRequest | CompletionRequest) -> dict[int, float]:
    """The logit bias by token id; InvalidArgument for a key that is not one (a decimal integer)."""
    biases = {}
    for key, bias in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit() and int(key) <= UINT32):
            raise InvalidArgument(
                f'logit_bias keys are token ids, integers written as strings ("50256"), got {key!r}',
                param="logit_bias",
            )
        biases[int(key)] = bias
    return biases


def _tools(body: ChatCompletionRequest) -> list[inference_pb2.Tool]:
    return [
        P.Tool(name=t.function.name, description=t.function.description or "",
               parameters="" if t.function.parameters is None else json.dumps(t.function.parameters))
        for t in body.tools or []
    ]  # fmt: skip


def _tool_choice(body: ChatCompletionRequest) -> inference_pb2.ToolChoice:
    """`none`, `auto` and `required` as they are; a named function as mode `function`."""
    if isinstance(body.tool_choice, str):
        return P.ToolChoice(mode=body.tool_choice)
    assert body.tool_choice is not None
    return P.ToolChoice(mode="function", function=body.tool_choice.function.name)


def _messages(body: ChatCompletionRequest) -> list[inference_pb2.ChatMessage]:
    messages = []
    for i, message in enumerate(body.messages):
        if message.role == "function":
            raise InvalidArgument("function messages, the old form of tool messages, are not supported: "
                                  "send role tool", param=f"messages.{i}")  # fmt: skip
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidArgument(
                    "only text content parts are supported (reflow serves text models)",
                    param=f"messages.{i}.content",
                )
            content = "".join(part.text or "" for part in content)
        calls = [P.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                 for c in message.tool_calls or []]  # fmt: skip
        messages.append(
            P.ChatMessage(role=ROLES.get(message.role, message.role), content=content or "", tool_calls=calls,
                          tool_call_id=message.tool_call_id or "")
        )  # fmt: skip
    return messages


def _prompt(body: CompletionRequest) -> str:
    if isinstance(body.prompt, str):
        return body.prompt
    if len(body.prompt) != 1:
        raise InvalidArgument(
            f"send one prompt per request (a string, or a list of one), got {len(body.prompt)}",
            param="prompt",
        )
    return body.prompt[0]


@dataclass(frozen=True)
class Served:
    """Where a completion ran, from its first message: what every chunk and header repeats."""

    id: str
    model: str
    version: str
    arm: str
    variant: str  # "" where its workers hold no variants
    created: int

    @classmethod
    def of(cls, header: inference_pb2.GenerateResponse) -> Served:
        return cls(
            header.request_id,
            header.model,
            header.model_version,
            header.arm,
            header.routing.variant,
            int(time.time()),
        )

    @property
    def fingerprint(self) -> str:
        """`NAME/VERSION`, and `@ARM` when an alias routed the request."""
        return f"{self.model}/{self.version}" + (f"@{self.arm}" if self.arm else "")

    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.id, "x-reflow-model-version": self.version, "x-reflow-arm": self.arm,
                "x-reflow-variant": self.variant}  # fmt: skip

    def envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}  # fmt: skip


def usage(lasts: Sequence[inference_pb2.GenerateResponse]) -> dict[str, Any]:
    """OpenAI's usage of the last messages of each choice's stream: the prompt counted once (the
    first choice's; the others reused it), the completions all."""
    prompt = lasts[0].usage
    completion = sum(last.usage.completion_tokens for last in lasts)
    return {
        "prompt_tokens": prompt.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": prompt.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": sum(last.usage.reasoning_tokens for last in lasts)},
    }


def finish_reason(message: inference_pb2.GenerateResponse) -> str | None:
    """`stop` or `length` on the last message, None before it."""
    if not message.finish_reason:
        return None
    return FINISH_REASONS.get(message.finish_reason, "stop")


class ChatShape:
    """`/v1/chat/completions`: a message with the answer, or its deltas."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    @staticmethod
    def choice(
        answer: str, reasoning: str, last: inference_pb2.GenerateResponse, logprobs: Logprobs
    ) -> dict[str, Any]:
        message = {"role": "assistant", "content": answer}
        if reasoning:
            message["reasoning_content"] = reasoning
        return {"message": message, "finish_reason": finish_reason(last),
                "logprobs": ChatShape.logprobs(logprobs)}  # fmt: skip

    @staticmethod
    def chunk_choice(message: inference_pb2.GenerateResponse, first: bool, offset: int) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": message.text} if first else {}
        if message.text:
            delta["content"] = message.text
        if message.reasoning_text:
            delta["reasoning_content"] = message.reasoning_text
        if message.tool_calls:
            delta["tool_calls"] = [ChatShape.call_delta(piece) for piece in message.tool_calls]
        return {"delta": delta, "finish_reason": finish_reason(message),
                "logprobs": ChatShape.logprobs(message.logprobs)}  # fmt: skip

    @staticmethod
    def call_delta(piece: inference_pb2.ToolCallDelta) -> dict[str, Any]:
        """A piece of a tool call as OpenAI streams it: id, type and name in a call's first piece."""
        if not piece.id:
            return {"index": piece.index, "function": {"arguments": piece.arguments}}
        function = {"name": piece.name, "arguments": piece.arguments}
        return {"index": piece.index, "id": piece.id, "type": "function", "function": function}

    @staticmethod
    def calls(messages: list[inference_pb2.GenerateResponse]) -> list[dict[str, Any]]:
        """The whole tool calls of a stream's messages, in order."""
        calls: list[dict[str, Any]] = []
        for piece in (piece for m in messages for piece in m.tool_calls):
            if piece.id:
                function = {"name": piece.name, "arguments": ""}
                calls.append({"id": piece.id, "type": "function", "function": function})
            calls[piece.index]["function"]["arguments"] += piece.arguments
        return calls

    @staticmethod
    def logprobs(entries: Logprobs) -> dict[str, Any] | None:
        """OpenAI's chat logprobs of these tokens; None where none were asked for (or made)."""
        if not entries:
            return None

        def entry(e: inference_pb2.TokenLogprob) -> dict[str, Any]:
            return {"token": e.token, "logprob": e.logprob, "bytes": None}  # a token's bytes are not kept

        content = [entry(e) | {"top_logprobs": [entry(t) for t in e.top_logprobs]} for e in entries]
        return {"content": content, "refusal": None}


class TextShape:
    """`/v1/completions`: the completed text, or its deltas."""

    object = "text_completion"
    chunk_object = "text_completion"

    @staticmethod
    def choice(
        answer: str, reasoning: str, last: inference_pb2.GenerateResponse, logprobs: Logprobs, offset: int = 0
    ) -> dict[str, Any]:
        choice = {"text": answer, "finish_reason": finish_reason(last),
                  "logprobs": TextShape.logprobs(logprobs, offset)}  # fmt: skip
        if reasoning:
            choice["reasoning_content"] = reasoning
        return choice

    @staticmethod
    def chunk_choice(message: inference_pb2.GenerateResponse, first: bool, offset: int) -> dict[str, Any]:
        logprobs = [*message.prompt_logprobs, *message.logprobs]
        return TextShape.choice(message.text, message.reasoning_text, message, logprobs, offset)

    @staticmethod
    def logprobs(entries: Logprobs, offset: int) -> dict[str, Any] | None:
        """OpenAI's text-completion logprobs of these tokens, the first at character `offset` of the
        completion (each token's offset counts the tokens' texts before it, as vLLM counts them);
        None where none were asked for (or made)."""
        if not entries:
            return None
        offsets = list(itertools.accumulate((len(e.token) for e in entries[:-1]), initial=offset))
        predicted = [not math.isnan(e.logprob) for e in entries]  # an echoed prompt's first token is not
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob if p else None for e, p in zip(entries, predicted, strict=True)],
            "top_logprobs": [
                {t.token: t.logprob for t in e.top_logprobs} if p else None
                for e, p in zip(entries, predicted, strict=True)
            ],
            "text_offset": offsets,
        }


Shape = type[ChatShape] | type[TextShape]


def completion(
    shape: Shape, served: Served, choices: Sequence[Messages], generated: Sequence[Messages] = ()
) -> dict[str, Any]:
    """The whole completion of each choice's stream's messages (the first names its request id,
    the last carries finish_reason and usage), with the usage of every choice `generated` (by
    default those shown, all but with best_of)."""
    return served.envelope(shape.object) | {
        "choices": [_choice(shape, index, messages) for index, messages in enumerate(choices)],
        "usage": usage([messages[-1] for messages in generated or choices]),
    }


def _choice(shape: Shape, index: int, messages: Messages) -> dict[str, Any]:
    answer = "".join(m.text for m in messages)
    reasoning = "".join(m.reasoning_text for m in messages)
    logprobs = [e for m in messages for e in (*m.prompt_logprobs, *m.logprobs)]
    choice: dict[str, Any] = {"index": index, "request_id": messages[0].request_id}
    choice |= shape.choice(answer, reasoning, messages[-1], logprobs)
    calls = ChatShape.calls(messages)  # none but in chat: text completions take no tools
    if calls:
        choice["message"] |= {"content": answer or None, "tool_calls": calls}
    return choice


def chunk(
    shape: Shape,
    served: Served,
    message: inference_pb2.GenerateResponse,
    first: bool,
    with_usage: bool,
    offset: int = 0,
    index: int = 0,
) -> str:
    """One SSE event of a streamed completion: a message of choice `index`, whose text before it
    is `offset` characters long; a choice's `first` names its request id. `with_usage` adds
    `"usage": null`, as OpenAI does on every chunk but the last when usage was asked for."""
    choice: dict[str, Any] = {"index": index} | ({"request_id": message.request_id} if first else {})
    choice |= shape.chunk_choice(message, first, offset)
    body = served.envelope(shape.chunk_object) | {"choices": [choice]}
    if with_usage:
        body["usage"] = None
    return event(body)


def usage_chunk(shape: Shape, served: Served, lasts: Sequence[inference_pb2.GenerateResponse]) -> str:
    """The last event when usage was asked for: no choices, the usage of every choice."""
    return event(served.envelope(shape.chunk_object) | {"choices": [], "usage": usage(lasts)})


def event(data: object) -> str:
    """One server-sent event carrying `data` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
