"""reflow against the servers its users would otherwise run, on the same SmolLM2-135M-Instruct weights,
through each server's OpenAI API, one after another in one run:

    ../shared/peers/setup.sh ~/.cache/reflow-peers        # once: the peers, each in a venv of its own
    .venv/bin/python benchmarks/peers.py [--peers ~/.cache/reflow-peers] [--levels 1 16 64]
        [--tokens 64] [--servers reflow:float32 reflow:bfloat16 reflow:int4 vllm:float32 vllm:bfloat16
        llamacpp:q4_1]

Each server serves the model alone on this machine (`reflow up` with one worker, its scheduler's
jobs deferred past the run; vLLM-CPU and llama.cpp's server by the setup's `start_peer.sh`), in the
dtype its entry names: reflow in a `REFLOW_DTYPE` (float32, bfloat16, or auto, which measures them
at load), or on its int8 or int4 copy (`REFLOW_VARIANTS`, each request naming the variant) of the
weights in the dtype `auto` picks, as a user's worker holds them; vLLM in
float32 or bfloat16 (`--dtype`); llama.cpp on the Q4_1 GGUF file itself. One OpenAI-API load generator
(streamed chat completions, greedy, up to `--tokens` output tokens, prompts that ask for a long
story; each server's tokens are counted as it produced them) sends, at each concurrency C, max(2C,
8) requests with at most C in flight, after a warm-up. Prints per server and C: output tokens/s
(completion tokens / wall time), the median time per output token of a request (TPOT: from its first
to its last token), the median time to its first token and the processes that used the CPU while
it ran (the share of one core each, from /proc: the server's against the load generator's), then
reflow's ratios to each peer's best, and the CPU (`lscpu` flags: with AMX, bfloat16 GEMMs win;
without, they do not). At one stream it also prints the share each server reaches of its memory
bound: this machine's read bandwidth (measured before any server starts) over the bytes of the
weights it reads a token (benchmarks/memory_bound.py: SmolLM2 loaded here in that dtype or copy; the
GGUF file's tensors for llama.cpp). The KV a stream holds, about 2% of that, is left out."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from benchmarks.memory_bound import bytes_read_a_step, gguf_bytes, read_bandwidth
from reflow.serving import free_port
from tests.support.cli import reflow
from tests.support.smollm2 import converted_smollm2, smollm2_gguf
from tests.support.up import API_KEY, Up
from tests.support.waiting import wait_for
from workers.models.llama import LlamaForCausalLM
from workers.models.precision import QUANTIZED, in_precision

PEER_MODEL = "smollm2-135m-instruct"  # what start_peer.sh serves it as
TOPICS = ["the sea", "bread", "a clock", "rain", "a library", "bees", "snow", "a bridge"]


@dataclass(frozen=True)
class Request:
    ttft_s: float
    tpot_s: float
    tokens: int


@dataclass(frozen=True)
class Level:
    concurrency: int
    tokens_per_s: float
    tpot_ms: float
    ttft_ms: float
    empty: int  # requests that got no token
    cpu: str  # the processes that used the CPU while it ran, and how much of one core each


@dataclass
class Server:
    """One server as the load generator reaches it (its base URL, the body fields it takes), and
    how it is stopped."""

    name: str
    url: str
    model: str
    extra: dict[str, object]
    headers: dict[str, str]
    stop: Callable[[], object]


def prompt(i: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]} and the number {i}."}
    ]


async def one(client: httpx.AsyncClient, server: Server, i: int, tokens: int) -> Request:
    body = {"model": server.model, "messages": prompt(i), "max_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **server.extra}  # fmt: skip
    sent = time.perf_counter()
    first = last = 0.0
    chunks = counted = 0
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=server.headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                counted = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                last = time.perf_counter()
                chunks += 1
    if not chunks:
        return Request(math.nan, math.nan, 0)
    n = counted or chunks  # a server that sends no usage in a stream sends a token a chunk
    return Request(first - sent, (last - first) / max(n - 1, 1), n)


async def level(server: Server, concurrency: int, tokens: int) -> Level:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=server.url, timeout=1800, limits=limits) as client:
        await asyncio.gather(*(one(client, server, i, 8) for i in range(min(concurrency, 4))))  # warm-up
        semaphore = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> Request:
            async with semaphore:
                return await one(client, server, i, tokens)

        started, before = time.perf_counter(), cpu_seconds()
        done = await asyncio.gather(*(bounded(i) for i in range(max(2 * concurrency, 8))))
        wall = time.perf_counter() - started
        busiest = busiest_processes(before, cpu_seconds(), wall)
    served = [r for r in done if r.tokens] or [Request(math.nan, math.nan, 0)]
    return Level(
        concurrency, sum(r.tokens for r in done) / wall, statistics.median(r.tpot_s for r in served) * 1000,
        statistics.median(r.ttft_s for r in served) * 1000, len(done) - sum(1 for r in done if r.tokens),
        busiest,
    )  # fmt: skip


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's name and CPU seconds so far (user and system, from /proc), by pid."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                argv = [
                    word.decode(errors="replace") for word in (entry / "cmdline").read_bytes().split(b"\0")
                ]
                seconds[int(entry.name)] = (
                    process_name(int(entry.name), argv),
                    (int(fields[11]) + int(fields[12])) / tick,
                )
    return seconds


def process_name(pid: int, argv: list[str]) -> str:
    """`reflow worker` and the other reflow processes by their command, this one as the load
    generator, others by their program (or module)."""
    if pid == os.getpid():
        return "load generator"
    if "reflow" in argv[1:3] and argv.index("reflow") + 1 < len(argv):  # python -m reflow COMMAND
        return f"reflow {argv[argv.index('reflow') + 1]}"
    if len(argv) > 2 and argv[1] == "-m":  # python -m MODULE (llama.cpp's server)
        return argv[2]
    return Path(argv[1] if len(argv) > 1 and argv[0].endswith("python") else argv[0]).name or "?"


def busiest_processes(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall: float
) -> str:
    """The processes that used at least 1% of a core between two `cpu_seconds`, busiest first."""
    used: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        used[name] = used.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
    shares = sorted(((s / wall, name) for name, s in used.items() if s / wall >= 0.01), reverse=True)
    return ", ".join(f"{name} {share:.0%}" for share, name in shares[:4])


def start_reflow(copy: str, data: Path) -> Server:
    """`reflow up` with one worker serving SmolLM2 in `copy`: a REFLOW_DTYPE (float32, bfloat16, auto),
    or a quantized variant (int8, int4) that each request names, of the weights in the dtype `auto`
    picks (the copy's activations are in that dtype: bfloat16 ones where the CPU multiplies
    bfloat16, which saves the casts around each product); once it wrote its endpoints."""
    variant = copy in QUANTIZED
    # The scheduler's jobs are the learning loop's, which no peer runs: deferred past the run. Else
    # its first evaluation, 30 s after start, imports MLflow and the experiments code (1.3 s of a
    # core) inside a measured level, and its first fine-tune check, at 300 s, imports torch.
    deferred = "3600"
    env = {
        "REFLOW_DATA_DIR": str(data), "REFLOW_ISOLATION": "none",
        "REFLOW_DTYPE": "auto" if variant else copy, "REFLOW_VARIANTS": copy if variant else "",
        "REFLOW_AB_EVALUATE_S": deferred, "REFLOW_FINETUNE_INTERVAL_S": deferred,
    }  # fmt: skip
    imported = reflow("models", "import", str(smollm2_gguf()), "--name", "smollm2", env=env)
    if imported.returncode != 0:
        sys.exit(f"reflow models import failed:\n{imported.stderr}")
    up = Up(data, "--model", "smollm2", "--workers", "1", env=env)
    try:
        endpoints = up.endpoints(timeout_s=600)
    except AssertionError as error:
        sys.exit(f"reflow up did not start: {error}")
    extra: dict[str, object] = {"variant": copy} if variant else {}
    return Server(f"reflow {copy}", str(endpoints["http"]), "smollm2", extra,
                  {"authorization": f"Bearer {API_KEY}"}, up.stop)  # fmt: skip


def start_peer(peers: Path, kind: str, dtype: str, log: Path, timeout_s: float = 900) -> Server:
    """A peer by the setup's start_peer.sh, once it answers /v1/models."""
    port = free_port()
    # llama-cpp-python's server stops the request it runs when another arrives (the other gets an
    # empty stream) unless told to queue them
    args = ["--dtype", dtype] if kind == "vllm" else ["--interrupt_requests", "False"]
    with open(log, "w") as out:
        process = subprocess.Popen(
            [str(peers / "start_peer.sh"), kind, str(port), *args], stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def stop() -> None:  # its whole process group: start_peer.sh execs into the server
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=120)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            process.kill()

    server = Server(f"{kind} {dtype}", f"http://127.0.0.1:{port}", PEER_MODEL, {}, {}, stop)

    def answers() -> bool:
        if process.poll() is not None:
            sys.exit(f"{server.name} exited:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{server.url}/v1/models", timeout=5).status_code == 200
        return False

    try:
        wait_for(answers, timeout_s, what=f"{server.name} to answer", interval_s=2)
    except AssertionError:
        stop()
        sys.exit(f"{server.name} did not answer within {timeout_s:.0f}s:\n{log.read_text()[-3000:]}")
    return server


def bytes_a_token(entries: list[str], directory: Path) -> dict[str, int]:
    """The bytes of the weights each server entry ("kind:dtype") reads a token, by entry (none for
    reflow's `auto`, whose dtype is chosen at load); each dtype or copy loaded once."""

    @functools.cache
    def of_copy(dtype: str) -> int:
        if dtype == "q4_1":
            return gguf_bytes(smollm2_gguf())
        checkpoint = converted_smollm2(directory)
        config = json.loads((checkpoint / "config.json").read_text())
        # int8 and int4 copies are made of the weights `auto` loads, bfloat16 here (the norms' bytes)
        weights = torch.float32 if dtype == "float32" else torch.bfloat16
        model = LlamaForCausalLM.from_checkpoint(checkpoint, config, torch.device("cpu"), weights)
        return bytes_read_a_step(in_precision(model, dtype) if dtype in QUANTIZED else model)

    return {entry: of_copy(entry.split(":")[1]) for entry in entries if not entry.endswith(":auto")}


def cpu() -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("Model name")), "?"
    )
    flags = set(
        next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("Flags")), [])
    )
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"]
    return f"{model}, {os.cpu_count()} CPUs; " + " ".join(f for f in wanted if f in flags)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=Path, default=Path.home() / ".cache" / "reflow-peers")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--servers", nargs="+",
        default=[
            "reflow:float32", "reflow:bfloat16", "reflow:int4",
            "vllm:float32", "vllm:bfloat16", "llamacpp:q4_1",
        ],
    )  # fmt: skip
    args = parser.parse_args()
    bandwidth = read_bandwidth(torch.device("cpu"))
    print(f"SmolLM2-135M-Instruct, {args.tokens} output tokens a request; {cpu()}; reads "
          f"{bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    results: dict[str, list[Level]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        read = bytes_a_token(args.servers, Path(tmp) / "smollm2")
        for entry in args.servers:
            kind, dtype = entry.split(":")
            if kind == "reflow":
                server = start_reflow(dtype, Path(tmp) / f"reflow-{dtype}")
            elif not (args.peers / "start_peer.sh").is_file():
                sys.exit(f"no peers in {args.peers}: run ../shared/peers/setup.sh {args.peers} first")
            else:
                server = start_peer(args.peers, kind, dtype, Path(tmp) / f"{kind}-{dtype}.log")
            try:
                results[server.name] = [asyncio.run(level(server, c, args.tokens)) for c in args.levels]
            finally:
                server.stop()
            for r in results[server.name]:
                bound_tok_s = bandwidth / read[entry] if entry in read and r.concurrency == 1 else None
                share = (
                    f"  {r.tokens_per_s / bound_tok_s:.0%} of {bound_tok_s:.0f} tok/s, its memory bound "
                    f"({read[entry] / 1e6:.0f} MB a token)" if bound_tok_s else ""
                )  # fmt: skip
                print(f"{server.name:<16} C={r.concurrency:<3} {r.tokens_per_s:7.1f} tok/s  TPOT p50 "
                      f"{r.tpot_ms:6.1f} ms  TTFT p50 {r.ttft_ms:7.1f} ms  CPU of a core: {r.cpu}"
                      + (f"  ({r.empty} requests got no token)" if r.empty else "") + share,
                      flush=True)  # fmt: skip
    ours = {n: r for n, r in results.items() if n.startswith("reflow")}
    peers = {n: r for n, r in results.items() if not n.startswith("reflow")}
    for i, c in enumerate(args.levels):
        if not ours or not peers:
            break
        best_ours = max(ours, key=lambda n: ours[n][i].tokens_per_s)
        line = [f"C={c}: reflow's best ({best_ours}) {ours[best_ours][i].tokens_per_s:.1f} tok/s"]
        for kind in sorted({n.split()[0] for n in peers}):
            best = max((n for n in peers if n.startswith(kind)), key=lambda n: peers[n][i].tokens_per_s)
            line.append(f"{ours[best_ours][i].tokens_per_s / peers[best][i].tokens_per_s:.2f}x {best}")
        print(", ".join(line))


if __name__ == "__main__":
    main()
