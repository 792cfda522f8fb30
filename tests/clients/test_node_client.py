"""A client in another language: Node.js (@grpc/grpc-js), given only protos/, streams a completion
and rates it."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from tests.support.stack import Stack

SCRIPT = Path(__file__).parent / "node" / "stream.js"
NODE = shutil.which("node")

pytestmark = [
    pytest.mark.skipif(NODE is None, reason="needs Node.js (`node`) on PATH"),
    pytest.mark.skipif(
        not (SCRIPT.parent / "node_modules" / "@grpc" / "grpc-js").is_dir(),
        reason="needs the npm packages: run `make install-test` (make test does)",
    ),
]


async def run_node(*args: str) -> tuple[int, list[dict]]:
    process = await asyncio.create_subprocess_exec(
        NODE, str(SCRIPT), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    lines = [json.loads(line) for line in stdout.decode().splitlines() if line.strip()]
    assert lines, stderr.decode()
    return process.returncode, lines


async def test_node_client_streams_a_completion(stack: Stack) -> None:
    code, lines = await run_node(stack.address, stack.api_key, "47+38=")
    assert code == 0 and lines[-1] == {"status": "OK"}
    assert lines[-2]["ack"] == {"accepted": "1", "rejected": "0", "errors": []}  # its rating
    messages = lines[:-2]
    assert messages[0]["model"] == "arith" and messages[0]["model_version"] == "1"
    assert messages[0]["arm"] == "champion" and len(messages[0]["request_id"]) == 48
    assert messages[-1]["finish_reason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")
    assert messages[-1]["usage"]["prompt_tokens"] == 7
    assert 1 < len(messages) <= messages[-1]["usage"]["completion_tokens"]  # deltas may be coalesced


async def test_node_client_sees_status_codes(stack: Stack) -> None:
    code, lines = await run_node(stack.address, "rf_wrong_key_wrong_key", "47+38=")
    assert code == 1 and lines[-1]["status"] == "UNAUTHENTICATED"
