"""Prometheus series of one worker: latency histograms, throughput, batch and KV-slot occupancy."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from reflow.metrics import BATCH_BUCKETS, LATENCY_BUCKETS
from workers.batch_scheduler import Output
from workers.residency import DtypeChoice, Quality


class WorkerMetrics:
    """The series a worker exports, in a registry of its own (so tests can run many workers)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "reflow_worker_time_to_first_token_seconds",
            "Enqueued to first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "reflow_worker_inter_token_seconds", "Between consecutive tokens of a sequence.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            "reflow_worker_queue_seconds",
            "Enqueued to admitted into a KV slot.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "reflow_worker_step_seconds", "Duration of one engine step.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "reflow_worker_decode_batch_size",
            "Sequences decoded together in a step.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "reflow_worker_generated_tokens", "Tokens generated (rate() = tokens/s).", registry=r
        )
        self.finished = Counter(
            "reflow_worker_sequences_finished",
            "Finished sequences by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.draft_tokens = Counter(
            "reflow_worker_draft_tokens",
            "Tokens prompt lookup drafted, each a decode row (REFLOW_SPECULATIVE_TOKENS).",
            registry=r,
        )
        self.accepted_draft_tokens = Counter(
            "reflow_worker_draft_tokens_accepted",
            "Of reflow_worker_draft_tokens, those the model picked too (the ratio: acceptance rate).",
            registry=r,
        )
        self.running = Gauge("reflow_worker_running_sequences", "Sequences admitted to a batch.", registry=r)
        self.waiting = Gauge(
            "reflow_worker_waiting_sequences", "Sequences queued for a batch row and KV blocks.", registry=r
        )
        self.kv_slots_in_use = Gauge("reflow_worker_kv_slots_in_use", "Batch rows in use.", registry=r)
        self.kv_slots = Gauge(
            "reflow_worker_kv_slots", "Batch rows over loaded versions (max_batch_size each).", registry=r
        )
        self.kv_blocks_used = Gauge("reflow_worker_kv_blocks_used", "KV cache blocks held.", registry=r)
        self.kv_blocks = Gauge("reflow_worker_kv_blocks", "KV cache blocks allocated.", registry=r)
        self.kv_blocks_cached = Gauge(
            "reflow_worker_kv_blocks_cached",
            "KV cache blocks holding a prompt prefix for reuse, held or not (REFLOW_PREFIX_CACHE).",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "reflow_worker_prompt_tokens",
            "Prompt tokens of sequences that reached their first token.",
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "reflow_worker_prefix_cache_hit_tokens",
            "Of reflow_worker_prompt_tokens, those reused from the prefix cache (the ratio: hit rate).",
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "reflow_worker_kv_cache_usage", "KV cache blocks held / allocated (0 to 1).", registry=r
        )
        self.variant_agreement = Gauge(
            "reflow_worker_variant_greedy_agreement",
            "Share of its version's greedy tokens a variant reproduces (REFLOW_VARIANTS), measured at load.",
            ["model", "version", "variant"],
            registry=r,
        )
        self.variant_token_agreement = Gauge(
            "reflow_worker_variant_token_agreement",
            "Share of its version's greedy tokens a variant predicts, teacher-forced, measured at load.",
            ["model", "version", "variant"],
            registry=r,
        )

        self.variant_task_score = Gauge(
            "reflow_worker_variant_task_score",
            "A variant's greedy accuracy on its version's task, scored when the version was registered.",
            ["model", "version", "variant"],
            registry=r,
        )
        self.dtype_step_seconds = Gauge(
            "reflow_worker_dtype_step_seconds",
            "Median seconds of a decode step of `rows` sequences in each dtype REFLOW_DTYPE=auto timed "
            "a version's shape in on this CPU, measured at load.",
            ["model", "version", "dtype", "rows"],
            registry=r,
        )
        self.dtype_chosen = Gauge(
            "reflow_worker_dtype_chosen",
            "1 for the dtype REFLOW_DTYPE=auto chose to serve a version in, 0 for the others it timed.",
            ["model", "version", "dtype"],
            registry=r,
        )
        self._per_version = (
            self.variant_agreement, self.variant_token_agreement, self.variant_task_score,
            self.dtype_step_seconds, self.dtype_chosen,
        )  # fmt: skip

    def observe_variant(
        self, model: str, version: str, variant: str, quality: Quality, task_score: float | None
    ) -> None:
        """When a version's copies are measured: what each one scored."""
        labels = (model, version, variant)
        self.variant_agreement.labels(*labels).set(quality.greedy_agreement)
        self.variant_token_agreement.labels(*labels).set(quality.token_agreement)
        if task_score is not None:
            self.variant_task_score.labels(*labels).set(task_score)

    def observe_dtype_choice(self, model: str, version: str, choice: DtypeChoice) -> None:
        """When a version loads in the dtype REFLOW_DTYPE=auto measured: what each dtype took."""
        for candidate in choice.candidates:
            for rows, ms in zip(choice.rows, candidate.step_ms, strict=True):
                self.dtype_step_seconds.labels(model, version, candidate.dtype, str(rows)).set(ms / 1000)
            self.dtype_chosen.labels(model, version, candidate.dtype).set(candidate.dtype == choice.chosen)

    def forget_version(self, model: str, version: str) -> None:
        """When a version is unloaded: its variants' and dtypes' series go, so no dashboard shows it
        served."""
        for gauge in self._per_version:
            gauge.remove_by_labels({"model": model, "version": version})

    def watch_isolation(self, stats: Callable[[], dict[str, int]]) -> None:
        """Exports the isolation programs' counters, read at each scrape."""
        self.registry.register(_IsolationCollector(stats))

    def observe_capacity(self, slots: int, blocks: int) -> None:
        """When a version is loaded or unloaded: batch rows and KV blocks allocated."""
        self.kv_slots.set(slots)
        self.kv_blocks.set(blocks)

    def observe_occupancy(
        self, running: int, waiting: int, blocks_used: int, blocks_total: int, blocks_cached: int
    ) -> None:
        """After each step: sequences admitted and queued, KV blocks held of those allocated, and
        those the prefix cache keeps."""
        self.running.set(running)
        self.kv_blocks_cached.set(blocks_cached)
        self.kv_slots_in_use.set(running)
        self.waiting.set(waiting)
        self.kv_blocks_used.set(blocks_used)
        self.kv_cache_usage.set(blocks_used / blocks_total if blocks_total else 0.0)

    def observe_drafts(self, drafted: int, accepted: int) -> None:
        """After a step with drafts: how many tokens were drafted (rows spent), how many were kept."""
        self.draft_tokens.inc(drafted)
        self.accepted_draft_tokens.inc(accepted)

    def observe_outputs(self, outputs: Seq[Output], step_seconds: float) -> None:
        """Per-token latencies and counts of one step's outputs."""
        self.step_time.observe(step_seconds)
        now = time.perf_counter()
        for request, output in outputs:
            if isinstance(output, BaseException):
                self.finished.labels("ERROR").inc()
                continue
            tokens = len(output.token_ids)  # several where drafted tokens were kept
            self.tokens.inc(tokens)
            if request.last_token_at:  # the gap since its last delta, spread over the tokens it brought
                for _ in range(tokens):
                    self.inter_token.observe((now - request.last_token_at) / tokens)
            else:  # its first delta: the one token its prefill gave
                self.ttft.observe(now - request.enqueued_at)
                self.queue_time.observe(request.admitted_at - request.enqueued_at)
                self.prompt_tokens.inc(request.prompt_len)
                self.cached_prompt_tokens.inc(request.sequence.cached_tokens)
            request.last_token_at = now
            if output.finish_reason is not None:
                self.finished.labels(output.finish_reason.name).inc()


class _IsolationCollector(Collector):
    """reflow_worker_isolation_connections_total{direction, verdict} from the eBPF counters."""

    def __init__(self, stats: Callable[[], dict[str, int]]):
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "reflow_worker_isolation_connections",
            "Connections seen by worker isolation: inbound admitted/dropped, outbound allowed/denied.",
            labels=["direction", "verdict"],
        )
        for name, value in self.stats().items():
            direction, verdict = name.split("_")
            family.add_metric(["inbound" if direction == "ingress" else "outbound", verdict], value)
        yield family
