"""Kafka over TLS and SASL: the settings as kafka-python options, and the whole pipeline (`reflow
feedback consume`, a publisher) against a broker that speaks TLS only."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy import select
from sqlalchemy.orm import Session

from feedback.bus.publisher import Publisher
from feedback.events import FeedbackEvent, InferenceEvent, Latency, TokenUsage
from reflow.errors import ReflowError
from reflow.kafka_settings import KafkaSecurity, PublisherConfig
from reflow.request_ids import RequestIds
from reflow.settings import Settings
from reflow.store.database import migrate, open_db
from reflow.store.tables import FeedbackItem, Inference, utcnow
from tests.support.certificates import tls_files
from tests.support.cli import reflow, spawn
from tests.support.kafka import Broker
from tests.support.store import count
from tests.support.tls_proxy import TlsProxy
from tests.support.waiting import wait_for


def test_the_settings_become_the_options_of_every_client(tmp_path: Path) -> None:
    ca, cert, key = (tmp_path / name for name in ("ca.pem", "client.pem", "client-key.pem"))
    for path in (ca, cert, key):
        path.write_text("PEM")
    settings = Settings(
        kafka_security_protocol="SASL_SSL", kafka_ssl_ca_file=str(ca), kafka_ssl_cert_file=str(cert),
        kafka_ssl_key_file=str(key), kafka_sasl_mechanism="SCRAM-SHA-256", kafka_sasl_username="reflow",
        kafka_sasl_password=SecretStr("s3cret"),
    )  # fmt: skip
    assert KafkaSecurity.from_settings(settings).client_options() == {
        "security_protocol": "SASL_SSL", "ssl_check_hostname": True, "ssl_cafile": str(ca),
        "ssl_certfile": str(cert), "ssl_keyfile": str(key), "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "reflow", "sasl_plain_password": "s3cret",
    }  # fmt: skip
    assert "s3cret" not in repr(KafkaSecurity.from_settings(settings))  # never in a log line
    assert KafkaSecurity.from_settings(Settings()).client_options() == {"security_protocol": "PLAINTEXT"}
    assert KafkaSecurity(protocol="SSL").client_options() == {  # the system's CAs
        "security_protocol": "SSL",
        "ssl_check_hostname": True,
    }


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        (
            {"protocol": "SASL_SSL", "username": "reflow"},
            "set REFLOW_KAFKA_SASL_USERNAME and REFLOW_KAFKA_SASL_PASSWORD",
        ),
        ({"protocol": "SASL_PLAINTEXT", "password": SecretStr("x")}, "SASL_PLAINTEXT logs in with SASL"),
        ({"protocol": "SSL", "cert_file": "client.pem"}, "set both REFLOW_KAFKA_SSL_CERT_FILE and"),
    ],
)
def test_incomplete_settings_say_what_is_missing(fields: dict[str, object], complaint: str) -> None:
    with pytest.raises(ReflowError, match=complaint):
        KafkaSecurity(**fields)  # type: ignore[arg-type]


def test_reflow_up_refuses_a_secure_protocol_for_its_embedded_broker(tmp_path: Path) -> None:
    """The embedded broker speaks neither TLS nor SASL: `reflow up` says so before it starts anything,
    rather than children that never reach it."""
    result = reflow(
        "up", "--data-dir", str(tmp_path / "data"), env={"REFLOW_KAFKA_SECURITY_PROTOCOL": "SSL"},
        timeout_s=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: REFLOW_KAFKA_SECURITY_PROTOCOL=SSL needs your own brokers: set REFLOW_KAFKA_BOOTSTRAP, "
        "or leave the protocol PLAINTEXT for the embedded broker"
    )
    assert not (tmp_path / "data").exists()


@pytest.fixture
def tls_broker(tmp_path: Path) -> Iterator[tuple[TlsProxy, dict[str, tuple[Path, Path]]]]:
    """An embedded broker reachable only through a proxy that speaks (mutual) TLS, and the
    certificates: "ca", the broker's ("worker") and a client's ("gateway")."""
    files = tls_files(tmp_path / "tls", "kafka-ca")
    broker = Broker()
    with TlsProxy(lambda: broker.port, *files["worker"], client_ca_file=files["ca"][0]) as proxy:
        broker.advertised = proxy.address  # metadata sends clients back to the proxy
        broker.start()
        try:
            yield proxy, files
        finally:
            broker.stop()


def test_feedback_reaches_the_store_through_a_broker_that_speaks_tls_only(
    tls_broker: tuple[TlsProxy, dict[str, tuple[Path, Path]]], tmp_path: Path
) -> None:
    proxy, files = tls_broker
    database_url = f"sqlite:///{tmp_path / 'store.db'}"
    db = open_db(database_url)
    migrate(db)
    env = {
        "REFLOW_DATA_DIR": str(tmp_path / "data"), "REFLOW_DATABASE_URL": database_url,
        "REFLOW_KAFKA_BOOTSTRAP": proxy.address,
    }  # fmt: skip

    refused = reflow("feedback", "consume", env=env, timeout_s=120)  # PLAINTEXT, the default
    assert refused.returncode == 2
    assert f"cannot reach Kafka at {proxy.address} over PLAINTEXT" in refused.stderr
    assert "REFLOW_KAFKA_SECURITY_PROTOCOL" in refused.stderr

    tls = {
        "kafka_security_protocol": "SSL", "kafka_ssl_ca_file": str(files["ca"][0]),
        "kafka_ssl_cert_file": str(files["gateway"][0]), "kafka_ssl_key_file": str(files["gateway"][1]),
    }  # fmt: skip
    env |= {f"REFLOW_{k.upper()}": v for k, v in tls.items()}
    consumer = spawn("feedback", "consume", env=env)
    try:
        config = PublisherConfig.from_settings(Settings(**tls))
        publisher = Publisher(proxy.address, tmp_path / "outbox.db", config)
        request_id = RequestIds.from_store(db).new("acme")
        inference = InferenceEvent(
            request_id=request_id, tenant="acme", model="arith", version="1", prompt="1+1=", completion="2",
            finish_reason="STOP", usage=TokenUsage(prompt_tokens=4, completion_tokens=1, reasoning_tokens=0),
            latency=Latency(first_token_ms=1.0, total_ms=2.0), time=utcnow(),
        )  # fmt: skip
        rating = FeedbackEvent(
            feedback_id="f-tls", request_id=request_id, tenant="acme", rating=1, time=utcnow()
        )
        forged = rating.model_copy(update={"feedback_id": "f-forged", "request_id": "0" * 48})
        publisher.publish([inference.to_record(), rating.to_record(), forged.to_record()])
        assert publisher.close() == 0  # acked by the broker, over TLS
        wait_for(lambda: count(db, FeedbackItem) == 1, 60, "the rating in the store")
        with Session(db) as session:
            assert session.scalars(select(FeedbackItem.feedback_id)).all() == ["f-tls"]
            assert session.scalars(select(Inference.request_id)).all() == [request_id]

        def in_the_dlq() -> int:  # as `reflow feedback stats` counts it, over TLS
            return int(json.loads(reflow("feedback", "stats", "--json", env=env).stdout)["dlq_messages"])

        wait_for(lambda: in_the_dlq() == 1, 60, "the forged rating in the DLQ, sent there over TLS")
    finally:
        consumer.send_signal(signal.SIGTERM)
        assert consumer.wait(60) == 0
        db.dispose()
