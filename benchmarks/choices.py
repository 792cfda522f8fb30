"""Several choices of one prompt, as `n` asks for them and as a client gets them without it, side by
side in one run: SmolLM2-135M-Instruct served by `reflow up` (one worker, float32), a long
system prompt, sampled answers.

    .venv/bin/python benchmarks/choices.py [--n 4] [--rounds 5] [--prompt-words 600] [--tokens 32]

Each round sends one chat completion with `n` choices, then `n` separate requests of the same
conversation at once (what a client does where `n` is refused), in alternating order from round to
round so the machine's noise falls on both alike. Each round's conversation starts with a nonce,
so nothing is reused from an earlier round. Prints, per way, the median time to the whole answer
and to its first chunk, the prompt tokens prefilled (prompt minus those reused from the prefix
cache, from the worker's counters), and the ratio of the medians; and the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from benchmarks.peers import Server, cpu, start_reflow
from reflow.endpoints import read_endpoints

TEXT = "the sea keeps a clock of salt and rain that no library has ever read aloud"


def conversation(round_: int, words: int) -> list[dict[str, str]]:
    nonce = uuid.uuid4().hex
    system = f"{nonce} Round {round_}. " + " ".join(itertools.islice(itertools.cycle(TEXT.split()), words))
    return [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]


async def completion(client: httpx.AsyncClient, server: Server, body: dict[str, object]) -> float:
    """The time to the first chunk of a streamed completion; read to its end."""
    sent = time.perf_counter()
    first = 0.0
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=server.headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and not first:
                first = time.perf_counter() - sent
    return first


async def prefilled(client: httpx.AsyncClient, metrics_url: str) -> float:
    """Prompt tokens the worker computed so far: its prompt tokens less those its cache held."""
    text = (await client.get(metrics_url)).text

    def counter(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))

    reused = counter("reflow_worker_prefix_cache_hit_tokens_total")
    return counter("reflow_worker_prompt_tokens_total") - reused


async def run(server: Server, metrics_url: str, n: int, rounds: int, words: int, tokens: int) -> None:
    sampled = {"model": server.model, "temperature": 0.8, "max_tokens": tokens, "stream": True}
    times: dict[str, list[tuple[float, float, float]]] = {"n": [], "separate": []}
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client, httpx.AsyncClient() as scraper:
        await completion(client, server, sampled | {"messages": conversation(-1, words)})  # warm-up
        for r in range(rounds):
            ways = ["n", "separate"] if r % 2 == 0 else ["separate", "n"]
            for way in ways:
                messages = conversation(r, words)
                before, started = await prefilled(scraper, metrics_url), time.perf_counter()
                if way == "n":
                    ttfts = [await completion(client, server, sampled | {"messages": messages, "n": n})]
                else:
                    body = sampled | {"messages": messages}
                    ttfts = list(await asyncio.gather(*(completion(client, server, body) for _ in range(n))))
                wall = time.perf_counter() - started
                times[way].append((wall, max(ttfts), await prefilled(scraper, metrics_url) - before))
    for way, measured in times.items():
        wall, ttft, tokens_prefilled = (statistics.median(m[i] for m in measured) for i in range(3))
        print(f"{way:<9} {n} answers: whole {wall * 1000:7.0f} ms, first chunk {ttft * 1000:7.0f} ms, "
              f"prompt tokens prefilled {tokens_prefilled:6.0f}  (medians of {rounds})")  # fmt: skip
    ratio = statistics.median(m[0] for m in times["separate"]) / statistics.median(m[0] for m in times["n"])
    print(f"n={n} answers in 1/{ratio:.2f} of the time {n} separate requests take")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-words", type=int, default=600)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    print(f"SmolLM2-135M-Instruct, float32, {args.tokens} output tokens a choice; {cpu()}")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "reflow"
        server = start_reflow("float32", data)
        try:
            endpoints = read_endpoints(data) or {}
            [metrics_url] = [url for name, url in endpoints["metrics"].items() if name.startswith("worker")]
            asyncio.run(run(server, metrics_url, args.n, args.rounds, args.prompt_words, args.tokens))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
