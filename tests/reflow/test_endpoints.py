"""`endpoints.json` and what `reflow up` prints from it: every URL without its credentials."""

from __future__ import annotations

from pathlib import Path

import pytest

from reflow.endpoints import ENDPOINTS_FILE, read_endpoints, write_endpoints
from reflow.redaction import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://alice:s3cret@mlflow.example.com/", "https://alice:***@mlflow.example.com/"),
        ("https://ghp_t0ken@mlflow.example.com", "https://***@mlflow.example.com"),
        ("https://mlflow.example.com/?token=t0k&x=1", "https://mlflow.example.com/?token=***&x=1"),
        (
            "https://h/api?access_token=a&X-Amz-Signature=b",
            "https://h/api?access_token=***&X-Amz-Signature=***",
        ),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("postgresql+psycopg://reflow:***@db:5432/reflow", "postgresql+psycopg://reflow:***@db:5432/reflow"),
        ("127.0.0.1:50051", "127.0.0.1:50051"),
        ("/srv/reflow/logs", "/srv/reflow/logs"),
    ],
)
def test_urls_lose_their_credentials_and_nothing_else(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_endpoints_json_holds_no_credentials_and_is_what_is_shown(tmp_path: Path) -> None:
    endpoints = {
        "gateway": "127.0.0.1:50051",
        "mlflow": "https://alice:s3cret@mlflow.example.com/?token=t0ken",
        "metrics": {"gateway": "http://127.0.0.1:9100/metrics"},
        "workers": ["127.0.0.1:50052"],
    }
    shown = write_endpoints(tmp_path, endpoints)
    text = (tmp_path / ENDPOINTS_FILE).read_text()
    assert "s3cret" not in text and "t0ken" not in text
    assert shown == read_endpoints(tmp_path)
    assert shown == {**endpoints, "mlflow": "https://alice:***@mlflow.example.com/?token=***"}
