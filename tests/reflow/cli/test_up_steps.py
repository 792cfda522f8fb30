"""The steps of `reflow up` that decide something, one at a time: the settings it refuses, the default
tenant's key, what each child is given, where replicas listen, what endpoints.json and the console
show. (tests/reflow/cli/test_up.py runs them all together.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import typer
from rich.console import Console

from gateway.tenants import Limits, find_tenant, revoke_tenant
from reflow.cli.up_steps import (
    add_default_tenant,
    check_settings,
    children_env,
    endpoint_rows,
    endpoints_of,
    how_to_try,
    migrated_store,
    replica_ports,
    resolve_api_key,
    worker_env,
)
from reflow.settings import Settings
from reflow.store.database import open_db

KEY = "rf_test_key_0123456789"


def quiet() -> Console:
    return Console(quiet=True)


def test_a_secure_kafka_protocol_without_brokers_is_refused_before_anything_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(data_dir=tmp_path / "data", kafka_security_protocol="SSL", kafka_bootstrap="")
    with pytest.raises(typer.Exit) as refused:
        check_settings(settings)
    assert refused.value.exit_code == 2
    assert capsys.readouterr().err.startswith(
        "error: REFLOW_KAFKA_SECURITY_PROTOCOL=SSL needs your own brokers"
    )
    assert not settings.data_dir.exists()
    check_settings(Settings(data_dir=tmp_path, kafka_security_protocol="SSL", kafka_bootstrap="k:9093"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA has the device")
def test_a_device_torch_cannot_see_is_refused_before_anything_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(data_dir=tmp_path / "data", device="cuda")
    with pytest.raises(typer.Exit) as refused:
        check_settings(settings)
    assert refused.value.exit_code == 2
    assert (
        capsys.readouterr().err
        == "error: REFLOW_DEVICE=cuda but torch sees no CUDA device; use cpu or auto\n"
    )
    assert not settings.data_dir.exists()


def test_the_default_tenants_key_is_the_configured_one_else_the_saved_one_else_a_new_one(
    tmp_path: Path,
) -> None:
    saved = tmp_path / "api_key"
    new = resolve_api_key(Settings(data_dir=tmp_path, api_key=None), quiet())
    assert new.startswith("rf_") and saved.read_text() == f"{new}\n" and saved.stat().st_mode & 0o777 == 0o600
    assert resolve_api_key(Settings(data_dir=tmp_path, api_key=None), quiet()) == new
    assert resolve_api_key(Settings(data_dir=tmp_path, api_key=KEY), quiet()) == KEY
    assert saved.read_text() == f"{KEY}\n"


def test_the_default_tenant_gets_the_key_and_limits_and_a_revoked_key_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(data_dir=tmp_path)
    store = migrated_store(settings)
    add_default_tenant(settings, store, KEY, Limits(3, 100, 5000))
    info, prefix, revoked = find_tenant(store, "default")
    assert (info.max_concurrent_streams, info.requests_per_minute, info.tokens_per_minute) == (3, 100, 5000)
    assert KEY.startswith(prefix) and not revoked
    revoke_tenant(open_db(settings.resolved_database_url), "default")
    with pytest.raises(typer.Exit) as refused:
        add_default_tenant(settings, store, KEY, Limits(3, 100, 5000))
    assert refused.value.exit_code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: the API key of tenant 'default' was revoked; set a new REFLOW_API_KEY")
    assert error.count("\n") == 1


def test_children_get_absolute_paths_and_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = children_env(Settings(data_dir=Path("data"), model_name="smollm2"), demo=False, chat=True)
    assert env == {"REFLOW_DATA_DIR": str(tmp_path / "data"), "REFLOW_MODEL_NAME": "smollm2"}


@pytest.mark.parametrize(("chat", "task"), [(False, "arith"), (True, "terse")])
def test_the_demo_speeds_up_what_was_left_at_its_default_and_sets_the_users_task(
    tmp_path: Path, chat: bool, task: str
) -> None:
    env = children_env(Settings(data_dir=tmp_path, ab_traffic=0.2, task=""), demo=True, chat=chat)
    assert env["REFLOW_FINETUNE_INTERVAL_S"] == "60" and env["REFLOW_AB_EVALUATE_S"] == "10"
    assert "REFLOW_AB_TRAFFIC" not in env  # the user's own choice stands
    assert env["REFLOW_TASK"] == task
    assert "REFLOW_TASK" not in children_env(Settings(data_dir=tmp_path, task="arith"), demo=True, chat=chat)


def test_workers_spread_over_the_gpus_there_are() -> None:
    env = {"REFLOW_DATA_DIR": "/d"}
    assert [worker_env(env, i, 2).get("REFLOW_DEVICE") for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert worker_env(env, 1, 0) == env  # no GPU: REFLOW_DEVICE as the user set it


def test_gateway_replicas_listen_on_the_next_ports_and_zero_stays_a_free_one(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, gateway_port=50051, http_port=0)
    assert [replica_ports(settings, i) for i in range(3)] == [("50051", "0"), ("50052", "0"), ("50053", "0")]


def endpoints(tmp_path: Path, replicas: int) -> dict[str, object]:
    workers = {f"worker-{i}": {"address": f"127.0.0.1:{700 + i}", "metrics": f"m{i}"} for i in range(2)}
    gateways = {
        name: {"address": f"127.0.0.1:5005{i}", "http": f"http://127.0.0.1:800{i}", "metrics": f"g{i}"}
        for i, name in enumerate(["gateway", "gateway-1"][:replicas])
    }
    store = open_db("postgresql://reflow:secret@db.internal/reflow")
    settings = Settings(data_dir=tmp_path)
    return endpoints_of(
        settings,
        store=store,
        kafka="127.0.0.1:9092",
        mlflow="http://127.0.0.1:5000",
        workers=workers,
        gateways=gateways,
        logs=tmp_path,
    )


def test_endpoints_name_the_first_gateway_every_replica_and_every_processs_metrics(tmp_path: Path) -> None:
    listed = endpoints(tmp_path, replicas=2)
    assert (listed["gateway"], listed["http"]) == ("127.0.0.1:50050", "http://127.0.0.1:8000")
    assert listed["gateways"] == [
        {"address": "127.0.0.1:50050", "http": "http://127.0.0.1:8000"},
        {"address": "127.0.0.1:50051", "http": "http://127.0.0.1:8001"},
    ]
    assert listed["workers"] == ["127.0.0.1:700", "127.0.0.1:701"]
    assert listed["metrics"] == {"worker-0": "m0", "worker-1": "m1", "gateway": "g0", "gateway-1": "g1"}
    assert listed["database"] == "postgresql+psycopg://reflow:***@db.internal/reflow"
    assert listed["api_key_file"] == str(tmp_path / "api_key")


def test_the_table_lists_the_replicas_only_when_there_are_several(tmp_path: Path) -> None:
    one = dict(endpoint_rows(endpoints(tmp_path, replicas=1)))
    assert "gateways" not in one
    assert one["workers"] == "127.0.0.1:700, 127.0.0.1:701"
    assert one["metrics"] == "worker-0: m0\nworker-1: m1\ngateway: g0"
    two = dict(endpoint_rows(endpoints(tmp_path, replicas=2)))
    assert (
        two["gateways"] == "127.0.0.1:50050 + http://127.0.0.1:8000, 127.0.0.1:50051 + http://127.0.0.1:8001"
    )


def test_how_to_try_it_fits_the_model_and_the_demo(tmp_path: Path) -> None:
    listed = endpoints(tmp_path, replicas=1)
    settings = Settings(data_dir=tmp_path, model_name="smollm2")
    builtin = how_to_try(listed, settings, chat=False, demo=False)
    assert builtin == [
        f'try: reflow generate "47+38="   (stop with Ctrl-C; endpoints in {tmp_path / "endpoints.json"})',
        f"or any OpenAI client: base_url http://127.0.0.1:8000/v1, API key in {tmp_path / 'api_key'}",
    ]
    chat = how_to_try(listed, settings, chat=True, demo=True)
    assert chat[0].startswith('try: reflow generate --model smollm2 --chat "What is the capital of France?"')
    assert chat[2].startswith("demo: simulated users are rating answers")
