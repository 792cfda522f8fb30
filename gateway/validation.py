"""Validates a GenerateRequest at the edge and turns it into the worker's request, defaults applied."""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

from feedback.events import MAX_MESSAGES, MAX_ROLE_CHARS, MAX_USER_ID_CHARS
from reflow import structured_output
from reflow.errors import InvalidArgument
from reflow.structured_output import MAX_FORMAT_CHARS
from reflow.v1 import inference_pb2, worker_pb2

MIN_TEMPERATURE = 0.01  # below it logits / temperature overflows; use 0 for greedy
MAX_TEMPERATURE = 100.0
# The minimum as a `float` (float32) field carries it: 0.01 arrives as 0.009999999776..., which must
# pass, or the documented minimum itself is refused (100.0 is exact).
_MIN_TEMPERATURE_F32: float = struct.unpack("f", struct.pack("f", MIN_TEMPERATURE))[0]
MAX_STOP_CHARS = 64
MAX_LABELS = 32
MAX_LABEL_CHARS = 256
MAX_VARIANT_CHARS = 64  # variant names are dtype names ("bfloat16")
MAX_PENALTY = 2.0  # OpenAI's bound on the presence and frequency penalties, either sign
MAX_REPETITION_PENALTY = 10.0  # past it every seen token is as good as banned
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each bias, either sign: 100 forces a token, -100 bans it
MAX_LOGIT_BIAS_ENTRIES = 1024  # a bound on what one request makes every step do
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on the alternatives reported at each position
MAX_TOOLS = 128  # OpenAI's bound on a request's tools
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
TOOL_CHOICES = ("auto", "none", "required", "function")


@dataclass(frozen=True)
class RequestLimits:
    """What the gateway accepts of a request, and the default it fills in."""

    max_prompt_chars: int
    default_max_tokens: int  # max_tokens of a request that leaves it 0
    max_stop_strings: int


def check_request(request: inference_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Raises InvalidArgument, with what to change, for anything a worker should never see."""
    if request.messages:
        _check_messages(request, limits)
    elif not request.prompt:
        raise InvalidArgument(
            "prompt and messages are both empty; send the text to complete in prompt (e.g. '47+38=') "
            "or a conversation in messages"
        )
    elif len(request.prompt) > limits.max_prompt_chars:
        raise InvalidArgument(
            f"prompt is {len(request.prompt)} characters; the limit is {limits.max_prompt_chars}"
        )
    s = request.sampling
    if not math.isfinite(s.temperature) or not (
        s.temperature == 0.0 or _MIN_TEMPERATURE_F32 <= s.temperature <= MAX_TEMPERATURE
    ):
        raise InvalidArgument(
            f"sampling.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
            f"got {s.temperature}"
        )
    if not math.isfinite(s.top_p) or not 0.0 <= s.top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p must be in [0, 1] (0 = off), got {s.top_p}")
    _check_adjustments(s)
    if request.top_logprobs > MAX_TOP_LOGPROBS:
        message = f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {request.top_logprobs}"
        raise InvalidArgument(message, param="top_logprobs")
    if request.top_logprobs and not (request.logprobs or request.prompt_logprobs):
        raise InvalidArgument(
            "top_logprobs needs logprobs (or prompt_logprobs): set logprobs too", param="top_logprobs"
        )
    structured_output.check(request.structured_output)
    if request.tools or request.HasField("tool_choice"):
        _check_tools(request)
    if len(s.stop) > limits.max_stop_strings:
        raise InvalidArgument(f"at most {limits.max_stop_strings} stop strings, got {len(s.stop)}")
    if any(not stop or len(stop) > MAX_STOP_CHARS for stop in s.stop):
        raise InvalidArgument(f"stop strings must be 1 to {MAX_STOP_CHARS} characters")
    if len(request.user_id) > MAX_USER_ID_CHARS:
        raise InvalidArgument(f"user_id is longer than {MAX_USER_ID_CHARS} characters")
    if len(request.labels) > MAX_LABELS or any(
        len(k) > MAX_LABEL_CHARS or len(v) > MAX_LABEL_CHARS for k, v in request.labels.items()
    ):
        raise InvalidArgument(f"at most {MAX_LABELS} labels of at most {MAX_LABEL_CHARS} characters each")
    if len(request.variant) > MAX_VARIANT_CHARS:
        raise InvalidArgument(f"variant is longer than {MAX_VARIANT_CHARS} characters; ListModels names them")


def _check_adjustments(s: inference_pb2.SamplingParams) -> None:
    """InvalidArgument for a penalty or logit bias out of its range."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not math.isfinite(value) or abs(value) > MAX_PENALTY:
            raise InvalidArgument(
                f"sampling.{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}] (0 = off), got {value}"
            )
    penalty = s.repetition_penalty
    if not math.isfinite(penalty) or not 0.0 <= penalty <= MAX_REPETITION_PENALTY:
        raise InvalidArgument(
            f"sampling.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (0 or 1 = off), "
            f"got {penalty}"
        )
    if len(s.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(
            f"sampling.logit_bias has {len(s.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}"
        )
    bad = next(
        (t for t, bias in s.logit_bias.items() if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS), None
    )
    if bad is not None:
        raise InvalidArgument(
            f"sampling.logit_bias[{bad}] must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
            f"got {s.logit_bias[bad]}"
        )


def _check_tools(request: inference_pb2.GenerateRequest) -> None:
    """Raises InvalidArgument, naming the field, for tools or a tool choice a worker should never see."""
    if request.tools and not request.messages:
        raise InvalidArgument("tools are for conversations: send messages, not a prompt", param="tools")
    if len(request.tools) > MAX_TOOLS:
        raise InvalidArgument(f"at most {MAX_TOOLS} tools, got {len(request.tools)}", param="tools")
    names = [tool.name for tool in request.tools]
    for i, tool in enumerate(request.tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise InvalidArgument(
                f"tools[{i}].name must be 1 to 64 letters, digits, underscores or dashes, got {tool.name!r}",
                param=f"tools.{i}.name",
            )
        if names.index(tool.name) != i:
            raise InvalidArgument(f"two tools are named {tool.name!r}", param=f"tools.{i}.name")
        if len(tool.description) > MAX_FORMAT_CHARS or len(tool.parameters) > MAX_FORMAT_CHARS:
            raise InvalidArgument(
                f"tools[{i}] is longer than {MAX_FORMAT_CHARS} characters", param=f"tools.{i}"
            )
        if tool.parameters:
            structured_output.json_object(tool.parameters, f"tools.{i}.parameters")
    mode, function = request.tool_choice.mode or "auto", request.tool_choice.function
    if mode not in TOOL_CHOICES:
        choices = ", ".join(TOOL_CHOICES)
        raise InvalidArgument(f"tool_choice.mode must be one of {choices}; got {mode!r}", param="tool_choice")
    if (mode == "function") != bool(function):
        raise InvalidArgument(
            "tool_choice.function names the tool of mode 'function', and only then", "tool_choice"
        )
    forced = names if mode == "required" else [function] if mode == "function" else []
    if mode in ("required", "function") and not request.tools:
        raise InvalidArgument(f"tool_choice {mode!r} needs tools", param="tool_choice")
    if function and function not in names:
        raise InvalidArgument(f"tool_choice names {function!r}, which is not among the tools", "tool_choice")
    if forced and request.structured_output.WhichOneof("format"):
        raise InvalidArgument(
            "a tool choice that forces calls holds the answer already: drop structured_output"
        )
    for name in forced:  # the calls it must make are held to their tools' schemas
        i = names.index(name)
        schema = inference_pb2.StructuredOutput(json_schema=request.tools[i].parameters or "{}")
        structured_output.check(schema, f"tools.{i}.parameters")


def _check_messages(request: inference_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Raises InvalidArgument for a conversation a worker should never see; its contents count
    against the prompt's limit."""
    if request.prompt:
        raise InvalidArgument("send prompt or messages, not both")
    if len(request.messages) > MAX_MESSAGES:
        raise InvalidArgument(f"at most {MAX_MESSAGES} messages, got {len(request.messages)}")
    for i, message in enumerate(request.messages):
        if not message.role.strip():
            raise InvalidArgument(f"messages[{i}].role is empty; say who speaks, e.g. 'system' or 'user'")
        if len(message.role) > MAX_ROLE_CHARS:
            raise InvalidArgument(f"messages[{i}].role is longer than {MAX_ROLE_CHARS} characters")
        if message.tool_calls and message.role != "assistant":
            raise InvalidArgument(
                f"messages[{i}]: only an assistant's turn makes tool calls", f"messages.{i}"
            )
        if message.tool_call_id and message.role != "tool":
            raise InvalidArgument(f"messages[{i}]: only a tool's turn answers a call", f"messages.{i}")
        for j, call in enumerate(message.tool_calls):
            field = f"messages.{i}.tool_calls.{j}"
            if not TOOL_NAME.fullmatch(call.name) or len(call.id) > MAX_ROLE_CHARS:
                raise InvalidArgument(
                    f"{field} needs a tool's name and an id of {MAX_ROLE_CHARS} at most", field
                )
            structured_output.json_object(call.arguments, f"{field}.arguments")
    chars = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in request.messages)
    if chars > limits.max_prompt_chars:
        raise InvalidArgument(
            f"the messages' contents are {chars} characters in all; the limit is {limits.max_prompt_chars}"
        )


def max_tokens_for(
    request: inference_pb2.GenerateRequest, limits: RequestLimits, loaded: worker_pb2.LoadedVersion
) -> int:
    """The request's max_tokens on `loaded`: defaulted, and InvalidArgument beyond its context."""
    limit = loaded.max_sequence_length - 1
    max_tokens = request.sampling.max_tokens or min(limits.default_max_tokens, limit)
    if max_tokens > limit:
        raise InvalidArgument(
            f"sampling.max_tokens must be between 1 and {limit} for {loaded.model}/{loaded.version}, "
            f"got {max_tokens}"
        )
    return max_tokens


def worker_request(
    request: inference_pb2.GenerateRequest,
    limits: RequestLimits,
    *,
    request_id: str,
    loaded: worker_pb2.LoadedVersion,
    variant: str = "",
    reasoning_budget: int | None = None,
    cache_salt: str = "",
) -> worker_pb2.WorkerGenerateRequest:
    """The request for the worker serving `loaded` (on its `variant`), with max_tokens defaulted
    and bounded, the reasoning budget the gateway applied (None: the request's), and the salt of
    the prefix cache blocks it may reuse."""
    sampling = inference_pb2.SamplingParams()
    sampling.CopyFrom(request.sampling)
    sampling.max_tokens = max_tokens_for(request, limits, loaded)
    return worker_pb2.WorkerGenerateRequest(
        request_id=request_id,
        model=loaded.model,
        version=loaded.version,
        prompt=request.prompt,
        messages=request.messages,
        sampling=sampling,
        reasoning_budget=request.reasoning_budget if reasoning_budget is None else reasoning_budget,
        variant=variant,
        cache_salt=cache_salt,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        prompt_logprobs=request.prompt_logprobs,
        structured_output=request.structured_output,
        tools=request.tools,
        tool_choice=request.tool_choice,
        prompt_only=request.prompt_only,
    )
