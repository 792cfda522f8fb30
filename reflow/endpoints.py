"""What a running `reflow up` tells other commands: `<data-dir>/endpoints.json` and the API key file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reflow.redaction import redact_url

ENDPOINTS_FILE = "endpoints.json"
API_KEY_FILE = "api_key"


def write_endpoints(data_dir: Path, endpoints: dict[str, Any]) -> dict[str, Any]:
    """Writes `<data-dir>/endpoints.json` (readers see the old file or the whole new one) with every
    URL in `endpoints` stripped of its credentials; returns what it wrote, the form to show."""
    from reflow.serving import write_json_atomically

    written = _redacted(endpoints)
    write_json_atomically(data_dir / ENDPOINTS_FILE, written)
    return written


def read_endpoints(data_dir: Path) -> dict[str, Any] | None:
    """What a running `reflow up` wrote to `<data-dir>/endpoints.json`; None when it is not up."""
    path = data_dir / ENDPOINTS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _redacted(value: Any) -> Any:
    """`value` with `redact_url` applied to every string in it, however deep."""
    if isinstance(value, dict):
        return {key: _redacted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_redacted(item) for item in value]
    return redact_url(value) if isinstance(value, str) else value
