from reflow.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "version", "prompt", "prompt_token_ids", "sampling", "reasoning_budget", "messages", "variant", "cache_salt", "logprobs", "top_logprobs", "prompt_logprobs", "structured_output", "tools", "tool_choice", "prompt_only")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REASONING_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    version: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _inference_pb2.SamplingParams
    reasoning_budget: int
    messages: _containers.RepeatedCompositeFieldContainer[_inference_pb2.ChatMessage]
    variant: str
    cache_salt: str
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    structured_output: _inference_pb2.StructuredOutput
    tools: _containers.RepeatedCompositeFieldContainer[_inference_pb2.Tool]
    tool_choice: _inference_pb2.ToolChoice
    prompt_only: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_inference_pb2.SamplingParams, _Mapping]] = ..., reasoning_budget: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[_inference_pb2.ChatMessage, _Mapping]]] = ..., variant: _Optional[str] = ..., cache_salt: _Optional[str] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., structured_output: _Optional[_Union[_inference_pb2.StructuredOutput, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[_inference_pb2.Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[_inference_pb2.ToolChoice, _Mapping]] = ..., prompt_only: _Optional[bool] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "reasoning_text", "finish_reason", "prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens", "logprobs", "prompt_logprobs", "tool_calls")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    reasoning_text: str
    finish_reason: _inference_pb2.FinishReason
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[_inference_pb2.ToolCallDelta]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., reasoning_text: _Optional[str] = ..., finish_reason: _Optional[_Union[_inference_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[_inference_pb2.ToolCallDelta, _Mapping]]] = ...) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadedVersion(_message.Message):
    __slots__ = ("model", "version", "aliases", "parameters", "device", "max_sequence_length", "dtype", "base_version", "adapter_parameters", "variants", "kv_blocks_used", "kv_blocks_total", "kv_block_size", "reasons", "kv_blocks_cached", "prefix_cache_hit_rate", "tenant", "dtype_candidates")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    parameters: int
    device: str
    max_sequence_length: int
    dtype: str
    base_version: str
    adapter_parameters: int
    variants: _containers.RepeatedCompositeFieldContainer[LoadedVariant]
    kv_blocks_used: int
    kv_blocks_total: int
    kv_block_size: int
    reasons: bool
    kv_blocks_cached: int
    prefix_cache_hit_rate: float
    tenant: str
    dtype_candidates: _containers.RepeatedCompositeFieldContainer[DtypeCandidate]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., parameters: _Optional[int] = ..., device: _Optional[str] = ..., max_sequence_length: _Optional[int] = ..., dtype: _Optional[str] = ..., base_version: _Optional[str] = ..., adapter_parameters: _Optional[int] = ..., variants: _Optional[_Iterable[_Union[LoadedVariant, _Mapping]]] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., reasons: _Optional[bool] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., tenant: _Optional[str] = ..., dtype_candidates: _Optional[_Iterable[_Union[DtypeCandidate, _Mapping]]] = ...) -> None: ...

class DtypeCandidate(_message.Message):
    __slots__ = ("dtype", "rows", "step_ms", "token_agreement", "chosen")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    rows: _containers.RepeatedScalarFieldContainer[int]
    step_ms: _containers.RepeatedScalarFieldContainer[float]
    token_agreement: float
    chosen: bool
    def __init__(self, dtype: _Optional[str] = ..., rows: _Optional[_Iterable[int]] = ..., step_ms: _Optional[_Iterable[float]] = ..., token_agreement: _Optional[float] = ..., chosen: _Optional[bool] = ...) -> None: ...

class LoadedVariant(_message.Message):
    __slots__ = ("name", "reference", "greedy_agreement", "prefill_ms_per_token", "decode_ms_per_token", "running", "waiting", "kv_blocks_used", "kv_blocks_total", "weight_bytes", "token_agreement", "task_score")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    GREEDY_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    TASK_SCORE_FIELD_NUMBER: _ClassVar[int]
    name: str
    reference: bool
    greedy_agreement: float
    prefill_ms_per_token: float
    decode_ms_per_token: float
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    weight_bytes: int
    token_agreement: float
    task_score: float
    def __init__(self, name: _Optional[str] = ..., reference: _Optional[bool] = ..., greedy_agreement: _Optional[float] = ..., prefill_ms_per_token: _Optional[float] = ..., decode_ms_per_token: _Optional[float] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., token_agreement: _Optional[float] = ..., task_score: _Optional[float] = ...) -> None: ...

class WorkerStatusResponse(_message.Message):
    __slots__ = ("loaded", "running", "waiting", "memory_bytes", "device_memory_bytes", "kv_slots", "max_waiting", "isolation", "connections_dropped", "connects_denied", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "prefix_cache_hit_rate")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    CONNECTS_DENIED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    loaded: _containers.RepeatedCompositeFieldContainer[LoadedVersion]
    running: int
    waiting: int
    memory_bytes: int
    device_memory_bytes: int
    kv_slots: int
    max_waiting: int
    isolation: str
    connections_dropped: int
    connects_denied: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    prefix_cache_hit_rate: float
    def __init__(self, loaded: _Optional[_Iterable[_Union[LoadedVersion, _Mapping]]] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., kv_slots: _Optional[int] = ..., max_waiting: _Optional[int] = ..., isolation: _Optional[str] = ..., connections_dropped: _Optional[int] = ..., connects_denied: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("model", "version", "alias")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    alias: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., alias: _Optional[str] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("loaded",)
    LOADED_FIELD_NUMBER: _ClassVar[int]
    loaded: LoadedVersion
    def __init__(self, loaded: _Optional[_Union[LoadedVersion, _Mapping]] = ...) -> None: ...

class UnloadRequest(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class UnloadResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class SyncAliasesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
