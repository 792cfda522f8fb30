"""The OpenAI API's request and response bodies as reflow takes and gives them: what FastAPI
validates requests against and what `/openapi.json` documents.

Fields reflow does not implement are declared too, so that asking for them (`n` > 1, tools,
`echo`, ...) is refused by name rather than ignored; fields it has never heard of are ignored,
as OpenAI's clients send new ones first. reflow's own fields (`top_k`, `repetition_penalty`,
`reasoning_budget`, `latency_budget_ms`, `variant`) are extra body fields (`extra_body=` in the
`openai` SDK).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from feedback.events import MAX_USER_ID_CHARS
from gateway.validation import (
    MAX_LABEL_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MAX_VARIANT_CHARS,
)

UINT32 = 2**32 - 1
UINT64 = 2**64 - 1
MAX_CHOICES = 8  # n and best_of: OpenAI documents no bound; 8 streams are much of a small worker's batch
MAX_MODEL_CHARS = 256

Uint32 = Annotated[int, Field(ge=0, le=UINT32)]
Label = Annotated[str, Field(max_length=MAX_LABEL_CHARS)]


class _Body(BaseModel):
    # strict: `false` is not a logprobs count nor 2.0 a max_tokens, as OpenAI's API has it too
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="Send a last chunk with the usage, before `[DONE]`.")


class JsonSchema(_Body):
    name: str = Field(min_length=1, max_length=64, description="The schema's name, as OpenAI requires one.")
    description: str | None = Field(None, description="Accepted and not used.")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON Schema; omitted = any JSON object."
    )
    strict: bool | None = Field(None, description="Always enforced strictly, whatever it says.")


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` extra: exactly one format."""

    json_: dict[str, Any] | None = Field(None, alias="json", description="A JSON Schema.")
    json_object: bool | None = Field(None, description="true: any JSON object.")
    regex: str | None = Field(None, description="A regular expression the whole text matches.")
    grammar: str | None = Field(None, description="A Lark grammar, llguidance's dialect.")
    choice: Annotated[list[str], Field(min_length=1)] | None = Field(
        None, description="The text is one of these."
    )


class _CompletionParameters(_Body):
    """What chat and text completions share."""

    model: str = Field(
        "",
        max_length=MAX_MODEL_CHARS,
        description="`NAME`, `NAME@ALIAS` or `NAME/VERSION`; empty = the gateway's default model.",
    )
    max_tokens: Annotated[int, Field(ge=1, le=UINT32)] | None = Field(
        None, description="Most tokens to generate, reasoning included; omitted = the server default."
    )
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None = Field(
        None, description="0 = greedy; omitted = 1, as OpenAI's API documents."
    )
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = Field(
        None, description="Nucleus sampling; 1 or omitted = off (for greedy, send temperature 0)."
    )
    seed: Annotated[int, Field(ge=-(2**63), le=UINT64)] | None = Field(
        None,
        description="The same seed and inputs give the same tokens; 0 or omitted = a fresh seed; "
        "a negative one is taken modulo 2**64.",
    )
    stop: Annotated[str, Field(min_length=1)] | list[str] | None = Field(
        None, description="Generation stops before the first of these strings, which is not returned."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=MAX_USER_ID_CHARS)] | None = Field(
        None, description="The end user: decides the A/B arm and is stored with the inference."
    )
    metadata: dict[Label, Label] | None = Field(
        None, description="Labels carried into the inference event (as many as gRPC's `labels`)."
    )
    # reflow's own
    top_k: Uint32 | None = Field(None, description="Keep only the k most likely tokens; 0 = off.")
    reasoning_budget: Uint32 | None = Field(
        None, description="Most tokens the model may think for before it must answer; 0 = no bound."
    )
    latency_budget_ms: Uint32 | None = Field(None, description="Deadline for the whole completion; 0 = none.")
    variant: Annotated[str, Field(max_length=MAX_VARIANT_CHARS)] | None = Field(
        None, description="The variant to run on (`int8`, as /v1/models lists them); unset = reflow chooses."
    )
    repetition_penalty: (
        Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)] | None
    ) = Field(
        None,
        description="vLLM's: a seen token's logit (prompt or completion) is divided by it where positive, "
        "multiplied where negative; 1 or omitted = off.",
    )
    presence_penalty: Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)] | None = (
        Field(None, description="Subtracted from the logit of every token the completion holds; 0 = off.")
    )
    frequency_penalty: (
        Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)] | None
    ) = Field(None, description="Subtracted once for each time the completion holds a token; 0 = off.")
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]],
            Field(max_length=MAX_LOGIT_BIAS_ENTRIES),
        ]
        | None
    ) = Field(None, description="Token id (as a string) -> added to its logit; 100 forces it, -100 bans it.")
    response_format: ResponseFormat | None = Field(
        None,
        description="`text`, `json_object` or `json_schema`: the text is held to it token by token "
        "(docs/structured-outputs.md); on `/v1/completions` too, as vLLM takes it.",
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: a JSON Schema, a regular expression, a grammar or a choice of texts."
    )
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = Field(
        None,
        description="How many choices to generate, each with its own `request_id` to rate it by; the "
        "prompt's KV blocks are shared and its tokens counted once.",
    )


class ContentPart(_Body):
    """A part of a message's content; reflow serves text models, so only `text` parts."""

    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str = Field(description="JSON text: an object.")


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Body):
    name: str = Field(description="Letters, digits, underscores and dashes, at most 64.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="The JSON Schema of its arguments.")
    strict: bool | None = Field(
        None, description="Accepted: calls the model must make are always held to it."
    )


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Body):
    role: str = Field(
        min_length=1,
        max_length=32,
        description="`system`, `developer` (taken as `system`), `user`, `assistant` or `tool`.",
    )
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, description="Accepted and not used.")
    tool_calls: list[ToolCall] | None = Field(None, description="The calls an assistant's turn made.")
    tool_call_id: str | None = Field(None, description="A `tool` turn: the call whose result it is.")


class ChatCompletionRequest(_CompletionParameters):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, le=UINT32)] | None = Field(
        None, description="The same as `max_tokens`, which it wins over."
    )
    logprobs: bool | None = Field(None, description="Report each generated token's log probability.")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(
        None, description="With `logprobs`, also the most likely tokens at each position."
    )
    tools: list[ToolDefinition] | None = Field(
        None, description="Functions the model may call, on a model whose chat template takes tools."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Omitted = `auto`: the model decides (`none` with no tools)."
    )
    functions: list[Any] | None = Field(None, description="Not supported: send `tools`.")


class CompletionRequest(_CompletionParameters):
    prompt: str | list[str] = Field(description="The text to complete; a list holds exactly one.")
    max_tokens: Annotated[int, Field(ge=0, le=UINT32)] | None = Field(
        None,
        description="Most tokens to generate, reasoning included; 0 (with `echo`) = none, the prompt "
        "scored only; omitted = the server default.",
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(
        None, description="Report each token's log probability and this many of the most likely ones'."
    )
    echo: bool | None = Field(
        None,
        description="Start the text with the prompt; with `logprobs`, its tokens' log probabilities too.",
    )
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = Field(
        None,
        description="Generate this many (at least `n`) and return the `n` with the highest mean log "
        "probability per token, best first; not streamed. The usage counts them all.",
    )
    suffix: str | None = Field(None, description="Not supported.")


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens reused from the worker's prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = Field(description="Reasoning included.")
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


FinishReason = Literal["stop", "length", "tool_calls"]


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="JSON text: an object.")


class CalledTool(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null where the answer is only tool calls.")
    reasoning_content: str | None = Field(None, description="What the model thought, when it did.")
    tool_calls: list[CalledTool] | None = Field(None, description="The tools it called, when it did.")


class TopLogprob(BaseModel):
    token: str = Field(description="The token's text, decoded alone.")
    logprob: float = Field(
        description="After the logit bias and penalties, before temperature; -9999 for -inf."
    )
    bytes: None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(
        description="The most likely tokens at its position, likeliest first."
    )


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(description="One for each generated token (reasoning's too).")
    refusal: None = None


REQUEST_ID = "This choice's request id: rate it with it (and prefer it over another choice by its id)."


class ChatChoice(BaseModel):
    index: int
    request_id: str = Field(description=REQUEST_ID)
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str = Field(description="reflow's request id: rate the completion with it.")
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str = Field(description="`NAME/VERSION`, and `@ARM` when an alias routed it.")
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(BaseModel):
    name: str | None = Field(None, description="In a call's first piece.")
    arguments: str = Field(description="More of its arguments' JSON text.")


class ToolCallDelta(BaseModel):
    index: int = Field(description="Which call of the answer, from 0.")
    id: str | None = Field(None, description="In a call's first piece.")
    type: Literal["function"] | None = Field(None, description="In a call's first piece.")
    function: FunctionDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    request_id: str | None = Field(None, description=f"In the choice's first chunk. {REQUEST_ID}")
    delta: Delta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="On the last chunk only, with `include_usage`.")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="None for an echoed prompt's first token.")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int] = Field(description="Each token's first character in the completion's text.")


class CompletionChoice(BaseModel):
    index: int
    request_id: str | None = Field(None, description=f"In a streamed choice's first chunk. {REQUEST_ID}")
    text: str
    reasoning_content: str | None = None
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A text completion, or (with `object` `text_completion` and `usage` null) one chunk of one."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None


class VariantCard(BaseModel):
    """A variant of a version its workers hold (REFLOW_VARIANTS), as they measured it against the
    version as loaded (the lowest of any worker's measurements)."""

    name: str = Field(description="What a request's `variant` names.")
    token_agreement: float = Field(description="Share of the version's greedy tokens it predicts; 1 for it.")
    greedy_agreement: float = Field(description="Share of the version's greedy output it reproduces.")
    task_score: float | None = Field(description="Its greedy accuracy on the version's task; null: no task.")


class ModelCard(BaseModel):
    """A servable model id: `NAME`, or one of its versions as `NAME/VERSION` or `NAME@ALIAS`."""

    id: str
    object: Literal["model"]
    created: int = Field(description="Always 0: the registry, not the gateway, knows when.")
    owned_by: str
    parent: str | None = Field(None, description="The model a version belongs to.")
    version: str | None = Field(None, description="The version this id serves now.")
    aliases: list[str] = Field(description="Aliases of the version (for a model: of its versions).")
    ready_workers: int
    variants: list[VariantCard] = Field(
        description="The version's variants, the version as loaded first; empty for a model, or without any."
    )


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class FeedbackItem(BaseModel):
    """What a user said of one completion (the fields of gRPC's `Feedback`): a rating or stars, a
    correction, a preference over another completion of the same conversation."""

    model_config = ConfigDict(extra="forbid")

    feedback_id: str = Field("", description="Idempotency key: the same id is stored once.")
    request_id: str = Field(description="The `id` of the completion being rated.")
    rating: Literal[-1, 0, 1] = Field(
        description="-1 (bad), 0 (neutral) or +1 (good); may be left out with `stars` or `preferred_over`."
    )
    correction: str = Field("", description="The answer the user wanted, if they gave one.")
    user_id: str = ""
    labels: dict[str, str] = {}
    preferred_over: str = Field(
        "",
        description=(
            "The `id` of another completion of the same conversation the user liked less (the other "
            "of two answers shown, or the one a kept regenerate replaced)."
        ),
    )
    stars: int = Field(
        0, ge=0, le=5, description="1-5 stars instead of `rating` (1-2: -1, 3: 0, 4-5: +1); 0 = none."
    )


class FeedbackError(BaseModel):
    index: int = Field(description="Position of the item in the body, from 0.")
    feedback_id: str
    reason: str
    code: str = Field(description="The gRPC status name, e.g. INVALID_ARGUMENT or PERMISSION_DENIED.")


class FeedbackAck(BaseModel):
    accepted: int = Field(description="Items durably handed over for storage.")
    rejected: int
    errors: list[FeedbackError] = Field(description="The first 1,000 rejected items.")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str = Field(description="The gRPC status the same error has on the gRPC face, in lower case.")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["serving", "not serving"]
    detail: str
