"""Placement: which worker and variant a request runs on, and the reasoning budget it gets, from
the gateway's latency model, the request's deadline and the workers' KV headroom. The workers are
described as their Status reports them; the latency model is the gateway's own, fed the streams a
slowed or saturated worker would report."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest

from gateway import placement
from gateway.latency import LatencyModel, Load, Observation, RecursiveLeastSquares
from gateway.placement import EXPLORE_AFTER_S, Placement, Placer, WorkerLoad
from gateway.routing import ModelSpec, ServedVersion, WorkerHandle, WorkerPool
from gateway.validation import RequestLimits
from reflow.errors import NotFound
from reflow.v1 import inference_pb2, worker_pb2

SPEC = ModelSpec("m", alias="champion")
LIMITS = RequestLimits(max_prompt_chars=100_000, default_max_tokens=32, max_stop_strings=4)
FLOOR = 16
# what a worker measured when it loaded each variant: int8 decodes in half the time
FLOAT32 = dict(name="float32", reference=True, token_agreement=1.0, prefill_ms_per_token=2.0,
               decode_ms_per_token=40.0)  # fmt: skip
INT8 = dict(name="int8", token_agreement=0.6, prefill_ms_per_token=1.0, decode_ms_per_token=20.0)
# how a worker without REFLOW_VARIANTS lists its one copy: the reference, by its dtype, unmeasured
REFERENCE = dict(name="float32", reference=True, greedy_agreement=1.0, token_agreement=1.0)


def version(
    variants: tuple[dict[str, object], ...] = (REFERENCE,), *, free_blocks: int = 1000, reasons: bool = False
) -> worker_pb2.LoadedVersion:
    """m/1 @champion as a worker's Status reports it: 16-token KV blocks, `free_blocks` of 1000 free
    (in the version's pool and in each variant's)."""
    used = 1000 - free_blocks
    return worker_pb2.LoadedVersion(
        model="m", version="1", aliases=["champion"], max_sequence_length=4096, kv_block_size=16,
        kv_blocks_total=1000, kv_blocks_used=used, reasons=reasons, dtype="float32",
        variants=[worker_pb2.LoadedVariant(**v, kv_blocks_total=1000, kv_blocks_used=used) for v in variants],
    )  # fmt: skip


@dataclass
class Placing:
    pool: WorkerPool
    latency: LatencyModel
    placer: Placer

    def worker(self, i: int, loaded: worker_pb2.LoadedVersion) -> WorkerHandle:
        """Worker `i`, healthy and serving `loaded`."""
        worker = self.pool.workers[i]
        worker.loaded, worker.healthy = [loaded], True
        return worker

    def load(self, worker: WorkerHandle) -> WorkerLoad:
        """What the placer has running on `worker`."""
        return self.placer.load_of(worker)

    def place(self, prompt: str = "1+1=", max_tokens: int = 32, budget_ms: float | None = None,
              reasoning_budget: int = 0) -> Placement:  # fmt: skip
        request = inference_pb2.GenerateRequest(
            prompt=prompt, reasoning_budget=reasoning_budget,
            sampling=inference_pb2.SamplingParams(max_tokens=max_tokens),
        )  # fmt: skip
        return self.placer.place(SPEC, request, budget_ms)


@pytest.fixture
async def placing() -> AsyncIterator[Placing]:
    pool = WorkerPool(["127.0.0.1:1", "127.0.0.1:2"], poll_s=60)  # never polled: Status is set by hand
    latency = LatencyModel()
    yield Placing(pool, latency, Placer(pool, latency, LIMITS, FLOOR))
    await pool.close()


def slowed(placement: Placement, factor: float, streams: int = 40) -> Callable[[LatencyModel], None]:
    """What the latency model learns from `streams` streams of `placement` that take `factor` times
    what was predicted (its worker slowed down)."""
    option = placement.option

    def feed(latency: LatencyModel) -> None:
        for _ in range(streams):
            latency.observe(Observation(
                placement.key, option.load, placement.prompt_tokens, option.prediction.output_tokens,
                option.prediction.ttft_ms * factor, option.prediction.total_ms * factor,
            ))  # fmt: skip

    return feed


def test_recursive_least_squares_recovers_a_linear_law_and_follows_it_when_it_moves() -> None:
    fit = RecursiveLeastSquares([0.0, 1.0], [10.0, 10.0])
    for i in range(200):
        fit.update([1.0, float(i % 17)], 5.0 + 3.0 * (i % 17))
    assert fit.theta == pytest.approx([5.0, 3.0], abs=1e-3)
    for i in range(200):  # the worker slows down: forgetting follows it
        fit.update([1.0, float(i % 17)], 10.0 + 6.0 * (i % 17))
    assert fit.theta == pytest.approx([10.0, 6.0], abs=0.05)


async def test_a_generous_budget_gets_the_best_variant_and_a_tight_one_the_fast_one(placing: Placing) -> None:
    placing.worker(0, version((FLOAT32, INT8)))
    best = placing.place()  # no deadline: the version as loaded
    assert best.option.name == "float32" and best.routing().predicted_to_meet_deadline
    int8 = placing.place(budget_ms=best.option.prediction.total_ms * 0.8)
    assert int8.option.name == "int8" and int8.routing().token_agreement == pytest.approx(0.6)
    assert int8.option.prediction.total_ms < best.option.prediction.total_ms * 0.8
    generous = placing.place(budget_ms=best.option.prediction.total_ms * 5)
    assert generous.option.name == "float32"
    hopeless = placing.place(budget_ms=1.0)  # nothing can: the fastest, said to miss
    assert hopeless.option.name == "int8" and not hopeless.routing().predicted_to_meet_deadline


async def test_a_request_naming_a_variant_runs_on_it_whatever_its_budget(placing: Placing) -> None:
    placing.worker(0, version((FLOAT32, INT8)))
    request = inference_pb2.GenerateRequest(prompt="1+1=", variant="int8")
    assert placing.placer.place(SPEC, request, None).option.name == "int8"
    assert placing.placer.place(SPEC, request, 1e9).option.name == "int8"  # float32 would meet it
    request.variant = "float16"
    with pytest.raises(NotFound, match="holds variant 'float16'; its variants are float32, int8"):
        placing.placer.place(SPEC, request, None)
    placing.worker(0, version())
    with pytest.raises(NotFound, match="hold no variants"):
        placing.placer.place(SPEC, request, None)


async def test_a_slowed_worker_moves_a_budget_it_used_to_meet_to_the_fast_variant(placing: Placing) -> None:
    placing.worker(0, version((FLOAT32, INT8)))
    before = placing.place()
    budget = before.option.prediction.total_ms * 1.5
    assert placing.place(budget_ms=budget).option.name == "float32"
    slowed(before, factor=2.0)(placing.latency)  # its float32 streams now take twice as long
    after = placing.place(budget_ms=budget)
    assert after.option.name == "int8"
    assert placing.place().option.prediction.total_ms == pytest.approx(
        2 * before.option.prediction.total_ms, rel=0.1
    )


async def test_the_reasoning_budget_shrinks_on_a_saturated_worker_and_not_on_an_idle_one(
    placing: Placing,
) -> None:
    worker = placing.worker(0, version(reasons=True))
    idle = placing.place(max_tokens=256, reasoning_budget=200)
    budget = idle.option.prediction.total_ms * 1.2
    assert placing.place(max_tokens=256, reasoning_budget=200, budget_ms=budget).reasoning_budget == 200
    placing.load(worker).streams["float32"] = 48  # 48 streams of this gateway running on it
    saturated = placing.place(max_tokens=256, reasoning_budget=200, budget_ms=budget)
    assert FLOOR <= saturated.reasoning_budget < 200
    assert saturated.routing().reasoning_budget == saturated.reasoning_budget
    assert saturated.option.prediction.total_ms <= budget * 1.05  # lowered just enough to fit
    less = placing.place(max_tokens=256, reasoning_budget=saturated.reasoning_budget - 10, budget_ms=budget)
    assert less.reasoning_budget == saturated.reasoning_budget - 10  # a budget that fits is left alone
    hopeless = placing.place(max_tokens=256, reasoning_budget=200, budget_ms=1.0)
    assert hopeless.reasoning_budget == FLOOR  # never below the floor
    tiny = placing.place(max_tokens=256, reasoning_budget=4, budget_ms=1.0)
    assert tiny.reasoning_budget == 4  # nor above what the request asked


async def test_a_version_that_does_not_reason_keeps_its_reasoning_budget(placing: Placing) -> None:
    placing.load(placing.worker(0, version())).streams["float32"] = 48
    assert placing.place(max_tokens=256, reasoning_budget=200, budget_ms=1.0).reasoning_budget == 200


async def test_a_worker_with_little_free_kv_gets_fewer_new_long_prompts(placing: Placing) -> None:
    roomy = placing.worker(0, version(free_blocks=1000))
    tight = placing.worker(1, version(free_blocks=60))
    long_prompt, short_prompt = "x" * 2000, "1+1="  # ~500 and ~1 prompt tokens: 34 and 3 blocks

    def spread(prompt: str, n: int) -> dict[str, int]:
        """Where `n` requests in a row go, each counted on its worker as the relay counts it."""
        placed = {roomy.address: 0, tight.address: 0}
        streams = []
        for _ in range(n):
            placement = placing.place(prompt=prompt)
            streams.append(placing.placer.start(placement))
            placed[placement.option.worker.address] += 1
        for stream in streams:
            stream.close()
        return placed

    long = spread(long_prompt, 12)
    assert long[tight.address] < long[roomy.address] / 3
    short = spread(short_prompt, 12)  # short prompts still use both
    assert min(short.values()) >= 3


async def test_load_balances_by_running_sequences_and_queued_prompt_tokens(placing: Placing) -> None:
    busy, free = placing.worker(0, version()), placing.worker(1, version())
    busy.reported_running = 20  # another gateway's streams
    assert placing.place().option.worker is free
    busy.reported_running = 0
    placing.load(free).queued_tokens = 5000  # a long prompt waits for its first token
    assert placing.place().option.worker is busy
    assert placing.place().option.load == Load(running=0, queued_tokens=0)


async def test_a_worker_unused_for_a_while_is_tried_again_though_another_is_predicted_faster(
    placing: Placing,
) -> None:
    fast = placing.worker(0, version((FLOAT32,)))
    slow = placing.worker(1, version((dict(FLOAT32, decode_ms_per_token=120.0),)))  # predicted 3x slower

    def last_used(worker: WorkerHandle, seconds_ago: float) -> None:
        placing.load(worker).arrivals.last = time.perf_counter() - seconds_ago

    assert placing.place().option.worker is fast  # neither used yet: the cheaper
    last_used(fast, 0)
    assert placing.place().option.worker is slow  # the one never used, while the other is
    last_used(slow, EXPLORE_AFTER_S - 5)
    assert placing.place().option.worker is fast
    last_used(slow, EXPLORE_AFTER_S)
    assert placing.place().option.worker is slow  # its fit is corrected by what this stream takes
    # not where it would miss the deadline: 1.5x the fast worker's prediction, a third of its own
    last_used(slow, 0)
    tight = placing.place().option.prediction.total_ms * 1.5
    last_used(slow, EXPLORE_AFTER_S)
    assert placing.place(budget_ms=tight).option.worker is fast


async def test_another_choice_runs_beside_the_first_where_its_prompt_is_cached(placing: Placing) -> None:
    first_worker, other = (
        placing.worker(0, version((FLOAT32, INT8))),
        placing.worker(1, version((FLOAT32, INT8))),
    )
    request = inference_pb2.GenerateRequest(prompt="1+1=")
    first = placing.placer.place(SPEC, request, 1.0)  # a tight budget: int8
    assert (first.option.worker, first.option.name) == (first_worker, "int8")
    first_worker.reported_running = 20  # another gateway's streams: alone, a request would go elsewhere
    assert placing.placer.place(SPEC, request, None).option.worker is other
    beside = placing.placer.place(SPEC, request, None, near=first)
    assert (beside.option.worker, beside.option.name) == (first_worker, "int8")
    gone = placing.placer.place(SPEC, request, None, exclude=frozenset({first_worker.address}), near=first)
    assert (gone.option.worker, gone.option.name) == (other, "float32")  # its worker failed: placed as alone


async def test_variants_share_the_worker_so_a_busy_one_slows_the_others_until_the_worker_switches(
    placing: Placing,
) -> None:
    """A worker's variants take turns on its engine thread: beside a busy float32, int8 also waits
    for float32's steps; a budget float32 cannot meet moves the worker to int8 rather than mixing."""
    busy = worker_pb2.LoadedVariant(**FLOAT32, running=12)
    worker = placing.worker(0, version((INT8,)))
    worker.loaded[0].variants.insert(0, busy)
    worker.reported_running = 12
    float32, int8 = placing.placer.options(SPEC, request())
    assert int8.prediction.tpot_ms > int8.alone.tpot_ms  # float32's steps come on top of its own
    assert float32.prediction == float32.alone  # nothing else busy
    budget = (int8.alone.total_ms + min(float32.prediction.total_ms, int8.prediction.total_ms)) / 2
    switched = placing.place(budget_ms=budget)
    assert switched.option.name == "int8" and switched.routing().predicted_to_meet_deadline
    assert placing.place().option.name == "float32"  # without a deadline: the version itself


async def test_a_stream_cut_at_its_deadline_still_teaches_the_latency_model(placing: Placing) -> None:
    worker = placing.worker(0, version())
    placement = placing.place()
    before = placement.option.prediction
    stream, load = placing.placer.start(placement), placing.load(worker)
    assert (load.outstanding, load.streams["float32"], load.queued_tokens) == (1, 1, placement.prompt_tokens)
    for i in range(8):  # 8 tokens, each 5x slower than predicted, then cut
        stream.tokens_arrived(1, stream.placed + (before.ttft_ms + i * before.tpot_ms * 5) / 1000)
    stream.close()
    assert (load.outstanding, load.streams["float32"], load.queued_tokens) == (0, 0, 0)
    assert placing.place().option.prediction.tpot_ms > before.tpot_ms * 1.5


async def test_a_stream_is_learned_from_with_the_prompt_tokens_its_worker_prefilled(
    placing: Placing, monkeypatch: pytest.MonkeyPatch
) -> None:
    placing.worker(0, version())
    stream = placing.placer.start(placing.place(prompt="x" * 200))  # 4 characters a token: 50
    stream.tokens_arrived(1, stream.placed + 0.01)
    seen: list[Observation] = []
    monkeypatch.setattr(placing.latency, "observe", seen.append)
    stream.close(inference_pb2.Usage(prompt_tokens=100, cached_tokens=96, completion_tokens=1))
    assert [s.prompt_tokens for s in seen] == [4]  # the 96 its prefix cache held cost no prefill
    assert placing.latency.shape("m").prompt_tokens(200) > 50  # the model's tokens: all 100 of them


def request() -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(prompt="1+1=", sampling=inference_pb2.SamplingParams(max_tokens=32))


async def test_no_switch_of_variant_pushes_a_running_stream_past_its_deadline(
    placing: Placing, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the placer's clock stands still: the running stream's 5% to spare is 65 ms, which a loaded
    # machine can spend between its start and the next placement (it did, once, under the suite)
    monkeypatch.setattr(placement, "time", SimpleNamespace(perf_counter=lambda: 1000.0))
    worker = placing.worker(0, version((FLOAT32, INT8)))
    on_float32 = placing.place()  # float32, idle worker
    running = placing.placer.start(
        replace(on_float32, budget_ms=on_float32.option.prediction.total_ms * 1.05)
    )  # on course to meet its deadline, with 5% to spare: int8's steps beside it would eat that
    assert placing.load(worker).active == "float32"
    float32, int8 = placing.placer.options(SPEC, request())
    assert int8.mixes and int8.harms and not float32.mixes
    tight = placing.place(budget_ms=(int8.alone.total_ms + float32.prediction.total_ms) / 2)
    assert tight.option.name == "float32"  # the request misses rather than the running stream
    running.close()
    assert placing.load(worker).in_flight == set()
    worker.reported_running = 1  # the worker still runs float32 for another gateway, without deadline
    worker.loaded[0].variants[0].running = 1
    assert (
        placing.place(budget_ms=(int8.alone.total_ms + float32.prediction.total_ms) / 2).option.name == "int8"
    )


def test_a_served_version_reports_each_variants_lowest_scores_over_its_workers() -> None:
    served = ServedVersion("1")
    for int8_score in (0.8, 0.7, None):  # three workers; the last has no task score for int8
        int8 = {**INT8} if int8_score is None else {**INT8, "task_score": int8_score}
        served.add(version(({**FLOAT32, "task_score": 0.9}, int8)))
    assert served.ready_workers == 3
    assert served.variants["int8"].task_score == pytest.approx(0.7)
    assert served.variants["float32"].task_score == pytest.approx(0.9)
    assert served.variants["int8"].token_agreement == pytest.approx(0.6)
    unscored = ServedVersion("1")
    unscored.add(version((FLOAT32, INT8)))
    assert not unscored.variants["int8"].HasField("task_score")
