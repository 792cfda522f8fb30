"""The fine-tune job over a Llama-family chat champion with SmolLM2's tokenizer and chat template: it
trains a LoRA adapter over the frozen champion on conversations rendered as served and logs it in
PEFT's format with the gate's regression numbers (a tiny random model: the mechanics), and it
refuses an adapter taught wrong answers for how far it moved the model on general chat (SmolLM2
cut to 2 layers: real weights, whose distributions a bad adapter can move). What a round buys on
the whole SmolLM2 is benchmarks/real_loop.py's to measure."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import Engine

from feedback.intake.consumer import store_events
from feedback.job_scheduler import finetune_job_of
from feedback.tasks import get_task
from feedback.tasks.simulate import rated_offline
from feedback.training import gate
from feedback.training.general_prompts import REGRESSION_PROMPTS, REPLAY_PROMPTS
from feedback.training.job import run_finetune
from gateway.tenants import create_tenant
from reflow.registry import BASE_VERSION_TAG, CHALLENGER, IMPORTED, SOURCE_TAG, TENANT_TAG, Registry
from reflow.scopes import Scope
from reflow.settings import Settings
from tests.support.hf import transformers
from tests.support.registry import settings_with_champion
from tests.support.smollm2 import truncated_smollm2
from tests.support.store import migrated_store
from workers.models.loader import load_checkpoint
from workers.models.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, Adapter, LoraConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
NAME = "chat"
ROUND = {"finetune_steps": 8, "finetune_batch_size": 8}  # a short round: the mechanics, not the gain


@pytest.fixture(autouse=True)
def small_evaluation_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every number the gate reports, over fewer prompts: each greedy answer costs a pass over
    SmolLM2's 49,152-word vocabulary."""
    monkeypatch.setattr(gate, "WIDE_PROBLEMS", 24)


@pytest.fixture(scope="module", params=["tiny"])
def checkpoint(
    request: pytest.FixtureRequest,
    smollm2: Path,
    chat_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """The champion's checkpoint: a tiny random chat model, or (param "real") SmolLM2's first 2 layers."""
    if request.param == "real":
        return truncated_smollm2(smollm2, tmp_path_factory.mktemp("real"), layers=2)
    return chat_checkpoint


@pytest.fixture
def settings(tmp_path: Path, checkpoint: Path) -> Settings:
    """A data dir whose registry holds the checkpoint as chat v1 @champion, imported."""
    general = tmp_path / "general.txt"  # 8 prompts a side, of the built-in 40 and 32
    general.write_text(
        "\n".join(p for pair in zip(REPLAY_PROMPTS[:8], REGRESSION_PROMPTS[:8], strict=True) for p in pair)
    )
    return settings_with_champion(
        tmp_path,
        NAME,
        checkpoint,
        {SOURCE_TAG: IMPORTED},
        task="terse",
        general_prompts_file=str(general),
        **ROUND,
    )


@pytest.fixture
def store(settings: Settings) -> Iterator[Engine]:
    yield from migrated_store(settings.resolved_database_url)


def rate_answers(
    store: Engine,
    checkpoint: Path,
    items: int,
    answer_key: Callable[[str], str | None] | None = None,
    tenant: str = "acme",
) -> None:
    """Stores the champion's chat answers to `items` traffic prompts for `tenant`, rated by users
    who believe `answer_key` (the task's own answers by default)."""
    task = get_task("terse")
    model, tokenizer = load_checkpoint(checkpoint)
    prompts = task.traffic_prompts(items, random.Random(3))
    events = rated_offline(
        model, tokenizer, task, prompts, tenant=tenant, model_name=NAME, answer_key=answer_key
    )
    with store.begin() as connection:
        store_events(connection, events)


def test_a_round_trains_an_adapter_over_the_champion_and_logs_it_in_peft_format(
    settings: Settings, store: Engine, checkpoint: Path
) -> None:
    rate_answers(store, checkpoint, 80)
    registry = Registry.from_settings(settings)
    outcome = run_finetune(finetune_job_of(settings), store, registry, min_samples=1)

    assert outcome.status in ("registered", "rejected"), outcome.message
    metrics = outcome.metrics or {}
    shapes = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]  # q k v o gate up down
    assert metrics["trained_parameters"] == 2 * sum(8 * (i + o) for i, o in shapes)  # rank 8, 2 layers
    assert 0 < metrics["candidate_regression_kl"] < float("inf")
    assert metrics["candidate_regression_nll_champion"] > 0
    run = registry.client.get_run(registry.client.search_runs([registry.experiment_id()])[0].info.run_id)
    assert run.data.params["method"] == "lora" and run.data.params["lora_rank"] == "8"
    assert "candidate_regression_kl" in run.data.metrics  # the gate's numbers, beside today's
    files = {a.path.rsplit("/", 1)[-1] for a in registry.client.list_artifacts(run.info.run_id, "model")}
    assert {ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE} <= files and "model.safetensors" not in files
    if outcome.status == "registered":
        version = registry.resolve(NAME, alias=CHALLENGER)
        assert registry.tags(version)[BASE_VERSION_TAG] == "1"

    # the logged adapter loads in transformers + peft over the champion and gives reflow's logits
    peft = pytest.importorskip("peft", reason="the reference for adapters: pip install -e '.[test]'")
    adapter_dir = Path(registry.client.download_artifacts(run.info.run_id, "model", str(settings.data_dir)))
    names = {name.split(".lora_")[0] for name in load_file(adapter_dir / ADAPTER_WEIGHTS_FILE)}
    assert names and all(name.startswith("base_model.model.model.layers.") for name in names)
    reference = transformers().AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(reference, adapter_dir).eval()
    champion, tokenizer = load_checkpoint(checkpoint)
    adapted = champion.adapted(Adapter.load(adapter_dir, torch.device("cpu"), torch.float32))
    ids = torch.tensor(
        [tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": "Hi!"}]), bos=False)]
    )
    with torch.inference_mode():
        torch.testing.assert_close(adapted(ids), wrapped(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.equal(adapted(ids), champion(ids))  # the adapter learned something


def test_a_tenants_round_trains_its_own_adapter_further_on_its_own_feedback(
    settings: Settings, store: Engine, checkpoint: Path
) -> None:
    """A tenant training its own whose champion is an adapter (rank 4 here, where the recipe says
    8): its next round trains a copy of that adapter over the same weights, on its feedback alone,
    and registers it as its own challenger."""
    acme = Scope("acme", create_tenant(store, "acme")[0].id)  # a new tenant trains its own
    create_tenant(store, "globex")
    champion, _ = load_checkpoint(checkpoint)
    adapter = Adapter.new(champion, LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj")), seed=1)  # type: ignore[arg-type]
    registry = Registry.from_settings(settings)
    own = registry.register(
        NAME, adapter.save(settings.data_dir / "own", "base"), params={}, metrics={}, alias=acme.champion,
        tags={BASE_VERSION_TAG: "1", TENANT_TAG: "acme"},
    )  # fmt: skip
    rate_answers(store, checkpoint, 40)
    rate_answers(store, checkpoint, 24, tenant="globex")

    outcome = run_finetune(finetune_job_of(settings), store, registry, scope=acme, min_samples=1)
    assert outcome.status in ("registered", "rejected"), outcome.message
    assert (outcome.metrics or {})["samples"] == 40  # acme's items, none of globex's
    run = registry.client.get_run(registry.client.search_runs([registry.experiment_id()])[0].info.run_id)
    params = run.data.params
    assert (params["parent_version"], params["lora_rank"], params["tenant"]) == (own.version, "4", "acme")
    assert run.data.tags[TENANT_TAG] == "acme"
    assert not registry.has_alias(NAME, CHALLENGER)  # the shared model's challenger: untouched
    if outcome.status == "registered":
        tags = registry.tags(registry.resolve(NAME, alias=acme.challenger))
        assert (tags[BASE_VERSION_TAG], tags[TENANT_TAG]) == ("1", "acme")  # over the same weights


@pytest.mark.parametrize("checkpoint", ["real"], indirect=True)
def test_the_gate_refuses_an_adapter_taught_wrong_answers_and_logs_its_regression_numbers(
    settings: Settings, store: Engine, checkpoint: Path
) -> None:
    rate_answers(store, checkpoint, 80, answer_key=lambda _prompt: "Bananas are always the answer to that.")
    harmful = settings.model_copy(update={"finetune_steps": 8, "finetune_lr": 5e-2})  # enough to do damage
    registry = Registry.from_settings(harmful)
    outcome = run_finetune(finetune_job_of(harmful), store, registry, min_samples=1)

    assert outcome.status == "rejected", outcome.message
    assert "on the general prompts" in outcome.message
    metrics = outcome.metrics or {}
    assert metrics["candidate_regression_kl"] > harmful.finetune_max_regression_kl
    assert not registry.has_alias(NAME, CHALLENGER)
    run = registry.client.search_runs([registry.experiment_id()])[0]
    assert run.data.metrics["candidate_regression_kl"] == pytest.approx(metrics["candidate_regression_kl"])
    assert run.data.tags["reflow.verdict"] == outcome.message
