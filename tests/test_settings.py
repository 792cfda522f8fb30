"""Settings: REFLOW_* variables, a YAML file, and their precedence."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

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
        Settings(gatway_port=1)  # type: ignore[call-arg]


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
