"""What a running `reflow up` tells other commands: `<data-dir>/endpoints.json` and the API key file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ENDPOINTS_FILE = "endpoints.json"
API_KEY_FILE = "api_key"


def read_endpoints(data_dir: Path) -> dict[str, Any] | None:
    """What a running `reflow up` wrote to `<data-dir>/endpoints.json`; None when it is not up."""
    path = data_dir / ENDPOINTS_FILE
    return json.loads(path.read_text()) if path.is_file() else None
