"""Kafka for tests: an embedded broker a test can stop and restart, and a store consumer in a thread."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator

from kafka.consumer.fetcher import ConsumerRecord
from sqlalchemy import Engine

from feedback.bus.broker import tansu_command, wait_listening
from feedback.bus.kafka import Record, ensure_topics, new_consumer, new_producer
from feedback.intake.consumer import StoreConsumer
from reflow.kafka_settings import PLAINTEXT, KafkaSecurity
from reflow.serving import free_port


class Broker:
    """An embedded (Tansu) Kafka broker on a free loopback port that a test can stop and restart;
    `advertised` (host:port) is where it tells clients to connect, e.g. a proxy in front of it."""

    def __init__(self, partitions: int = 3, advertised: str = ""):
        self.port = free_port()
        self.partitions = partitions
        self.advertised = advertised
        self.process: subprocess.Popen[bytes] | None = None
        self.started = False  # once started, it keeps its port: clients reconnect there

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Starts it, on its port again after a stop. The port was free when drawn, but another
        process may bind it before the broker does, which then exits: a first start draws another."""
        for _ in range(3):
            self.process = subprocess.Popen(
                tansu_command(self.port, advertised=self.advertised),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            wait_listening("127.0.0.1", self.port)
            if not self.advertised:  # clients reach a broker behind a proxy through the proxy only
                ensure_topics(self.bootstrap, self.partitions, security=PLAINTEXT)
            if self.process.poll() is None or self.started:
                break
            self.port = free_port()
        assert self.process.poll() is None, f"the broker exited with status {self.process.returncode}"
        self.started = True

    def read(self, topic: str, count: int, timeout_s: float = 30.0) -> list[ConsumerRecord]:
        """The first `count` records of `topic` (all partitions); fewer if they do not come in time."""
        consumer = new_consumer(self.bootstrap, topic, security=PLAINTEXT, group_id=None)
        records: list[ConsumerRecord] = []
        deadline = time.monotonic() + timeout_s
        while len(records) < count and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=100).values():
                records.extend(batch)
        consumer.close()
        return records

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@contextlib.contextmanager
def consuming(bootstrap: str, db: Engine, security: KafkaSecurity = PLAINTEXT) -> Iterator[StoreConsumer]:
    """A store consumer polling in a thread until the block ends (then it leaves its group)."""
    consumer = StoreConsumer(bootstrap, db, batch_size=100, security=security)
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, args=(stop,))
    thread.start()
    try:
        yield consumer
    finally:
        stop.set()
        thread.join(30)


def produce(bootstrap: str, records: list[Record], security: KafkaSecurity = PLAINTEXT) -> None:
    """Sends `records` straight to the broker, as a pipeline writing to the topics does."""
    producer = new_producer(bootstrap, security=security)
    for record in records:
        producer.send(record.topic, key=record.key, value=record.value)
    producer.flush()
    producer.close()
