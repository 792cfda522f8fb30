"""Choosing the isolation hook: `none` and `auto` never stop a worker (`auto` warns what falling back
exposes), `ebpf` on a host that cannot do it stops it with an error naming what is missing and the
setting that opts out."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from reflow.settings import Settings
from tests.support.cli import reflow
from workers.isolation import IsolationUnavailable, NoIsolation, isolate
from workers.server import isolation_config


def test_none_and_auto_fall_back_but_ebpf_refuses_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = str(tmp_path / "isolation.bpf.o")  # e.g. `make bpf` never ran
    assert isinstance(isolate(isolation_config(Settings(isolation="none", bpf_object=missing))), NoIsolation)
    with caplog.at_level(logging.WARNING, logger="workers.isolation"):
        assert isinstance(
            isolate(isolation_config(Settings(isolation="auto", bpf_object=missing))),
            NoIsolation,
        )
    [warning] = caplog.records
    message = warning.getMessage()
    assert message.startswith("worker isolation off (REFLOW_ISOLATION=auto): ")
    assert "without an API key or a quota, and may load and unload versions" in message  # the exposure
    assert "set REFLOW_ISOLATION=ebpf to require isolation" in message
    with pytest.raises(IsolationUnavailable) as refused:
        isolate(isolation_config(Settings(isolation="ebpf", bpf_object=missing)))
    message = str(refused.value)
    if os.geteuid() == 0:  # as root the object is what is missing; otherwise the capabilities
        assert "make bpf" in message and missing in message
    else:
        assert "CAP_BPF" in message
    assert "REFLOW_ISOLATION=none" in message


def test_a_worker_that_cannot_be_isolated_does_not_start(tmp_path: Path) -> None:
    env = {"REFLOW_DATA_DIR": str(tmp_path), "REFLOW_ISOLATION": "ebpf",
           "REFLOW_BPF_OBJECT": str(tmp_path / "isolation.bpf.o")}  # fmt: skip
    result = reflow("worker", env=env, timeout_s=120)
    assert result.returncode == 2
    assert "error:" in result.stderr and "REFLOW_ISOLATION=none" in result.stderr
    assert "Traceback" not in result.stderr
