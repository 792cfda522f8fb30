"""The Worker gRPC service (generate over a loaded version, status, load, unload, sync aliases) and
the `reflow worker` process around it: isolation first, then the versions it serves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health

from reflow import structured_output
from reflow.addresses import is_loopback
from reflow.errors import FailedPrecondition, InvalidArgument, NotFound, ReflowError
from reflow.mtls import TlsFiles, server_credentials
from reflow.private_files import private_dir
from reflow.registry import Registry
from reflow.serving import (
    bind,
    check_registry,
    host_port,
    new_server,
    set_serving,
    start_metrics_server,
    stop_signal,
    write_ready_file,
)
from reflow.settings import Settings
from reflow.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from workers.batch_scheduler import BatchScheduler
from workers.engine import Engine, EngineConfig
from workers.follower import AliasFollower
from workers.isolation import Isolation, IsolationConfig, NoIsolation, isolate
from workers.isolation.host import DEFAULT_OBJECT
from workers.metrics import WorkerMetrics
from workers.models.interface import Tokenizer
from workers.models.loader import resolve_device, resolve_dtype
from workers.models.prompts import chat_ids
from workers.residency import (
    UNMEASURED_REFERENCE,
    Copy,
    DtypeChoice,
    Resident,
    ResidentAdapter,
    ResidentVersion,
)
from workers.sampling import SamplingParams, TokenLogprob
from workers.sequence import Delta, GenerationParams
from workers.tool_calls import CallParser, Tool, ToolUse, format_of
from workers.variants import check_variants
from workers.versions import Versions

logger = logging.getLogger(__name__)
SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def params_from_pb(
    request: worker_pb2.WorkerGenerateRequest, vocab_size: int, tool_use: ToolUse | None = None
) -> GenerationParams:
    """Decode parameters of a worker request (the gateway has applied defaults and limits; the
    logit bias's token ids are checked against the model's vocabulary here), its grammar the
    calls it must make where `tool_use` forces some, else its structured output's."""
    s = request.sampling
    if s.max_tokens == 0 and not request.prompt_only:
        raise InvalidArgument("sampling.max_tokens must be at least 1")
    check_vocabulary(request, s.logit_bias, vocab_size, "sampling.logit_bias")
    sampling = SamplingParams(
        s.temperature, s.top_p or 1.0, s.top_k, s.seed,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0, logit_bias=tuple(sorted(s.logit_bias.items())),
    )  # fmt: skip
    return GenerationParams(
        max_tokens=0 if request.prompt_only else s.max_tokens,
        sampling=sampling,
        stop=tuple(s.stop),
        reasoning_budget=request.reasoning_budget,
        top_logprobs=request.top_logprobs if request.logprobs else None,
        prompt_logprobs=request.prompt_logprobs,
        grammar=(tool_use and tool_use.grammar()) or structured_output.grammar(request.structured_output),
    )


def tool_use_of(request: worker_pb2.WorkerGenerateRequest, tokenizer: Tokenizer) -> ToolUse | None:
    """The request's tools on this model (checked by the gateway); None without tools or with
    tool choice "none"; InvalidArgument where the model's chat template takes no tools."""
    choice = request.tool_choice
    if not request.tools or choice.mode == "none":
        return None
    format = format_of(tokenizer.chat_template)
    if format is None:
        raise InvalidArgument(
            f"{request.model}/{request.version}'s chat template takes no tools (or calls them in a format "
            "reflow does not parse: it parses Hermes's <tool_call> tags, as Qwen's templates teach, and "
            "Llama 3.1's JSON); send the request without tools",
            param="tools",
        )
    tools = tuple(
        Tool(t.name, t.description, json.loads(t.parameters) if t.parameters else None) for t in request.tools
    )
    forced = tools if choice.mode == "required" else tuple(t for t in tools if t.name == choice.function)
    return ToolUse(tools, format, forced, one=choice.mode == "function")


def chat_of(request: worker_pb2.WorkerGenerateRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates take it (transformers' messages): a call's arguments as
    an object, which templates write out with `tojson`."""
    messages = []
    for m in request.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.loads(c.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def check_vocabulary(
    request: worker_pb2.WorkerGenerateRequest, token_ids: Iterable[int], vocab_size: int, param: str
) -> None:
    """InvalidArgument naming `param` for a token id past the vocabulary of the requested model."""
    bad = next((i for i in token_ids if i >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"{param} holds {bad}, past the vocabulary of {request.model}/{request.version} "
            f"(ids 0 to {vocab_size - 1})",
            param=param,
        )


def prompt_ids_of(
    request: worker_pb2.WorkerGenerateRequest, loaded: Resident, tool_use: ToolUse | None = None
) -> list[int]:
    """The prompt's token ids: as sent (each within the model's vocabulary), else the conversation
    rendered with the model's chat template (which carries its own bos token) and `tool_use`'s tools,
    else the prompt text."""
    tokenizer = loaded.tokenizer
    if request.prompt_token_ids:
        check_vocabulary(request, request.prompt_token_ids, loaded.model.vocab_size, "prompt_token_ids")
        return list(request.prompt_token_ids)
    if not request.messages:
        return tokenizer.encode(request.prompt)
    try:
        tools = None if tool_use is None else [tool.rendered() for tool in tool_use.tools]
        return chat_ids(tokenizer, chat_of(request), tools)
    except ValueError as error:  # no chat template, or one that refuses the conversation
        raise InvalidArgument(f"{request.model}/{request.version}: {error}") from None


def delta_to_pb(delta: Delta, tokenizer: Tokenizer) -> worker_pb2.WorkerGenerateResponse:
    """Wire form of one delta, its tokens' log probabilities with their text; the last one carries
    the token counts."""
    message = worker_pb2.WorkerGenerateResponse(
        token_ids=delta.token_ids,
        text=delta.text,
        reasoning_text=delta.reasoning_text,
        finish_reason=f"FINISH_REASON_{delta.finish_reason.name}" if delta.finish_reason else None,
        logprobs=[logprob_to_pb(entry, tokenizer) for entry in delta.logprobs],
        prompt_logprobs=[logprob_to_pb(entry, tokenizer) for entry in delta.prompt_logprobs],
    )
    if delta.usage is not None:
        message.prompt_tokens = delta.usage.prompt_tokens
        message.completion_tokens = delta.usage.completion_tokens
        message.reasoning_tokens = delta.usage.reasoning_tokens
        message.cached_tokens = delta.usage.cached_tokens
    return message


def parse_calls(message: worker_pb2.WorkerGenerateResponse, calls: CallParser) -> None:
    """Moves the tool calls in a delta's answer text into its tool_calls (all that is held back,
    on the last delta); the finish reason of an answer that called tools and ended is TOOL_CALLS."""
    text, pieces = calls.push(message.text)
    if message.finish_reason:
        rest, more = calls.finish()
        text, pieces = text + rest, pieces + more
        if calls.calls and message.finish_reason == inference_pb2.FINISH_REASON_STOP:
            message.finish_reason = inference_pb2.FINISH_REASON_TOOL_CALLS
    message.text = text
    message.tool_calls.extend(
        inference_pb2.ToolCallDelta(index=p.index, id=p.id, name=p.name, arguments=p.arguments)
        for p in pieces
    )


def logprob_to_pb(entry: TokenLogprob, tokenizer: Tokenizer) -> inference_pb2.TokenLogprob:
    """Wire form of a token's log probability and its alternatives, each token with its text."""
    top = [
        inference_pb2.TokenLogprob(token_id=i, token=tokenizer.decode([i]), logprob=p) for i, p in entry.top
    ]
    token = tokenizer.decode([entry.token_id])
    return inference_pb2.TokenLogprob(
        token_id=entry.token_id, token=token, logprob=entry.logprob, top_logprobs=top
    )


def loaded_to_pb(loaded: Resident, engine: Engine) -> worker_pb2.LoadedVersion:
    """Wire form of a loaded version or adapter, with the copies it runs on: its reference first
    (an adapter's is its base's), then its measured variants."""
    held = engine.copies(loaded.name, loaded.version)
    pool = held[0][1]  # the reference copy's scheduler (an adapter's base's)
    listed = [(c, s) for c, s in held if c.reference or c.quality is not None]
    adapter = loaded.adapter if isinstance(loaded, ResidentAdapter) else None
    choice = loaded.dtype_choice if isinstance(loaded, ResidentVersion) else None
    return worker_pb2.LoadedVersion(
        model=loaded.name,
        version=loaded.version,
        aliases=sorted(loaded.aliases),
        parameters=loaded.model.parameter_count(),
        device=str(loaded.device),
        max_sequence_length=loaded.max_len,
        dtype=loaded.reference.name,
        base_version=loaded.base_version,
        tenant=loaded.tenant,
        adapter_parameters=adapter.parameter_count() if adapter is not None else 0,
        variants=[copy_to_pb(c, scheduler, loaded.task_scores.get(c.name)) for c, scheduler in listed],
        kv_blocks_used=pool.blocks_used,
        kv_blocks_total=pool.n_blocks,
        kv_block_size=pool.block_size,
        kv_blocks_cached=pool.blocks_cached,
        prefix_cache_hit_rate=pool.hit_rate,
        reasons=loaded.tokenizer.reasoning_markers is not None,
        dtype_candidates=dtype_choice_to_pb(choice) if choice is not None else [],
    )


def dtype_choice_to_pb(choice: DtypeChoice) -> list[worker_pb2.DtypeCandidate]:
    """Wire form of what REFLOW_DTYPE=auto measured for a version's shape."""
    return [
        worker_pb2.DtypeCandidate(dtype=c.dtype, rows=choice.rows, step_ms=c.step_ms,
                                  token_agreement=c.token_agreement, chosen=c.dtype == choice.chosen)
        for c in choice.candidates
    ]  # fmt: skip


def copy_to_pb(copy: Copy, scheduler: BatchScheduler, task_score: float | None) -> worker_pb2.LoadedVariant:
    """Wire form of a copy of a version's weights, as measured (a reference nobody measured: agreement
    1, speeds 0), and its load now."""
    quality = copy.quality or UNMEASURED_REFERENCE
    return worker_pb2.LoadedVariant(
        name=copy.name,
        reference=copy.reference,
        greedy_agreement=quality.greedy_agreement,
        token_agreement=quality.token_agreement,
        prefill_ms_per_token=quality.prefill_ms_per_token,
        decode_ms_per_token=quality.decode_ms_per_token,
        running=scheduler.running,
        waiting=scheduler.waiting,
        kv_blocks_used=scheduler.blocks_used,
        kv_blocks_total=scheduler.n_blocks,
        weight_bytes=quality.weight_bytes,
        task_score=task_score,
    )


def resident_memory_bytes() -> int:
    """Resident set size of this process (Linux), 0 where unknown."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    import resource

    return pages * resource.getpagesize()


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves the versions held by an Engine."""

    def __init__(self, versions: Versions, isolation: Isolation | None = None):
        self.versions = versions
        self.follower: AliasFollower | None = None  # None when pinned to one version
        self.isolation: Isolation = isolation or NoIsolation()

    @property
    def engine(self) -> Engine:
        """The engine the versions are loaded into."""
        return self.versions.engine

    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        loaded = self.engine.get(request.model, request.version)
        loaded.last_request = time.monotonic()
        tool_use = tool_use_of(request, loaded.tokenizer)
        params = params_from_pb(request, loaded.model.vocab_size, tool_use)
        prompt_ids = prompt_ids_of(request, loaded, tool_use)
        stream = self.engine.generate(
            request.model, request.version, prompt_ids, params, request.variant, cache_salt=request.cache_salt
        )
        calls = None if tool_use is None else CallParser(tool_use.format)
        async with contextlib.aclosing(stream):  # a cancelled call frees its slot at once
            async for delta in stream:
                message = delta_to_pb(delta, loaded.tokenizer)
                if calls is not None:
                    parse_calls(message, calls)
                yield message

    async def Status(
        self, request: worker_pb2.WorkerStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatusResponse:
        return self.status()

    async def SyncAliases(
        self, request: worker_pb2.SyncAliasesRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatusResponse:
        if self.follower is None:
            raise FailedPrecondition("this worker is pinned to one version and follows no alias")
        # shielded: a caller giving up must not leave a version loaded halfway through a move
        await asyncio.shield(self.follower.sync())
        return self.status()

    def status(self) -> worker_pb2.WorkerStatusResponse:
        """Loaded versions, queue depth and memory."""
        device = self.versions.device
        device_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        stats = self.isolation.stats()
        blocks_used, blocks_total = self.engine.kv_blocks()
        blocks_cached, hit_rate = self.engine.prefix_cache()
        return worker_pb2.WorkerStatusResponse(
            loaded=[loaded_to_pb(m, self.engine) for m in self.engine.loaded()],
            running=self.engine.running,
            waiting=self.engine.waiting,
            memory_bytes=resident_memory_bytes(),
            device_memory_bytes=device_bytes,
            kv_slots=self.engine.kv_slots,
            kv_blocks_used=blocks_used,
            kv_blocks_total=blocks_total,
            kv_blocks_cached=blocks_cached,
            prefix_cache_hit_rate=hit_rate,
            max_waiting=self.engine.config.max_waiting,
            isolation=self.isolation.name,
            connections_dropped=stats.get("ingress_dropped", 0),
            connects_denied=stats.get("egress_denied", 0),
        )

    async def Load(
        self, request: worker_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.LoadResponse:
        if not request.model or not (request.version or request.alias):
            raise InvalidArgument("Load needs a model and a version or an alias")
        loaded = await self.versions.load(request.model, version=request.version, alias=request.alias)
        return worker_pb2.LoadResponse(loaded=loaded_to_pb(loaded, self.engine))

    async def Unload(
        self, request: worker_pb2.UnloadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.UnloadResponse:
        return worker_pb2.UnloadResponse(unloaded=self.engine.remove(request.model, request.version))


async def create_server(
    servicer: WorkerServicer, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A started Worker server on host:port (0 = free), over mTLS when `credentials` are given;
    returns (server, port, health servicer)."""
    server, health_servicer = new_server([SERVICE])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    bound = bind(server, host, port, credentials, setting="REFLOW_WORKER_PORT (--port)")
    await server.start()
    await set_serving(health_servicer, [SERVICE], True)
    return server, bound, health_servicer


def isolation_config(settings: Settings) -> IsolationConfig:
    """REFLOW_ISOLATION and its neighbours, for this worker's instance (its data dir)."""
    bpf_object = Path(settings.bpf_object) if settings.bpf_object else DEFAULT_OBJECT
    return IsolationConfig(
        settings.isolation, settings.data_dir, tuple(settings.isolation_allow_from),
        tuple(settings.isolation_egress), bpf_object, settings.resolved_tracking_uri,
    )  # fmt: skip


def engine_config(settings: Settings, device: torch.device) -> EngineConfig:
    """Batching limits from settings; `compile=auto` compiles on CUDA only (no gain on CPU)."""
    compile_on = settings.compile == "on" or (settings.compile == "auto" and device.type == "cuda")
    return EngineConfig(
        max_batch_size=settings.max_batch_size,
        max_waiting=settings.max_waiting,
        prefill_chunk=settings.prefill_chunk,
        max_prefill_tokens=settings.max_prefill_tokens,
        compile=compile_on,
        kv_cache_mb=settings.kv_cache_mb,
        max_model_len=settings.max_model_len,
        prefix_cache=settings.prefix_cache,
        speculative_tokens=settings.speculative_tokens,
    )


def check_exposure(settings: Settings) -> None:
    """Refuses a worker port other hosts may reach without mTLS: the port trusts whoever calls it
    (no API key, no quota, load and unload), so off loopback a caller must prove itself with a
    certificate the CA signed."""
    if settings.tls or is_loopback(settings.worker_host):
        return
    raise ReflowError(
        f"REFLOW_WORKER_HOST={settings.worker_host} lets other hosts reach the worker port, which "
        "trusts every caller (no API key, no quota); set REFLOW_TLS_CA_FILE, REFLOW_TLS_CERT_FILE and "
        "REFLOW_TLS_KEY_FILE so only gateways with a certificate your CA signed get in, or bind "
        "REFLOW_WORKER_HOST=127.0.0.1"
    )


SERVE_A_REGISTERED_MODEL = (
    "set REFLOW_MODEL_NAME and REFLOW_MODEL_ALIAS to a registered model (`reflow models list`), or "
    "register one (`reflow models import PATH --name NAME`)"
)


async def serve(settings: Settings, *, version: str = "", ready_file: Path | None = None) -> None:
    """`reflow worker`: refuse an unauthenticated port off loopback, isolate, load the configured
    version, serve until SIGINT/SIGTERM, drain."""
    check_exposure(settings)
    try:
        resolve_device(settings.device)
    except RuntimeError as error:  # a device torch cannot see: say so before anything starts
        raise ReflowError(str(error)) from None
    # before the first socket: a socket keeps the cgroup it was made in
    isolation = isolate(isolation_config(settings))
    try:
        await asyncio.to_thread(check_registry, settings.resolved_tracking_uri)
        await _serve_isolated(settings, isolation, version, ready_file)
    except NotFound as error:  # here only from the start-up loads: the model it was told to serve
        raise NotFound(f"{error}; {SERVE_A_REGISTERED_MODEL}") from None
    finally:
        isolation.teardown()


async def _serve_isolated(
    settings: Settings, isolation: Isolation, version: str, ready_file: Path | None
) -> None:
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    device = resolve_device(settings.device)
    private_dir(settings.data_dir)  # the model cache's
    metrics = WorkerMetrics()
    engine = Engine(engine_config(settings, device), metrics)
    dtype = resolve_dtype(settings.dtype)
    variants = tuple(settings.variants)
    check_variants(variants, device)
    registry = Registry.from_settings(settings)
    versions = Versions(engine, registry, settings.model_cache_dir, device, dtype, variants)
    servicer = WorkerServicer(versions, isolation)
    metrics.watch_isolation(isolation.stats)
    follower = None
    if version:  # pinned: serve exactly this version
        await versions.load(settings.model_name, version=version)
    else:  # the default alias must exist; the others (a challenger) are loaded when they do
        await versions.load(settings.model_name, alias=settings.model_alias)
        follower = servicer.follower = AliasFollower(
            versions, settings.model_name, settings.worker_aliases, settings.registry_poll_s
        )
        await follower.sync(strict=True)  # every version it follows, or no start
    metrics_server, metrics_url = start_metrics_server(  # first: a port taken leaves no gRPC server behind
        metrics.registry, settings.metrics_host, settings.worker_metrics_port,
        setting="REFLOW_WORKER_METRICS_PORT",
    )  # fmt: skip
    server, port, health_servicer = await create_server(
        servicer,
        settings.worker_host,
        settings.worker_port,
        server_credentials(TlsFiles.from_settings(settings)),
    )
    isolation.open_port(metrics_server.server_port)  # Prometheus may scrape from anywhere
    address = host_port(settings.worker_host, port)
    logger.info(
        "worker serving on %s device=%s compile=%s isolation=%s tls=%s metrics %s",
        address, device, engine.config.compile, isolation.name, settings.tls, metrics_url,
    )  # fmt: skip
    stopped = stop_signal()
    write_ready_file(ready_file, address=address, metrics=metrics_url)
    following = asyncio.create_task(follower.run()) if follower and settings.registry_poll_s else None
    await stopped
    if following is not None:
        following.cancel()
    logger.info("worker draining (grace %.0fs)", settings.shutdown_grace_s)
    await set_serving(health_servicer, [SERVICE], False)
    await server.stop(settings.shutdown_grace_s)
    engine.close()
    metrics_server.shutdown()
