"""TLS on the gateway's public port, with test certificates: both faces answer clients that trust
the gateway's CA (the Python client, `reflow generate --ca-file`, the `openai` SDK), and refuse
plaintext and clients that do not trust it."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from reflow.client import Client
from reflow.gateway_tls import client_credentials
from reflow.settings import Settings
from reflow.v1 import inference_pb2, inference_pb2_grpc
from tests.support.certificates import tls_files
from tests.support.cli import reflow
from tests.support.stack import Stack, generate, request, start_stack, stop_stack


@pytest.fixture
def ca_file(tmp_path: Path) -> Path:
    """The CA that signed the gateway's certificate, in `tmp_path/tls` beside it."""
    return tls_files(tmp_path / "tls", "reflow test CA")["ca"][0]


@pytest.fixture
async def tls_stack(settings: Settings, ca_file: Path) -> AsyncIterator[Stack]:
    """A gateway serving TLS with a certificate for 127.0.0.1 that `ca_file` signed; the stack's
    own channel trusts it."""
    tls = ca_file.parent
    stack = await start_stack(
        settings.model_copy(
            update={"gateway_tls_cert_file": str(tls / "gateway.pem"),
                    "gateway_tls_key_file": str(tls / "gateway-key.pem"), "gateway_ca_file": str(ca_file)}
        )
    )  # fmt: skip
    yield stack
    await stop_stack(stack)


async def test_grpc_over_tls_answers_clients_that_trust_the_ca_only(
    tls_stack: Stack, ca_file: Path, tmp_path: Path
) -> None:
    other_ca = tls_files(tmp_path / "other", "other CA")["ca"][0]
    for channel in (
        grpc.aio.insecure_channel(tls_stack.address),  # plaintext
        grpc.aio.secure_channel(tls_stack.address, grpc.ssl_channel_credentials()),  # public roots only
        grpc.aio.secure_channel(tls_stack.address, client_credentials(other_ca)),
    ):
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await inference_pb2_grpc.InferenceStub(channel).ListModels(
                    inference_pb2.ListModelsRequest(), metadata=tls_stack.metadata, timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    def ask() -> tuple[list[inference_pb2.GenerateResponse], inference_pb2.ListModelsResponse]:
        with Client(tls_stack.address, tls_stack.api_key, ca_file=ca_file) as client:
            return list(client.generate("47+38=", sampling=request().sampling)), client.list_models()

    messages, models = await asyncio.to_thread(ask)
    assert [(m.name, [v.version for v in m.versions]) for m in models.models] == [("arith", ["1"])]
    assert messages[-1].finish_reason and messages[0].model_version == "1"
    over_the_stack = await generate(tls_stack, request())  # grpc.aio over TLS: the same greedy answer
    assert "".join(m.text for m in messages) == "".join(m.text for m in over_the_stack)


async def test_the_http_face_serves_https_to_clients_that_trust_the_ca_only(
    tls_stack: Stack, ca_file: Path
) -> None:
    assert tls_stack.http_url.startswith("https://")
    async with httpx.AsyncClient(timeout=10) as http:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await http.get(f"{tls_stack.http_url}/health")  # trusting certifi's roots only
        with pytest.raises(httpx.TransportError):
            await http.get(f"{tls_stack.http_url.replace('https://', 'http://')}/health")
    trusting = httpx.AsyncClient(verify=ssl.create_default_context(cafile=ca_file))
    async with openai.AsyncOpenAI(
        base_url=f"{tls_stack.http_url}/v1", api_key=tls_stack.api_key, max_retries=0, http_client=trusting
    ) as client:
        models = await client.models.list()
        completion = await client.completions.create(
            model="arith", prompt="47+38=", max_tokens=12, temperature=0
        )
    assert "arith" in [m.id for m in models.data]
    over_grpc = await generate(tls_stack, request())  # max_tokens 12, greedy: the same answer
    assert completion.choices[0].text == "".join(m.text for m in over_grpc)


async def test_reflow_generate_trusts_the_ca_it_is_given(tls_stack: Stack, ca_file: Path) -> None:
    target = ("47+38=", "--max-tokens", "3", "--target", tls_stack.address, "--api-key", tls_stack.api_key)
    trusting = await asyncio.to_thread(reflow, "generate", *target, "--ca-file", str(ca_file), timeout_s=60)
    assert trusting.returncode == 0, trusting.stderr
    assert "completion tokens" in trusting.stderr
    plaintext = await asyncio.to_thread(
        reflow, "generate", *target, env={"REFLOW_GATEWAY_CA_FILE": ""}, timeout_s=60
    )
    assert plaintext.returncode == 1
    assert "UNAVAILABLE" in plaintext.stderr


def test_reflow_up_with_a_tls_gateway_asks_for_the_ca_its_clients_trust(ca_file: Path) -> None:
    tls = ca_file.parent
    gateway_tls = {"REFLOW_GATEWAY_TLS_CERT_FILE": str(tls / "gateway.pem"),
                   "REFLOW_GATEWAY_TLS_KEY_FILE": str(tls / "gateway-key.pem")}  # fmt: skip
    result = reflow(
        "up", "--data-dir", str(tls.parent / "data"), env={**gateway_tls, "REFLOW_GATEWAY_CA_FILE": ""},
        timeout_s=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: the gateway serves TLS: set REFLOW_GATEWAY_CA_FILE to the CA certificate that signed "
        "REFLOW_GATEWAY_TLS_CERT_FILE (the certificate itself when self-signed)"
    )
    assert not (tls.parent / "data").exists()  # refused before it started anything
