"""Typed views of the Kafka settings for the clients below the composition root: how every client
proves itself to the brokers and checks them (TLS, SASL, as kafka-python options), and what bounds
the publisher keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import SecretStr

from reflow.errors import ReflowError
from reflow.settings import Settings

Protocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
Mechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


@dataclass(frozen=True)
class KafkaSecurity:
    """The security of one Kafka connection; PLAINTEXT (the embedded broker's) by default.

    With SSL or SASL_SSL the brokers' certificates are checked against `ca_file` (the system's CAs
    when empty) and their host names; `cert_file` and `key_file` are the client's certificate for
    brokers that require mutual TLS. With SASL_* the client logs in as `username`.
    """

    protocol: Protocol = "PLAINTEXT"
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    sasl_mechanism: Mechanism = "SCRAM-SHA-512"
    username: str = ""
    password: SecretStr | None = None

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ReflowError(
                "a Kafka client certificate needs its key: set both REFLOW_KAFKA_SSL_CERT_FILE and "
                "REFLOW_KAFKA_SSL_KEY_FILE, or neither"
            )
        if self.sasl and not (self.username and self.password and self.password.get_secret_value()):
            raise ReflowError(
                f"REFLOW_KAFKA_SECURITY_PROTOCOL={self.protocol} logs in with SASL: set "
                "REFLOW_KAFKA_SASL_USERNAME and REFLOW_KAFKA_SASL_PASSWORD"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> KafkaSecurity:
        """REFLOW_KAFKA_SECURITY_PROTOCOL, REFLOW_KAFKA_SSL_* and REFLOW_KAFKA_SASL_*."""
        return cls(
            protocol=settings.kafka_security_protocol,
            ca_file=settings.kafka_ssl_ca_file,
            cert_file=settings.kafka_ssl_cert_file,
            key_file=settings.kafka_ssl_key_file,
            sasl_mechanism=settings.kafka_sasl_mechanism,
            username=settings.kafka_sasl_username,
            password=settings.kafka_sasl_password,
        )

    @property
    def tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    def client_options(self) -> dict[str, Any]:
        """The options of a KafkaProducer, KafkaConsumer or KafkaAdminClient."""
        options: dict[str, Any] = {"security_protocol": self.protocol}
        if self.tls:
            options |= {"ssl_check_hostname": True}
            if self.ca_file:
                options["ssl_cafile"] = self.ca_file
            if self.cert_file:
                options |= {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}
        if self.sasl:
            assert self.password is not None  # checked when made
            options |= {
                "sasl_mechanism": self.sasl_mechanism,
                "sasl_plain_username": self.username,
                "sasl_plain_password": self.password.get_secret_value(),
            }
        return options


PLAINTEXT = KafkaSecurity()


@dataclass(frozen=True)
class PublisherConfig:
    """How the publisher hands records to Kafka: over which security, how long it waits for acks
    before it keeps records in the outbox, the largest record value it sends (a larger one Kafka
    refuses for good), and how many enqueued records it holds in memory (more go to the outbox)."""

    security: KafkaSecurity
    handover_timeout_s: float
    max_record_bytes: int
    queue_max: int

    @classmethod
    def from_settings(cls, settings: Settings) -> PublisherConfig:
        """The Kafka security, REFLOW_KAFKA_HANDOVER_TIMEOUT_S, REFLOW_MAX_EVENT_BYTES and
        REFLOW_EVENT_QUEUE_MAX."""
        return cls(
            KafkaSecurity.from_settings(settings),
            settings.kafka_handover_timeout_s,
            settings.max_event_bytes,
            settings.event_queue_max,
        )
