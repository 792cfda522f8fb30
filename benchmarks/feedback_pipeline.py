"""Feedback throughput from SubmitFeedback to committed rows, beside the broker's raw consume rate.

    .venv/bin/python benchmarks/feedback_pipeline.py [--items 20000] [--runs 3] [--database-url URL]

Starts the embedded broker, a gateway process and a `reflow feedback consume` process (what
`reflow up` runs), with the store on SQLite in a temp dir unless --database-url names another
(an empty database). Per run, measured side by side:
  * raw: a consumer group (the same client settings as the store consumer) reading --items
    records of the same size from a topic of its own, from its first record to its last; joining
    the group is not counted;
  * pipeline: one SubmitFeedback stream of --items ratings, from its first item sent until the
    store holds every row (the consumer is already in its group); also the rate at which the
    gateway acknowledged the stream (handed over to Kafka with acks=all);
  * ingest: the same number of ratings as JSONL lines through `reflow feedback ingest`'s code
    path (validated, published with acks=all), until the store holds every row.
Prints the medians over --runs and the ratio pipeline / raw.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from feedback.bus.kafka import ensure_topics, new_consumer, new_producer
from feedback.bus.publisher import Publisher
from feedback.intake.ingest import ingest
from gateway.tenants import create_tenant
from reflow.cli.supervisor import Supervisor, wait_serving
from reflow.kafka_settings import PLAINTEXT, PublisherConfig
from reflow.request_ids import RequestIds
from reflow.serving import free_port
from reflow.settings import Settings
from reflow.store.database import migrate, open_db
from reflow.store.tables import FeedbackItem
from reflow.v1 import inference_pb2, inference_pb2_grpc

RAW_TOPIC = "bench.raw"


def stored(db: Engine) -> int:
    with Session(db) as session:
        return session.scalar(select(func.count()).select_from(FeedbackItem)) or 0


def wait_rows(db: Engine, count: int, timeout_s: float = 300) -> float:
    """Polls the store until it holds `count` feedback rows; returns when that was seen."""
    deadline = time.perf_counter() + timeout_s
    while stored(db) < count:
        if time.perf_counter() > deadline:
            sys.exit(f"the store holds {stored(db)} of {count} rows after {timeout_s:.0f}s")
        time.sleep(0.02)
    return time.perf_counter()


def raw_consume_rate(bootstrap: str, items: int, value: bytes, group: str) -> float:
    """Records/s of a consumer group reading `items` records, first record to last."""
    producer = new_producer(bootstrap, security=PLAINTEXT)  # the embedded broker's
    for i in range(items):
        producer.send(RAW_TOPIC, key=str(i % 997).encode(), value=value)
    producer.flush()
    producer.close()
    consumer = new_consumer(bootstrap, RAW_TOPIC, security=PLAINTEXT, group_id=group, max_poll_records=1000)
    seen, first = 0, None
    while seen < items:
        for records in consumer.poll(timeout_ms=200, max_records=1000).values():
            first = first or time.perf_counter()
            seen += len(records)
        consumer.commit()  # as the store consumer does after each batch
    elapsed = time.perf_counter() - (first or time.perf_counter())
    consumer.close()
    return items / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--database-url", default="")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=args.database_url)
        supervisor = Supervisor(settings)
        bootstrap = supervisor.spawn_broker()
        ensure_topics(bootstrap, settings.kafka_partitions, security=PLAINTEXT)
        db = open_db(settings.resolved_database_url)
        migrate(db)
        _, key = create_tenant(db, "bench")
        request_ids = RequestIds.from_store(db)
        env = {"REFLOW_DATA_DIR": tmp, "REFLOW_KAFKA_BOOTSTRAP": bootstrap}
        if args.database_url:
            env["REFLOW_DATABASE_URL"] = args.database_url
        try:
            supervisor.wait_ready(supervisor.spawn("consumer", ["feedback", "consume"], env))
            # no worker is needed for feedback; the gateway routes to a port nobody listens on
            gateway_env = {**env, "REFLOW_WORKERS": f"127.0.0.1:{free_port()}"}
            gateway = supervisor.wait_ready(
                supervisor.spawn("gateway", ["gateway", "--port", "0"], gateway_env)
            )
            wait_serving(gateway["address"])
            channel = grpc.insecure_channel(gateway["address"])
            stub = inference_pb2_grpc.InferenceStub(channel)
            metadata = (("authorization", f"Bearer {key}"),)

            def submit(n: int, run: int) -> tuple[float, float]:
                """Sends n ratings; returns (seconds until acknowledged, seconds until stored)."""
                items = [
                    inference_pb2.Feedback(
                        feedback_id=f"r{run}-{i}", request_id=request_ids.new("bench"),
                        rating=1 - 2 * (i % 2), correction=str(i), user_id=f"user-{i % 100}",
                    )
                    for i in range(n)
                ]  # fmt: skip
                before = stored(db)
                start = time.perf_counter()
                ack = stub.SubmitFeedback(iter(items), metadata=metadata, timeout=600)
                acked = time.perf_counter()
                assert ack.accepted == n, ack
                return acked - start, wait_rows(db, before + n) - start

            def ingest_file(run: int) -> float:
                """Ingests a file of --items ratings; returns seconds until all are stored."""
                path = Path(tmp) / f"feedback-{run}.jsonl"
                lines = (
                    json.dumps({"feedback_id": f"i{run}-{i}", "request_id": request_ids.new("bench"),
                                "rating": 1, "correction": str(i), "user_id": f"user-{i % 100}"})
                    for i in range(args.items)
                )  # fmt: skip
                path.write_text("\n".join(lines) + "\n")
                before = stored(db)
                outbox = Path(tmp) / "ingest-outbox.db"
                publisher = Publisher(bootstrap, outbox, PublisherConfig.from_settings(settings))
                start = time.perf_counter()
                with path.open() as source:
                    report = ingest(source, "bench", request_ids, publisher)
                publisher.close()
                assert report.accepted == args.items and not report.rejected
                return wait_rows(db, before + args.items) - start

            submit(100, -1)  # the consumer has joined its group once this is stored
            sample = inference_pb2.Feedback(request_id=request_ids.new("bench"), rating=1, correction="123")
            value_size = 240 + len(sample.SerializeToString())  # about an event's JSON size
            raw, acked, pipeline, ingested = [], [], [], []
            for run in range(args.runs):
                raw.append(raw_consume_rate(bootstrap, args.items, b"x" * value_size, f"bench-{run}"))
                ack_s, stored_s = submit(args.items, run)
                acked.append(args.items / ack_s)
                pipeline.append(args.items / stored_s)
                ingested.append(args.items / ingest_file(run))
                print(
                    f"run {run + 1}: raw consume {raw[-1]:,.0f}/s · SubmitFeedback acknowledged "
                    f"{acked[-1]:,.0f}/s · committed to the store {pipeline[-1]:,.0f}/s · "
                    f"ingest to the store {ingested[-1]:,.0f}/s",
                    flush=True,
                )
            channel.close()
        finally:
            supervisor.stop()
            db.dispose()

    store = db.dialect.name
    print(f"\nmedians of {args.runs} runs, {args.items:,} items each, store on {store}:")
    rows = [
        ("raw consume rate (consumer group, same broker)", raw, "records/s"),
        ("SubmitFeedback acknowledged (acks=all)", acked, "items/s"),
        ("SubmitFeedback -> committed rows", pipeline, "items/s"),
        ("reflow feedback ingest -> committed rows", ingested, "items/s"),
    ]
    for label, rates, unit in rows:
        print(f"  {label:<50} {statistics.median(rates):>10,.0f} {unit}")
    for name, rates in (("SubmitFeedback", pipeline), ("ingest", ingested)):
        ratio = statistics.median(rates) / statistics.median(raw)
        print(f"  {name + ' pipeline / raw consume':<50} {ratio:>10.2f}")


if __name__ == "__main__":
    main()
