"""What a flood of unauthenticated requests costs a gateway: its memory under N concurrent requests
of the largest body each face accepts, all with an unknown key, and the throughput of
authenticated traffic meanwhile; the gateway before the edge checked keys first (`--before`, by
default 07e5152, where the key was checked after the body was parsed) and this tree's, side by
side in one run.

    .venv/bin/python benchmarks/edge_memory.py [--concurrency 64] [--seconds 6] [--before REV]
                                               [--before-concurrency 8] [--before-mib 4]

Starts an embedded Kafka broker and a worker serving the built-in `tiny` model (`arith`), then for
each gateway and face a fresh `reflow gateway` process (from `git archive REV` in a temp dir for
the old one) with a store holding one tenant, and in it:
  * quiet: authenticated completions (max_tokens 4) through that face, 4 at a time, for
    --seconds: requests/s, and the gateway's RSS (VmRSS, sampled every 5 ms) at its highest;
  * flood: the same, while N clients send, one after another each, a request with an unknown key
    and the largest body the face takes: HTTP `POST /v1/chat/completions` with
    `{"tools": [{}, {}, ...]}`, gRPC a Generate of empty `messages`. The RSS peak over the quiet
    one is what the flood costs; the authenticated requests/s, against quiet, what it slows.
The old gateway takes 16 MiB HTTP bodies and 4 MiB gRPC messages; it is flooded with --before-mib
(4, as the issue measured) at --before-concurrency (8: at 64 its gRPC face alone would take tens of
GiB). Target: under +64 MiB for each face at 64. The clients share the machine's cores with the
gateway, so the authenticated rate under a flood also says what the flood's clients cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from reflow.settings import Settings
from reflow.v1 import inference_pb2, inference_pb2_grpc
from tests.support.kafka import Broker
from tests.support.models import MODEL, save_model, tiny_model
from tests.support.registry import local_registry

ROOT = Path(__file__).resolve().parent.parent
KEY = "rf_bench_key_0123456789abcdef"
UNKNOWN = "Bearer rf_unknown_key_0123456789abcdef"
MIB = 2**20
KEY_AFTER_BODY = "07e5152"  # the last revision whose gateway read a body before checking its key
# Run in the gateway's tree: its own store, migrated by its own code, with the tenant of KEY
MAKE_STORE = """
import sys
from gateway.tenants import UNLIMITED, create_tenant
from reflow.store import database
open_db = getattr(database, "open_db", None) or database.open_engine  # older trees
db = open_db(sys.argv[1])
database.migrate(db)
create_tenant(db, "bench", api_key=sys.argv[2], limits=UNLIMITED)
"""


@dataclass
class Gateway:
    """A `reflow gateway` process of some tree, and where it serves."""

    process: subprocess.Popen[bytes]
    address: str
    http: str

    def rss_mib(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("the gateway has exited")


def wait_for_file(path: Path, process: subprocess.Popen[bytes], what: str, log: Path) -> dict[str, str]:
    deadline = time.monotonic() + 120
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"{what} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    data: dict[str, str] = json.loads(path.read_text())
    return data


def start_gateway(tree: Path, work: Path, env: dict[str, str]) -> Gateway:
    """A gateway of `tree` with a fresh store under `work`."""
    work.mkdir(parents=True)
    store = f"sqlite:///{work / 'store.db'}"
    tree_env = {**env, "PYTHONPATH": str(tree), "REFLOW_DATA_DIR": str(work), "REFLOW_DATABASE_URL": store}
    subprocess.run([sys.executable, "-c", MAKE_STORE, store, KEY], env=tree_env, cwd=tree, check=True)
    ready, log = work / "ready.json", work / "gateway.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "reflow", "gateway", "--port", "0", "--http-port", "0", "--ready-file",
             str(ready)],
            env=tree_env, cwd=tree, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    endpoints = wait_for_file(ready, process, "the gateway", log)
    return Gateway(process, endpoints["address"], endpoints["http"])


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def tools_body(size: int) -> bytes:
    """A chat completion request of `size` bytes, nearly all of it empty tool objects."""
    head = b'{"model": "arith", "messages": [{"role": "user", "content": "hi"}], "tools": [{}'
    n = (size - len(head) - 2) // 4
    body = head + b", {}" * n + b"]}"
    return body.ljust(size)  # JSON allows trailing whitespace


def messages_message(size: int) -> bytes:
    """A GenerateRequest of at most `size` bytes, nearly all of it empty `messages`."""
    one = len(inference_pb2.GenerateRequest(messages=[inference_pb2.ChatMessage()]).SerializeToString())
    request = inference_pb2.GenerateRequest(messages=[inference_pb2.ChatMessage()] * ((size - 64) // one))
    return request.SerializeToString()


class Faces:
    """Authenticated completions and unknown-key floods through one gateway's two faces."""

    def __init__(self, gateway: Gateway):
        options = [("grpc.max_send_message_length", 64 * MIB)]
        self.channel = grpc.aio.insecure_channel(gateway.address, options=options)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.raw_generate = self.channel.unary_stream("/reflow.v1.Inference/Generate")
        self.http = httpx.AsyncClient(
            base_url=gateway.http, headers={"authorization": f"Bearer {KEY}"}, timeout=120
        )
        self.host, _, port = gateway.http.removeprefix("http://").rpartition(":")
        self.http_port = int(port)
        self.seen: Counter[str] = Counter()  # what the flood got

    async def grpc_completion(self) -> None:
        request = inference_pb2.GenerateRequest(
            model=MODEL, prompt="1+1=", sampling=inference_pb2.SamplingParams(max_tokens=4)
        )
        async for _ in self.stub.Generate(
            request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=120
        ):
            pass

    async def http_completion(self) -> None:
        body = {"model": MODEL, "prompt": "1+1=", "max_tokens": 4, "temperature": 0}
        (await self.http.post("/v1/completions", json=body)).raise_for_status()

    async def grpc_unknown(self, message: bytes) -> None:
        try:
            async for _ in self.raw_generate(message, metadata=(("authorization", UNKNOWN),), timeout=120):
                pass
        except grpc.aio.AioRpcError as error:
            self.seen[error.code().name] += 1

    async def http_unknown(self, body: bytes) -> None:
        """One request on a connection of its own, read to its status; the server may answer and
        close before it has the whole body."""
        reader, writer = await asyncio.open_connection(self.host, self.http_port)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nauthorization: {UNKNOWN}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        try:
            writer.write(head.encode() + body)
            status = (await reader.readuntil(b"\r\n")).split()[1].decode()
            self.seen[f"HTTP {status}"] += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            self.seen["closed"] += 1
        finally:
            writer.close()

    async def close(self) -> None:
        await self.channel.close()
        await self.http.aclose()


async def rate(one: Callable[[], Awaitable[None]], seconds: float, concurrency: int = 4) -> float:
    """Completed calls of `one` per second, `concurrency` at a time, for `seconds`."""
    done = 0
    deadline = time.monotonic() + seconds

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await one()
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.monotonic() - started)


class Peak:
    """The highest RSS of a gateway while `with` lasts, sampled every 5 ms in a thread."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.mib = max(self.mib, self.gateway.rss_mib())
            time.sleep(0.005)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Result:
    """One gateway's face, quiet and flooded."""

    quiet_rps: float
    flood_rps: float
    quiet_mib: float
    flood_mib: float
    seen: Counter[str]  # what the flood's requests got

    @property
    def added_mib(self) -> float:
        return self.flood_mib - self.quiet_mib

    @property
    def slowed(self) -> float:
        """Authenticated requests/s under the flood, against quiet."""
        return self.flood_rps / self.quiet_rps


async def measure(gateway: Gateway, face: str, concurrency: int, size: int, seconds: float) -> Result:
    faces = Faces(gateway)
    completion = faces.grpc_completion if face == "gRPC" else faces.http_completion
    for _ in range(20):  # warm the path, the key in L1
        await completion()
    with Peak(gateway) as quiet:
        quiet_rps = await rate(completion, seconds)
    payload = messages_message(size) if face == "gRPC" else tools_body(size)
    unknown = faces.grpc_unknown if face == "gRPC" else faces.http_unknown
    flooding = True

    async def flood() -> None:
        while flooding:
            await unknown(payload)

    with Peak(gateway) as flooded:
        floods = [asyncio.create_task(flood()) for _ in range(concurrency)]
        await asyncio.sleep(0.5)  # under way
        flood_rps = await rate(completion, seconds)
        flooding = False
        await asyncio.gather(*floods)
    await faces.close()
    return Result(quiet_rps, flood_rps, quiet.mib, flooded.mib, faces.seen)


@dataclass(frozen=True)
class Setup:
    """A gateway's tree, and the flood it gets."""

    name: str
    tree: Path
    concurrency: int
    size: int  # bytes of each flood request's body or message


def row(setup: Setup, face: str, r: Result) -> str:
    """One line of the table: the flood, the RSS it added, the authenticated rate it left."""
    what = f"{setup.concurrency} x {setup.size / MIB:.1f} MiB " + ("messages" if face == "gRPC" else "tools")
    seen = ", ".join(f"{k} {v}" for k, v in r.seen.most_common())
    rates = f"{r.quiet_rps:>6.1f} -> {r.flood_rps:>6.1f} ({r.slowed:.2f}x)"
    return (f"{setup.name:<10} {face:<5} {what:<28} {r.quiet_mib:>9.0f} {r.flood_mib:>7.0f} "
            f"{r.added_mib:>+7.0f}  {rates:<26}   {seen}")  # fmt: skip


def run(setup: Setup, face: str, work: Path, env: dict[str, str], seconds: float) -> Result:
    gateway = start_gateway(setup.tree, work, env)
    try:
        return asyncio.run(measure(gateway, face, setup.concurrency, setup.size, seconds))
    finally:
        stop(gateway.process)


def start_worker(root: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """A `reflow worker` serving the tiny model; returns it and its address."""
    work = root / "worker"
    work.mkdir()
    ready, log = work / "ready.json", work / "worker.log"
    with open(log, "w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "reflow", "worker", "--port", "0", "--ready-file", str(ready)],
            env={**env, "REFLOW_DATA_DIR": str(work)}, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return worker, wait_for_file(ready, worker, "the worker", log)["address"]


def checkout(revision: str, into: Path) -> Path:
    """The tree of `revision` (`git archive`), in `into`."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=64, help="unauthenticated requests at once")
    parser.add_argument("--seconds", type=float, default=6.0, help="of each quiet and each flood phase")
    parser.add_argument(
        "--before", default=KEY_AFTER_BODY, help="the git revision of the old gateway ('' = none)"
    )
    parser.add_argument("--before-concurrency", type=int, default=8)
    parser.add_argument("--before-mib", type=float, default=4.0, help="the old gateway's flood bodies")
    args = parser.parse_args()
    bound = Settings().max_request_bytes  # the largest body and message this tree's faces take
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        registry = local_registry(root, "registry")
        registry.register(
            MODEL, save_model(tiny_model(0), root / "tiny"), params={}, metrics={}, alias="champion"
        )
        broker = Broker()
        broker.start()
        env = {**os.environ, "REFLOW_ISOLATION": "none", "REFLOW_DEVICE": "cpu", "REFLOW_MODEL_NAME": MODEL,
               "REFLOW_MLFLOW_TRACKING_URI": registry.tracking_uri,
               "REFLOW_MLFLOW_ARTIFACT_ROOT": registry.artifact_root or "",
               "REFLOW_KAFKA_BOOTSTRAP": broker.bootstrap}  # fmt: skip
        worker, env["REFLOW_WORKERS"] = start_worker(root, env)
        setups = [Setup("this tree", ROOT, args.concurrency, bound)]
        if args.before:
            old = checkout(args.before, root / "before")
            setups.insert(0, Setup(args.before, old, args.before_concurrency, int(args.before_mib * MIB)))
        print(f"tiny model, 1 worker; authenticated: completions of 4 tokens, 4 at a time, "
              f"{args.seconds:.0f} s per phase; RSS in MiB")  # fmt: skip
        print(f"{'gateway':<10} {'face':<5} {'flood (unknown key)':<28} {'RSS quiet':>9} {'flood':>7} "
              f"{'added':>7}  {'auth req/s quiet -> flood':<26} flood got")  # fmt: skip
        results: dict[tuple[str, str], Result] = {}
        try:
            for setup in setups:
                for face in ("HTTP", "gRPC"):
                    work = root / f"{setup.name.replace(' ', '-')}-{face}"
                    results[setup.name, face] = run(setup, face, work, env, args.seconds)
                    print(row(setup, face, results[setup.name, face]), flush=True)
        finally:
            stop(worker)
            broker.stop()
    for face in ("HTTP", "gRPC"):
        now = results["this tree", face]
        verdict = "under" if now.added_mib < 64 else "OVER"
        line = f"{face}: +{now.added_mib:.0f} MiB at {args.concurrency} ({verdict} the +64 MiB target)"
        if args.before:
            then = results[args.before, face]
            line += (f"; {args.before}: +{then.added_mib:.0f} MiB at {args.before_concurrency} "
                     f"({now.added_mib / then.added_mib:.3f}x); authenticated req/s under the flood "
                     f"{now.slowed:.2f}x of quiet, {args.before}: {then.slowed:.2f}x")  # fmt: skip
        print(line)


if __name__ == "__main__":
    main()
