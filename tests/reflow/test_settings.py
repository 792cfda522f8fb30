"""Settings: REFLOW_* variables, a YAML file, and their precedence."""

from __future__ import annotations

from ipaddress import ip_network
from pathlib import Path

import pytest
from pydantic import ValidationError

from reflow.addresses import parse_destination
from reflow.settings import Settings


def test_environment_and_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "reflow.yaml"
    config.write_text("gateway_port: 6000\nworkers: [a:1]\ndefault_max_tokens: 9\n")
    monkeypatch.setenv("REFLOW_CONFIG", str(config))
    monkeypatch.setenv("REFLOW_WORKERS", "w1:1, w2:2")
    settings = Settings()
    assert settings.gateway_port == 6000 and settings.default_max_tokens == 9
    assert settings.workers == ["w1:1", "w2:2"]  # the environment beats the file
    assert Settings(gateway_port=7000).gateway_port == 7000  # arguments beat both


def test_defaults_live_in_the_data_dir(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    assert settings.resolved_database_url == f"sqlite:///{tmp_path / 'reflow.db'}"
    assert settings.resolved_tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert settings.resolved_artifact_root == (tmp_path / "mlartifacts").as_uri()
    remote = Settings(data_dir=tmp_path, mlflow_tracking_uri="http://mlflow:5000")
    assert remote.resolved_artifact_root is None  # the tracking server decides


def test_unknown_settings_are_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError):
        Settings(gatway_port=1)


def test_api_key_rules_and_bounds() -> None:
    assert Settings(api_key="").api_key is None  # empty means "generate one"
    with pytest.raises(ValidationError, match="at least 16"):
        Settings(api_key="short")
    with pytest.raises(ValidationError):
        Settings(worker_poll_s=0)
    with pytest.raises(ValidationError):
        Settings(default_max_tokens=0)


def test_the_api_key_never_shows_in_reprs_or_dumps() -> None:
    settings = Settings(api_key="rf_secret_secret_secret")
    assert "rf_secret" not in repr(settings) and "rf_secret" not in settings.model_dump_json()
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "rf_secret_secret_secret"


def test_isolation_policies_and_tls_files_are_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFLOW_ISOLATION_EGRESS", "10.0.0.0/8:5000, [fd00::1]:443, 192.168.1.7, ::1")
    monkeypatch.setenv("REFLOW_ISOLATION_ALLOW_FROM", "10.1.2.3/32")
    settings = Settings()
    assert [parse_destination(e) for e in settings.isolation_egress] == [
        (ip_network("10.0.0.0/8"), 5000), (ip_network("fd00::1/128"), 443),
        (ip_network("192.168.1.7/32"), 0), (ip_network("::1/128"), 0),
    ]  # fmt: skip
    for bad in ("10.0.0.0/33", "example.com:80", "10.0.0.1:99999"):
        with pytest.raises(ValidationError, match="isolation_egress"):
            Settings(isolation_egress=[bad])
    with pytest.raises(ValidationError, match="isolation_allow_from"):
        Settings(isolation_allow_from=["not-an-address"])
    with pytest.raises(ValidationError, match="is not a file"):
        Settings(tls_ca_file=str(tmp_path / "missing.pem"))
    (tmp_path / "ca.pem").write_text("x")
    with pytest.raises(ValidationError, match="together"):
        Settings(tls_ca_file=str(tmp_path / "ca.pem"))
    assert Settings().tls is False
    with pytest.raises(ValidationError, match="is not a file"):
        Settings(gateway_ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ValidationError, match="REFLOW_GATEWAY_TLS_CERT_FILE and REFLOW_GATEWAY_TLS_KEY_FILE"):
        Settings(gateway_tls_key_file=str(tmp_path / "ca.pem"))
    gateway_tls = Settings(
        gateway_tls_cert_file=str(tmp_path / "ca.pem"), gateway_tls_key_file=str(tmp_path / "ca.pem")
    )
    assert gateway_tls.gateway_tls and not gateway_tls.tls and Settings().gateway_tls is False


def test_a_refused_setting_never_echoes_its_value() -> None:
    for bad in (
        {"api_key": "short-secret"},
        {"redis_timeout_s": "secret"},
        {"database_url": "mysql://u:secret@h/db"},
    ):
        with pytest.raises(ValidationError) as refused:
            Settings(**bad)
        assert "secret" not in str(refused.value), bad
