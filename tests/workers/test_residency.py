"""The catalog of a worker's residents: one lookup takes a version, any of its copies or an adapter
over it to the copy that runs it and the adapter slot on it; and Status lists every loaded version's
and adapter's reference copy first, named by its dtype, with or without REFLOW_VARIANTS."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from reflow.registry import BASE_VERSION_TAG
from reflow.v1 import worker_pb2
from tests.support.hf import random_adapter, tiny_checkpoint
from tests.support.registry import local_registry
from workers.engine import Engine, EngineConfig
from workers.loading import load_adapter, load_directory
from workers.models.lora import LoraConfig
from workers.residency import Copy, Residency, Route
from workers.server import WorkerServicer
from workers.versions import Versions

CPU = torch.device("cpu")
PROMPT = list(range(2, 12))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Path:
    directory = tmp_path_factory.mktemp("adapter")
    base = load_directory(checkpoint, "tiny", "1", CPU)
    adapter = random_adapter(base.model, LoraConfig(rank=4, alpha=8), seed=3)  # type: ignore[arg-type]
    adapter.save(directory, base_model="tiny")
    return directory


def test_one_lookup_takes_a_version_its_copies_and_its_adapters_to_a_copy_and_an_adapter_slot(
    checkpoint: Path, adapter_dir: Path
) -> None:
    base = load_directory(checkpoint, "tiny", "1", CPU)
    residency = Residency()
    residency.admit(base)
    int8 = Copy("int8", base.model)  # the weights do not matter to the catalog
    residency.add_variant(base, int8)
    residency.attach(load_adapter(adapter_dir, "2", base))
    reference = base.reference
    assert (reference.name, reference.reference, list(base.copies)) == ("float32", True, ["float32", "int8"])
    # the reference by "" (what older gateways send) or by its dtype, a variant by its name
    assert residency.lookup("tiny", "1") == residency.lookup("tiny", "1", "float32") == Route(reference, "")
    assert residency.lookup("tiny", "1", "int8") == Route(int8, "")
    # an adapter runs over its base's reference alone, through its own slot
    assert residency.lookup("tiny", "2") == residency.lookup("tiny", "2", "float32") == Route(reference, "2")
    assert residency.lookup("tiny", "2", "int8") is None
    assert residency.lookup("tiny", "1", "float16") is None and residency.lookup("tiny", "3") is None
    assert [(r.version, r.base_version) for r in residency.residents()] == [("1", ""), ("2", "1")]
    residency.remove("tiny", "1")  # its adapters go with it
    assert residency.residents() == [] and residency.lookup("tiny", "2") is None


@pytest.fixture
def versions(tmp_path: Path, checkpoint: Path, adapter_dir: Path) -> Iterator[Versions]:
    """Tiny v1 @champion and, over it, adapter v2 @challenger, in a registry; no REFLOW_VARIANTS."""
    registry = local_registry(tmp_path)
    registry.register("tiny", checkpoint, params={}, metrics={}, alias="champion")
    registry.register(
        "tiny", adapter_dir, params={}, metrics={}, alias="challenger", tags={BASE_VERSION_TAG: "1"}
    )
    engine = Engine(EngineConfig(max_batch_size=4, kv_cache_mb=1))
    yield Versions(engine, registry, tmp_path / "cache", CPU, torch.float32)
    engine.close()


async def test_status_lists_the_reference_copy_first_without_variants_and_requests_may_name_it(
    versions: Versions,
) -> None:
    await versions.load("tiny", alias="challenger")  # its base first
    servicer = WorkerServicer(versions)
    base, adapter = servicer.status().loaded
    assert [(m.version, m.base_version) for m in (base, adapter)] == [("1", ""), ("2", "1")]
    assert adapter.adapter_parameters > 0 and adapter.kv_blocks_total == base.kv_blocks_total
    for loaded in (base, adapter):
        (reference,) = loaded.variants
        assert (reference.name, reference.reference, loaded.dtype) == ("float32", True, "float32")
        assert (reference.greedy_agreement, reference.token_agreement) == (1.0, 1.0)
        assert reference.decode_ms_per_token == 0.0  # not measured: there is no variant to measure
        assert reference.kv_blocks_total == loaded.kv_blocks_total > 0

    class Context:
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise AssertionError((code, details))

    async def tokens(version: str, variant: str) -> list[int]:
        request = worker_pb2.WorkerGenerateRequest(
            model="tiny",
            version=version,
            prompt_token_ids=PROMPT,
            sampling={"max_tokens": 16},
            variant=variant,
        )
        return [t async for m in servicer.Generate(request, Context()) for t in m.token_ids]  # type: ignore[arg-type]

    for version in ("1", "2"):
        assert await tokens(version, "float32") == await tokens(version, "")
    assert await tokens("1", "") != await tokens("2", "")  # the adapter's slot, not the base's weights
    with pytest.raises(Exception, match="tiny/2 variant int8 is not loaded"):
        await tokens("2", "int8")
