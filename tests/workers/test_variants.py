"""Variants of a version (REFLOW_VARIANTS): built beside it, measured against it when they load,
served by name, and reported in the worker's Status."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from reflow.registry import Registry
from reflow.v1 import worker_pb2
from tests.support.hf import tiny_checkpoint
from tests.support.registry import local_registry
from workers.engine import Engine, EngineConfig
from workers.loading import load_directory
from workers.metrics import WorkerMetrics
from workers.sampling import SamplingParams
from workers.sequence import GenerationParams
from workers.server import WorkerServicer
from workers.variants import check_variants, make_variant
from workers.versions import Versions

GREEDY = GenerationParams(max_tokens=8, sampling=SamplingParams(temperature=0.0))


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Iterator[Versions]:
    """SmolLM2-135M v1 @champion, loaded in float32 with an int8 variant beside it."""
    root = tmp_path_factory.mktemp("variants")
    registry = local_registry(root)
    registry.register("smollm2", smollm2, params={}, metrics={}, alias="champion")
    engine = Engine(EngineConfig(max_batch_size=8, kv_cache_mb=16), WorkerMetrics())
    cpu = torch.device("cpu")
    yield Versions(engine, registry, root / "cache", cpu, torch.float32, variants=("float32", "int8"))
    engine.close()


async def test_the_int8_variant_is_measured_below_the_reference_and_reported_in_status(
    versions: Versions,
) -> None:
    await versions.load("smollm2", alias="champion")
    status = WorkerServicer(versions).status()
    (loaded,) = status.loaded
    reference, int8 = loaded.variants
    assert (reference.name, reference.reference, reference.greedy_agreement) == ("float32", True, 1.0)
    assert (int8.name, int8.reference) == ("int8", False)
    assert 0.0 < int8.greedy_agreement < 1.0  # close to the reference, not the same model
    assert reference.token_agreement == 1.0 and 0.0 < int8.token_agreement < 1.0
    assert not int8.HasField("task_score")  # an imported checkpoint has no task to score
    assert int8.weight_bytes < 0.7 * reference.weight_bytes  # int8 linears; embeddings and norms bfloat16
    # Which variant is faster is measured, not assumed (the gateway routes by these numbers), and is
    # benchmarks/sla.py's to show: on a loaded CI machine the two timings of one load cross over.
    for variant in loaded.variants:
        assert variant.prefill_ms_per_token > 0 and variant.decode_ms_per_token > 0
        assert variant.kv_blocks_total > 0 and variant.kv_blocks_used == 0


async def test_a_request_names_its_variant_and_each_runs_on_its_own_weights(versions: Versions) -> None:
    await versions.load("smollm2", alias="champion")
    engine = versions.engine
    prompt = engine.get("smollm2", "1").tokenizer.encode("The capital of France is")

    async def tokens(variant: str) -> list[int]:
        stream = engine.generate("smollm2", "1", prompt, GREEDY, variant)
        return [t async for delta in stream for t in delta.token_ids]

    reference, int8 = await tokens(""), await tokens("int8")
    assert len(reference) == len(int8) == GREEDY.max_tokens
    assert reference == await tokens("")  # greedy: each variant repeats itself
    assert int8 == await tokens("int8")
    assert engine.lookup("smollm2", "1", "int8").copy.model.dtype == torch.bfloat16  # its kernel multiplies


async def test_an_unknown_variant_is_not_found_and_a_removed_version_takes_its_variants(
    versions: Versions,
) -> None:
    await versions.load("smollm2", alias="champion")
    servicer = WorkerServicer(versions)

    class Context:
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise AssertionError((code, details))

    request = worker_pb2.WorkerGenerateRequest(
        model="smollm2", version="1", prompt="Hi", sampling={"max_tokens": 2}, variant="float16"
    )
    with pytest.raises(Exception, match="variant float16 is not loaded"):
        [m async for m in servicer.Generate(request, Context())]  # type: ignore[arg-type]
    # the reference's own name is the reference
    request.variant = "float32"
    assert [m async for m in servicer.Generate(request, Context())][-1].finish_reason  # type: ignore[arg-type]
    metrics = versions.engine.metrics
    assert metrics is not None

    def agreement(variant: str) -> float | None:
        labels = {"model": "smollm2", "version": "1", "variant": variant}
        return metrics.registry.get_sample_value("reflow_worker_variant_token_agreement", labels)

    assert agreement("float32") == 1.0 and 0 < (agreement("int8") or 0) < 1
    assert versions.engine.remove("smollm2", "1")
    assert versions.engine.find("smollm2", "1") is None
    assert agreement("float32") is None and agreement("int8") is None  # no series of what is gone
    with pytest.raises(Exception, match="is not loaded"):
        versions.engine.lookup("smollm2", "1", "int8")


@pytest.fixture(scope="module")
def tiny_registry(tmp_path_factory: pytest.TempPathFactory) -> Registry:
    """Tiny random Llama checkpoints stored in float32, registered: `tied` (its output head the
    embeddings) and `untied`."""
    root = tmp_path_factory.mktemp("tiny")
    registry = local_registry(root)
    for tied in (True, False):
        checkpoint = tiny_checkpoint(root / TIES[tied], tie_word_embeddings=tied)
        registry.register(TIES[tied], checkpoint, params={}, metrics={}, alias="champion")
    return registry


TIES = {True: "tied", False: "untied"}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("name", ["int8", "int4"])
async def test_a_bfloat16_workers_quantized_copy_is_quantized_from_the_checkpoints_float32_weights(
    tiny_registry: Registry, tmp_path: Path, name: str, tied: bool
) -> None:
    # rounded to bfloat16 first, its weights would cost the copy agreement (docs/models.md)
    model = TIES[tied]
    engine = Engine(EngineConfig(max_batch_size=2, kv_cache_mb=4), WorkerMetrics())
    cpu = torch.device("cpu")
    try:
        versions = Versions(engine, tiny_registry, tmp_path, cpu, torch.bfloat16, variants=(name,))
        await versions.load(model, alias="champion")
        served = engine.lookup(model, "1", name).copy.model
    finally:
        engine.close()
    checkpoint = tiny_registry.download(tiny_registry.resolve(model, alias="champion"), tmp_path)
    float32 = make_variant(load_directory(checkpoint, model, "1", cpu, dtype=torch.float32), name).model
    held = make_variant(load_directory(checkpoint, model, "1", cpu, dtype=torch.bfloat16), name).model
    tokens = torch.arange(2, 34)[None]
    with torch.inference_mode():
        logits = served(tokens)
        assert logits.dtype == torch.bfloat16 and torch.equal(logits, float32(tokens))
        assert not torch.equal(logits, held(tokens))  # quantized from the weights as held: not the same


def test_int8_off_the_cpu_is_refused_in_one_line() -> None:
    check_variants(("int8", "bfloat16"), torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU kernel; on CUDA use bfloat16 or float16"):
        check_variants(("int8",), torch.device("cuda", 0))
