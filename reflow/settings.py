"""The one settings object: `REFLOW_*` environment variables, an optional YAML file, embedded defaults."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from reflow.addresses import parse_destination
from reflow.api_keys import MIN_API_KEY_LENGTH


class Settings(BaseSettings):
    """Every knob of every reflow process; docs/configuration.md is generated from the descriptions."""

    # hide_input_in_errors: a bad setting's error never echoes its value (a URL's password, a key)
    model_config = SettingsConfigDict(env_prefix="REFLOW_", extra="forbid", hide_input_in_errors=True)

    data_dir: Path = Field(Path(".reflow"), description="Where every embedded store lives.")
    database_url: str = Field(
        "",
        description=(
            "SQLAlchemy URL of the store: `postgresql://…` in production (through psycopg, installed "
            "with reflow; `postgres://` and `postgresql+psycopg://` mean the same), or `sqlite:///PATH`; "
            "any other dialect or driver is refused. Empty = SQLite in the data dir."
        ),
    )
    mlflow_tracking_uri: str = Field(
        "", description="MLflow tracking and registry URI; empty = a SQLite store in the data dir."
    )
    mlflow_artifact_root: str = Field(
        "",
        description=(
            "Artifact root for new MLflow experiments; empty = `<data-dir>/mlartifacts`, "
            "or the server decides when `REFLOW_MLFLOW_TRACKING_URI` is set."
        ),
    )
    mlflow_ui_port: int = Field(
        0, ge=0, le=65535, description="Port of the MLflow UI under `reflow up`; 0 = a free port."
    )
    api_key: SecretStr | None = Field(
        None,
        description=(
            "Key of the `default` tenant `reflow up` creates (16+ characters; a revoked key is never "
            "revived). Unset: the key saved in `<data-dir>/api_key`, else a new one, generated, printed "
            "once and saved there (0600)."
        ),
    )

    model_name: str = Field("arith", description="Registered model served by default.")
    model_alias: str = Field(
        "champion",
        description="Alias requests without a version or alias are routed to; a worker needs it to start.",
    )
    worker_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["champion", "challenger"],
        description="Aliases a worker serves and follows when they move in the registry (those that exist).",
    )
    registry_poll_s: float = Field(
        10.0, ge=0, description="How often a worker re-reads the aliases it follows; 0 = never."
    )
    model_preset: str = Field(
        "arith-small",
        description="Preset of the base model the bootstrap trains (`tiny`, `arith-small`, `arith-base`).",
    )
    task: Literal["", "arith", "terse", "numbered"] = Field(
        "",
        description=(
            "A demo task with an oracle: what `reflow simulate` asks and judges by, and what the fine-tune "
            "job also scores (its accuracy sets, the reasoning corrections are taught with). Empty (the "
            "default): no task, the job learns from whatever users rated. `arith` is the built-in demo "
            "model's, which knows nothing else (its bootstrap and fine-tunes use it whatever this says); "
            "`terse` (users want the bare answer) and "
            "`numbered` (users like numbered lists) are chat tasks. `reflow up --demo` sets `arith`, or "
            "`terse` for a chat model, when it is empty."
        ),
    )
    bootstrap_steps: int = Field(0, ge=0, description="Training steps of the base model; 0 = the recipe's.")
    device: str = Field("auto", description="`auto` (CUDA when present, else CPU), `cpu`, `cuda:N`.")
    torch_threads: int = Field(0, ge=0, description="Intra-op threads per worker; 0 = torch's default.")
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "`torch.compile(dynamic=True)` the decode step: `on`, `off`, or `auto` (on for CUDA; off on "
            "the CPU, where SmolLM2 in float32 measured 28.9 / 60.1 tokens/s compiled at 1 / 16 "
            "streams against 32.7 / 83.3 eager, after 23 s of compiling)."
        ),
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description=(
            "Dtype a worker serves weights in. `auto`: the built-in model in float32, as trained; others "
            "in bfloat16 on CUDA (float16 on GPUs without it) and on the CPU in the faster of float32 and "
            "bfloat16 as measured at the first load of each model shape (bfloat16 where at least 1.1x "
            "faster with 0.95 token agreement; docs/models.md#dtype-memory-and-speed)."
        ),
    )
    variants: Annotated[list[Literal["float32", "bfloat16", "float16", "int8", "int4"]], NoDecode] = Field(
        default_factory=list,
        description=(
            "Variants of each version a worker holds beside it for latency budgets, comma-separated: "
            "`int8` (weights int8 per group of 32 inputs, CPU), `int4` (weights in 4 bits per group of 32 "
            "inputs, CPU), `bfloat16`, `float16` (CUDA), `float32`; each has its "
            "own copy of the weights and its own REFLOW_KV_CACHE_MB; the bootstrap and full fine-tunes score "
            "each on the task when they register a version. Empty = the version alone."
        ),
    )
    max_batch_size: int = Field(
        64, ge=1, description="Sequences a worker decodes together, per loaded version (its batch rows)."
    )
    max_waiting: int = Field(
        256,
        ge=0,
        description=(
            "Sequences queued for a batch row and KV blocks before new requests get `RESOURCE_EXHAUSTED`."
        ),
    )
    kv_cache_mb: int = Field(
        0,
        ge=0,
        description=(
            "MiB of KV cache blocks per loaded version; 0 = room for `max_batch_size` sequences at the "
            "full context, at most 1024 MiB. Requests wait for blocks, never fail for them."
        ),
    )
    max_model_len: int = Field(
        0,
        ge=0,
        description=(
            "Longest prompt plus completion, in tokens; 0 = the model's own context. Lowered, when "
            "needed, so that one sequence fits the KV cache."
        ),
    )
    prefix_cache: bool = Field(
        True,
        description=(
            "Reuse the KV blocks of prompt prefixes: a prompt that starts with 16-token blocks an "
            "earlier prompt prefilled (a system prompt, a conversation's history) prefills only the "
            "rest, reusing only its own tenant's blocks. Outputs are what batching gives without it "
            "(docs/batching.md#exactness); false prefills every prompt whole."
        ),
    )
    speculative_tokens: int = Field(
        5,
        ge=0,
        le=16,
        description=(
            "Most tokens drafted per sequence and step by prompt lookup: where a sequence's last "
            "tokens occurred before in its prompt or output, what followed them is checked in the "
            "same decode forward, and the tokens the model picks too are kept, several a step. "
            "Outputs, greedy or seeded, are the same as without (docs/batching.md#exactness); drafts "
            "fill a step up to 8 decode rows. 0 = off."
        ),
    )
    prefill_chunk: int = Field(
        64,
        ge=1,
        description="Most prompt tokens one sequence prefills in a step (long prompts take several).",
    )
    max_prefill_tokens: int = Field(
        256, ge=1, description="Most prompt tokens prefilled per step, so decoding sequences keep their pace."
    )

    gateway_host: str = Field("127.0.0.1", description="Interface the gateway binds.")
    gateway_port: int = Field(50051, ge=0, le=65535, description="Gateway port; 0 = a free port.")
    http_port: int = Field(
        8000,
        ge=0,
        le=65535,
        description="Port of the gateway's OpenAI-compatible HTTP API; 0 = a free port.",
    )
    worker_host: str = Field(
        "127.0.0.1",
        description=(
            "Interface a worker binds. Off loopback a worker needs mTLS (`REFLOW_TLS_*`): its port "
            "trusts whoever calls it, so it refuses to start without."
        ),
    )
    worker_port: int = Field(0, ge=0, le=65535, description="Worker port; 0 = a free port.")
    workers: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="`host:port,host:port` a standalone gateway routes to."
    )
    worker_metrics_port: int = Field(
        0, ge=0, le=65535, description="Port of a worker's Prometheus endpoint; 0 = a free port."
    )
    gateway_metrics_port: int = Field(
        0, ge=0, le=65535, description="Port of the gateway's Prometheus endpoint; 0 = a free port."
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description=(
            "Interface the gateway's and workers' Prometheus endpoints bind (loopback by default: "
            "set it to scrape from another host). Each serves at most 16 connections at once."
        ),
    )
    worker_poll_s: float = Field(
        1.0, gt=0, description="How often the gateway refreshes worker status and the running experiments."
    )
    shutdown_grace_s: float = Field(30.0, description="Seconds in-flight streams get to finish on shutdown.")

    kafka_bootstrap: str = Field(
        "",
        description=(
            "Kafka bootstrap servers, `host:port[,host:port]`; empty = `reflow up` starts the embedded "
            "broker (and other commands use the one of a running `reflow up` in the same data dir)."
        ),
    )
    kafka_partitions: int = Field(
        3, ge=1, description="Partitions of each topic reflow creates (existing topics are left alone)."
    )
    kafka_handover_timeout_s: float = Field(
        5.0,
        gt=0,
        description="How long the gateway waits for Kafka's ack before writing to the outbox instead.",
    )
    consumer_batch_size: int = Field(
        1000, ge=1, description="Most records the consumer writes to the store in one transaction."
    )
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT",
        description=(
            "How every Kafka client of reflow talks to the brokers: `SSL` (TLS), `SASL_SSL` (TLS and a "
            "SASL login), `SASL_PLAINTEXT`, or `PLAINTEXT` (the embedded broker's)."
        ),
    )
    kafka_ssl_ca_file: str = Field(
        "", description="CA certificate (PEM) the Kafka clients trust for the brokers' certificates."
    )
    kafka_ssl_cert_file: str = Field(
        "", description="Client certificate (PEM) for brokers that require mutual TLS."
    )
    kafka_ssl_key_file: str = Field("", description="Private key (PEM) of that client certificate.")
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        "SCRAM-SHA-512", description="SASL mechanism with `SASL_SSL` or `SASL_PLAINTEXT`."
    )
    kafka_sasl_username: str = Field("", description="SASL user name.")
    kafka_sasl_password: SecretStr | None = Field(None, description="SASL password.")
    max_event_bytes: int = Field(
        900_000,
        ge=4096,
        description=(
            "Largest Kafka record a gateway publishes, in bytes; keep it under the brokers' "
            "`message.max.bytes` (about 1 MiB by default). An inference event over it has its "
            "conversation and completion cut to fit and says so (`truncated`); a record Kafka still "
            "refuses for good goes to the dead letters, never in front of the others."
        ),
    )
    event_queue_max: int = Field(
        10_000,
        ge=1,
        description=(
            "Inference events a gateway holds in memory while Kafka is slow; past it they go to the "
            "outbox on disk, as acknowledged feedback does."
        ),
    )

    finetune_interval_s: float = Field(
        300.0, gt=0, description="How often the scheduler considers a fine-tune run."
    )
    scheduler_lease_s: float = Field(
        30.0,
        gt=0,
        description="How long the scheduler's lease in the store lasts unless renewed (every third of it): "
        "one `reflow scheduler` runs the jobs, another stands by and takes over this long after the first "
        "is gone.",
    )
    finetune_min_samples: int = Field(
        200,
        ge=1,
        description="New labelled feedback items (joined with their completions) a scheduled run waits for.",
    )
    finetune_max_samples: int = Field(
        1000,
        ge=1,
        description="Most items one run uses: the oldest of what is new; the rest waits for the next run.",
    )
    finetune_max_per_user: int = Field(
        20,
        ge=1,
        description=(
            "Most items of one user (the rater, else the user served, else the completion rated) one "
            "run takes, the oldest first: a busy user cannot outweigh the others in a training set."
        ),
    )
    finetune_method: Literal["auto", "full", "lora"] = Field(
        "auto",
        description=(
            "How the fine-tune job trains: `lora` trains a low-rank adapter over the champion's frozen "
            "weights (registered in PEFT's format, served over the champion in the same batches); "
            "`full` trains every weight of a copy; `auto` is `lora` for Llama-family models and `full` "
            "for the built-in demo model, small enough to train in full (`lora` works on it too)."
        ),
    )
    finetune_steps: int | None = Field(
        None, ge=1, description="Optimizer steps of a fine-tune run; unset: 200 in full, 20 with LoRA."
    )
    finetune_batch_size: int | None = Field(
        None,
        ge=2,
        description=(
            "Supervised rows per step, half of them replayed (general prompts, or a demo task's base "
            "problems); unset: 32 in full, 8 with LoRA."
        ),
    )
    finetune_lr: float | None = Field(
        None,
        gt=0,
        description=(
            "Peak learning rate of a fine-tune run (warmup, then cosine decay); unset: 3e-4 in full, "
            "1e-3 with LoRA."
        ),
    )
    lora_rank: int = Field(8, ge=1, le=256, description="Rank of the adapters the fine-tune job trains.")
    lora_alpha: float = Field(
        16.0, gt=0, description="LoRA alpha: an adapter's update is scaled by alpha / rank."
    )
    lora_targets: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description=(
            "The linear layers an adapter adapts, by their Hugging Face names (comma-separated in the "
            "environment)."
        ),
    )
    finetune_holdout_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description=(
            "Share of users whose feedback is held out to judge the candidate (by a hash of `user_id`; "
            "an item without one is a user of its own)."
        ),
    )
    finetune_regression_tolerance: float = Field(
        0.02,
        ge=0,
        le=1,
        description="Largest drop in regression-set accuracy a registered candidate may have.",
    )
    finetune_max_regression_kl: float = Field(
        0.5,
        ge=0,
        description=(
            "The most a registered candidate's mean per-token KL to the champion may be, in nats, over "
            "the champion's own greedy answers to a fixed set of general prompts "
            "(an adapter that learned `terse` on SmolLM2 measured 0.21 in 20 steps, 0.31 in 30: "
            "sharper on those answers, not worse, as their likelihood rose)."
        ),
    )
    finetune_max_regression_nll_increase: float = Field(
        0.1,
        ge=0,
        description=(
            "How much less likely (mean negative log-likelihood per token, nats) a registered "
            "candidate may find the champion's answers to those prompts."
        ),
    )
    general_prompts_file: str = Field(
        "",
        description=(
            "A file of general prompts, one per line, for a model whose users do not chat about everyday "
            "things: every other line is replayed in training (the champion's own answers to it), the "
            "rest is where the gate measures KL and NLL drift. Empty: built-in everyday chat prompts."
        ),
    )
    finetune_reward_margin: float = Field(
        0.05,
        ge=0,
        lt=0.5,
        description=(
            "How far above chance (0.5) the lower 95% confidence bound of a candidate's reward AUC must "
            "be: the chance that it ranks a held-out completion users wanted above one they did not, by "
            "its log-likelihood ratio to the champion."
        ),
    )
    finetune_min_held_out: int = Field(
        5,
        ge=1,
        description="Held-out wanted and unwanted completions (each) a run needs to judge its candidate.",
    )

    ab_traffic: float = Field(
        0.1,
        gt=0,
        lt=1,
        description=(
            "Share of users (requests without a `user_id` count one each) an experiment sends to the "
            "challenger."
        ),
    )
    ab_alpha: float = Field(
        0.05,
        gt=0,
        lt=1,
        description=(
            "Chance an experiment promotes or rolls back a challenger no different from the champion, "
            "however often it is evaluated."
        ),
    )
    ab_min_samples: int = Field(
        100, ge=1, description="Rated responses each arm needs before an experiment decides."
    )
    ab_max_per_user: int = Field(
        5,
        ge=1,
        description=(
            "Most rated responses of one user an arm's rate counts at full weight: users, not "
            "responses, are the unit of the test, and a user weighs at most this many responses."
        ),
    )
    ab_evaluate_s: float = Field(
        30.0,
        gt=0,
        description=(
            "How often the scheduler evaluates running experiments (and opens one for a new challenger)."
        ),
    )
    ab_max_duration_s: float = Field(
        86400.0,
        gt=0,
        description=(
            "An experiment still undecided after this long expires: the challenger is removed, the "
            "champion stays."
        ),
    )
    ab_max_error_rate_increase: float = Field(
        0.02,
        ge=0,
        le=1,
        description=(
            "Guardrail: a challenger whose error rate exceeds the champion's by more is rolled back."
        ),
    )
    ab_max_latency_ratio: float = Field(
        1.5,
        ge=1,
        description=(
            "Guardrail: a challenger whose p95 latency exceeds this multiple of the champion's is "
            "rolled back."
        ),
    )

    isolation: Literal["auto", "ebpf", "none"] = Field(
        "auto",
        description=(
            "Worker isolation: `ebpf`, `none`, or `auto` (eBPF where the host allows it, else none, with "
            "a warning saying why). `ebpf` refuses to start a worker the host cannot isolate."
        ),
    )
    isolation_allow_from: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="`CIDR,CIDR`: addresses of gateways on other hosts an isolated worker admits.",
    )
    isolation_egress: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "`ADDR[/PREFIX][:PORT],…` (IPv6 in brackets before a port) an isolated worker may connect to. "
            "Empty = nothing, but the MLflow server when the tracking URI is `http(s)`, which is always "
            "allowed."
        ),
    )
    bpf_object: str = Field(
        "",
        description=(
            "The compiled isolation programs; empty = `build/bpf/isolation.bpf.o` in the source tree "
            "(`make bpf`)."
        ),
    )
    tls_ca_file: str = Field(
        "",
        description=(
            "CA certificate (PEM) that signs gateway and worker certificates; with the two below, "
            "gateway ↔ worker calls use mTLS."
        ),
    )
    tls_cert_file: str = Field(
        "",
        description=(
            "This process's certificate (PEM): a worker's server certificate, a gateway's client certificate."
        ),
    )
    tls_key_file: str = Field("", description="This process's private key (PEM).")
    gateway_tls_cert_file: str = Field(
        "",
        description=(
            "The gateway's certificate chain (PEM, its own certificate first; it must name the host "
            "clients connect to); with the key below, both public ports serve TLS (gRPC, and HTTPS for "
            "the OpenAI API). Callers need no certificate: their API key identifies them."
        ),
    )
    gateway_tls_key_file: str = Field("", description="The gateway's private key (PEM).")
    gateway_ca_file: str = Field(
        "",
        description=(
            "The CA certificate (PEM) clients of the gateway (`reflow generate`, `reflow simulate`, "
            "`reflow up`'s health check and demo users) trust for its certificate (the certificate "
            "itself when self-signed); empty = plaintext."
        ),
    )

    auth_cache_ttl_s: float = Field(
        10.0, ge=0, description="How long a gateway keeps a key's lookup (found or not) in its own L1 cache."
    )
    auth_failures_per_minute: int = Field(
        60,
        ge=1,
        description=(
            "Unknown or revoked API keys one client address may present per minute; past it that "
            "address gets RESOURCE_EXHAUSTED (HTTP 429) without a store lookup until the minute ends."
        ),
    )
    max_request_bytes: int = Field(
        1024 * 1024,
        ge=64 * 1024,
        description=(
            "Largest request body (HTTP) or message (gRPC) a gateway reads, only once the caller's key "
            "is checked; a larger one gets HTTP 413 / RESOURCE_EXHAUSTED."
        ),
    )
    max_concurrent_requests: int = Field(
        1024,
        ge=1,
        description=(
            "Requests each public face (gRPC, HTTP) holds at once; past it a new one is refused "
            "(HTTP 503, gRPC RESOURCE_EXHAUSTED) rather than held in memory."
        ),
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description=(
            "Seconds an HTTP client has to send a request's headers before the gateway closes its "
            "connection (slow clients hold no connection for long)."
        ),
    )
    redis_url: str = Field(
        "",
        description=(
            "Redis shared by gateway replicas (`redis://host:6379/0`, `rediss://` for TLS): the second "
            "level of the key cache, revocations announced to every replica, and quotas counted across "
            "them. Empty = each gateway on its own (one replica, as `reflow up`). Also set it where "
            "`reflow tenants revoke` runs, so replicas hear of a revocation at once."
        ),
    )
    redis_prefix: str = Field(
        "reflow:", description="Prefix of every Redis key and channel, so deployments can share one Redis."
    )
    redis_key_ttl_s: float = Field(
        60.0, gt=0, description="How long Redis keeps a found API key (the shared level, L2)."
    )
    redis_lease_s: float = Field(
        15.0,
        gt=0,
        description=(
            "Lease of a stream's slot in Redis, renewed while it runs: a gateway that dies gives its "
            "tenants' slots back within it."
        ),
    )
    redis_timeout_s: float = Field(
        0.5,
        gt=0,
        description=(
            "Longest wait for a Redis reply; past it the gateway serves without Redis (its own cache "
            "and quotas) until Redis answers again."
        ),
    )
    max_prompt_chars: int = Field(4096, ge=1, description="Longest prompt the gateway accepts.")
    default_max_tokens: int = Field(64, ge=1, description="`max_tokens` when a request leaves it 0.")
    max_stop_strings: int = Field(8, ge=0, description="Most stop strings per request.")
    metrics_max_tenants: int = Field(
        100,
        ge=0,
        description=(
            "Tenants a gateway labels its per-tenant series with (generations, feedback items), the "
            "first it counts; the rest share the label `(other)`, so the series stay bounded."
        ),
    )
    max_feedback_items: int = Field(
        1000,
        ge=1,
        description=(
            "Most feedback items one request (a SubmitFeedback stream, a `POST /v1/feedback`) carries; "
            "past it the request is refused with RESOURCE_EXHAUSTED (HTTP 413) after the items before "
            "the bound were taken (a retry with the same `feedback_id`s stores them once)."
        ),
    )
    reasoning_budget_floor: int = Field(
        16,
        ge=0,
        description=(
            "Fewest thinking tokens the gateway lowers a request's reasoning budget to when even the "
            "fastest variant is predicted to miss its deadline (never above the request's own)."
        ),
    )

    @field_validator("api_key", mode="before")
    @classmethod
    def _check_api_key(cls, value: object) -> object:
        """An empty key means none; a short one is refused rather than stored weak."""
        raw = value.get_secret_value() if isinstance(value, SecretStr) else value
        if raw in ("", None):
            return None
        if isinstance(raw, str) and len(raw) < MIN_API_KEY_LENGTH:
            raise ValueError(f"REFLOW_API_KEY needs at least {MIN_API_KEY_LENGTH} characters")
        return value

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        """A set URL names the driver reflow installs (`postgresql://` means psycopg); others are refused."""
        if not value:
            return value
        # imported here: SQLAlchemy would add 0.2 s to every process that reads the settings
        from reflow.store.urls import store_url

        return store_url(value).render_as_string(hide_password=False)

    @field_validator(
        "workers",
        "worker_aliases",
        "variants",
        "isolation_allow_from",
        "isolation_egress",
        "lora_targets",
        mode="before",
    )
    @classmethod
    def _split_addresses(cls, value: object) -> object:
        """Accepts `a,b,c` from the environment (host:port lists, alias lists) as well as a list."""
        if isinstance(value, str):
            return [a.strip() for a in value.split(",") if a.strip()]
        return value

    @field_validator("isolation_allow_from")
    @classmethod
    def _check_sources(cls, value: list[str]) -> list[str]:
        for entry in value:
            ipaddress.ip_network(entry, strict=False)  # ValueError names the bad entry
        return value

    @field_validator("isolation_egress")
    @classmethod
    def _check_destinations(cls, value: list[str]) -> list[str]:
        for entry in value:
            parse_destination(entry)
        return value

    @field_validator(
        "tls_ca_file", "tls_cert_file", "tls_key_file", "gateway_tls_cert_file", "gateway_tls_key_file",
        "gateway_ca_file", "general_prompts_file", "kafka_ssl_ca_file", "kafka_ssl_cert_file",
        "kafka_ssl_key_file",
    )  # fmt: skip
    @classmethod
    def _check_file(cls, value: str) -> str:
        if value and not Path(value).is_file():
            raise ValueError(f"{value} is not a file")
        return value

    @model_validator(mode="after")
    def _check_tls_together(self) -> Settings:
        files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if any(files) and not all(files):
            raise ValueError(
                "mTLS needs REFLOW_TLS_CA_FILE, REFLOW_TLS_CERT_FILE and REFLOW_TLS_KEY_FILE together"
            )
        if bool(self.gateway_tls_cert_file) != bool(self.gateway_tls_key_file):
            raise ValueError(
                "gateway TLS needs REFLOW_GATEWAY_TLS_CERT_FILE and REFLOW_GATEWAY_TLS_KEY_FILE together"
            )
        return self

    @property
    def tls(self) -> bool:
        """Whether the gateway-worker channel uses mTLS (the three files are set together)."""
        return bool(self.tls_ca_file)

    @property
    def gateway_tls(self) -> bool:
        """Whether the gateway's public ports serve TLS (its certificate and key are set together)."""
        return bool(self.gateway_tls_cert_file)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Precedence: arguments, then REFLOW_* variables, then the YAML file in REFLOW_CONFIG."""
        yaml_file = os.environ.get("REFLOW_CONFIG")
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        if yaml_file:
            sources += (YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file),)
        return sources

    @property
    def resolved_database_url(self) -> str:
        """The store's URL, defaulting to SQLite in the data dir."""
        return self.database_url or f"sqlite:///{self.data_dir.resolve() / 'reflow.db'}"

    @property
    def resolved_tracking_uri(self) -> str:
        """The MLflow URI, defaulting to a SQLite store in the data dir."""
        return self.mlflow_tracking_uri or f"sqlite:///{self.data_dir.resolve() / 'mlflow.db'}"

    @property
    def resolved_artifact_root(self) -> str | None:
        """Where new experiments keep artifacts; None lets a remote tracking server decide."""
        if self.mlflow_artifact_root:
            return self.mlflow_artifact_root
        if self.mlflow_tracking_uri:
            return None
        return (self.data_dir.resolve() / "mlartifacts").as_uri()

    @property
    def outbox_path(self) -> Path:
        """The durable outbox: records waiting for Kafka while it is unreachable."""
        return self.data_dir.resolve() / "outbox.db"

    @property
    def model_cache_dir(self) -> Path:
        """Local copies of downloaded model versions."""
        return self.data_dir.resolve() / "models"
