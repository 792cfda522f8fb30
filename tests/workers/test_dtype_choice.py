"""REFLOW_DTYPE=auto on the CPU: a Llama-family version is served in the dtype measured faster on
this machine (bfloat16 only where its steps are clearly faster and its tokens agree with float32's),
measured once per model shape, and the worker says what it measured in its log, its status,
`reflow workers status` and its metrics.

Which dtype wins is this machine's to say, so the tests assert that the choice follows the rule from
what was measured, and the rule itself on given step times."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.support.cli import reflow
from tests.support.hf import tiny_checkpoint
from tests.support.models import save_model, tiny_model
from tests.support.registry import local_registry
from workers.dtype_choice import (
    AGREEMENT_FLOOR,
    CANDIDATE,
    MIN_SPEEDUP,
    AutoDtype,
    decide,
    shape_key,
)
from workers.engine import Engine, EngineConfig
from workers.loading import load_directory
from workers.metrics import WorkerMetrics
from workers.models.loader import load_checkpoint
from workers.residency import DtypeChoice
from workers.server import WorkerServicer
from workers.server import create_server as create_worker
from workers.versions import Versions

CPU = torch.device("cpu")
ROWS = (1, 8)


def answers(value: float, asked: list[float]) -> Callable[[], float]:
    """An agreement measurement that gives `value` and records that it was asked."""

    def measure() -> float:
        asked.append(value)
        return value

    return measure


def test_the_rule_serves_bfloat16_only_where_its_steps_are_clearly_faster_and_its_tokens_agree() -> None:
    asked: list[float] = []
    # faster alone, slower at 8 rows: the geometric mean of the ratios, sqrt(1.5 * 0.7), decides
    mixed = decide(ROWS, (30.0, 70.0), (20.0, 100.0), answers(1.0, asked))
    assert mixed.speedup(mixed.candidates[1]) == pytest.approx((1.5 * 0.7) ** 0.5)
    assert (mixed.chosen, mixed.candidates[1].token_agreement, asked) == ("float32", None, [])
    faster = decide(ROWS, (30.0, 100.0), (20.0, 50.0), answers(0.97, asked))
    assert (faster.chosen, faster.candidates[1].token_agreement, asked) == (CANDIDATE, 0.97, [0.97])
    disagrees = decide(ROWS, (30.0, 100.0), (20.0, 50.0), answers(0.9, asked))
    assert (disagrees.chosen, disagrees.candidates[1].token_agreement) == ("float32", 0.9)
    # each bar is met at its value
    edge = decide((1,), (10.0 * MIN_SPEEDUP,), (10.0,), answers(AGREEMENT_FLOOR, asked))
    assert edge.chosen == CANDIDATE
    assert [(c.dtype, c.step_ms) for c in faster.candidates] == [
        ("float32", (30.0, 100.0)),
        (CANDIDATE, (20.0, 50.0)),
    ]
    assert faster.candidates[0].token_agreement == 1.0 and faster.rows == ROWS


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_a_model_is_measured_once_per_shape_and_served_in_what_the_rule_chose_from_the_measurement(
    checkpoint: Path,
) -> None:
    auto = AutoDtype(max_batch_size=8)
    first = load_directory(checkpoint, "tiny", "1", CPU, auto=auto)
    choice = first.dtype_choice
    assert choice is not None and choice.rows == ROWS
    float32, candidate = choice.candidates
    assert (float32.dtype, float32.token_agreement, candidate.dtype) == ("float32", 1.0, CANDIDATE)
    assert all(ms > 0 for c in choice.candidates for ms in c.step_ms)
    # the choice is the rule's on what was measured, the agreement asked only of a faster candidate
    asked: list[float] = []
    again = decide(ROWS, float32.step_ms, candidate.step_ms, answers(candidate.token_agreement or 0.0, asked))
    assert again == choice and (candidate.token_agreement is None) == (asked == [])
    assert first.reference.name == str(first.model.dtype).removeprefix("torch.") == choice.chosen
    # a fine-tune of the same shape is served in the same dtype, measured no more
    second = load_directory(checkpoint, "tiny", "2", CPU, auto=auto)
    assert second.dtype_choice is choice and second.model.dtype == first.model.dtype
    assert list(auto.choices) == [shape_key(load_checkpoint(checkpoint, CPU)[0])]
    # REFLOW_DTYPE set by hand wins; the built-in model is served as trained; neither is measured
    set_by_hand = load_directory(checkpoint, "tiny", "3", CPU, dtype=torch.float32, auto=auto)
    assert (set_by_hand.dtype_choice, set_by_hand.model.dtype) == (None, torch.float32)
    builtin = save_model(tiny_model(0), checkpoint.parent / "builtin")
    served_as_trained = load_directory(builtin, "arith", "1", CPU, auto=auto)
    assert (served_as_trained.dtype_choice, served_as_trained.model.dtype) == (None, torch.float32)
    assert len(auto.choices) == 1


@torch.inference_mode()
def test_a_shape_measured_faster_in_bfloat16_loads_later_versions_as_reflow_dtype_bfloat16_does(
    checkpoint: Path,
) -> None:
    auto = AutoDtype(max_batch_size=8)
    reference, _ = load_checkpoint(checkpoint, CPU)
    earlier = DtypeChoice(ROWS, (), CANDIDATE)  # what a CPU where bfloat16 wins measured for the shape
    auto.choices[shape_key(reference)] = earlier
    served = load_directory(checkpoint, "tiny", "2", CPU, auto=auto)
    loaded, _ = load_checkpoint(checkpoint, CPU, torch.bfloat16)  # REFLOW_DTYPE=bfloat16
    tokens = torch.tensor([list(range(3, 40))])
    assert served.dtype_choice is earlier and served.reference.name == CANDIDATE
    assert torch.equal(served.model(tokens), loaded(tokens))


@pytest.fixture
def versions(tmp_path: Path, checkpoint: Path) -> Iterator[Versions]:
    registry = local_registry(tmp_path, "registry")
    registry.register("tiny", checkpoint, params={}, metrics={}, alias="champion")
    engine = Engine(EngineConfig(max_batch_size=8, kv_cache_mb=1), WorkerMetrics())
    yield Versions(engine, registry, tmp_path / "cache", CPU)  # REFLOW_DTYPE=auto
    engine.close()


async def test_the_worker_reports_what_auto_measured_in_status_the_cli_and_metrics(
    versions: Versions, tmp_path: Path
) -> None:
    await versions.load("tiny", alias="champion")
    servicer = WorkerServicer(versions)
    (loaded,) = servicer.status().loaded
    float32, candidate = loaded.dtype_candidates
    assert (float32.dtype, candidate.dtype) == ("float32", CANDIDATE)
    assert [c.chosen for c in loaded.dtype_candidates] == [
        loaded.dtype == "float32",
        loaded.dtype == CANDIDATE,
    ]
    assert loaded.variants[0].name == loaded.dtype  # the reference copy is the dtype chosen
    assert list(float32.rows) == list(candidate.rows) == list(ROWS)
    assert float32.token_agreement == 1.0 and all(ms > 0 for ms in candidate.step_ms)
    metrics = versions.engine.metrics
    assert metrics is not None
    sample = metrics.registry.get_sample_value
    for c in loaded.dtype_candidates:
        labels = {"model": "tiny", "version": "1", "dtype": c.dtype}
        steps = [sample("reflow_worker_dtype_step_seconds", {**labels, "rows": str(n)}) for n in ROWS]
        assert steps == pytest.approx([ms / 1000 for ms in c.step_ms])
        assert sample("reflow_worker_dtype_chosen", labels) == float(c.chosen)

    server, port, _ = await create_worker(servicer, "127.0.0.1", 0, None)
    try:
        env = {"REFLOW_WORKERS": f"127.0.0.1:{port}", "REFLOW_DATA_DIR": str(tmp_path / "data")}
        listed = await asyncio.to_thread(reflow, "workers", "status", "--json", env=env)
        [worker] = json.loads(listed.stdout)
        [version] = worker["loaded"]
        assert [(c["dtype"], c["rows"], c["chosen"]) for c in version["dtype_candidates"]] == [
            ("float32", list(ROWS), float32.chosen),
            (CANDIDATE, list(ROWS), candidate.chosen),
        ]
        text = (await asyncio.to_thread(reflow, "workers", "status", env=env)).stdout
        assert f"tiny/1 @champion {loaded.dtype} (auto: a step of 1/8 rows took float32 " in text
    finally:
        await server.stop(0)
    assert versions.engine.remove("tiny", "1")
    assert sample("reflow_worker_dtype_chosen", {"model": "tiny", "version": "1", "dtype": "float32"}) is None
