"""One round of the learning loop on one device, in one process: serve, fine-tune a LoRA adapter on
the ratings, judge it, serve it beside the champion, promote it merged, all under load.

    .venv/bin/python benchmarks/loop_round.py [--device cuda] [--dtype bfloat16] [--compile on]
        [--random-weights DIR] [--streams 16] [--tokens 48]

On SmolLM2-135M-Instruct (or random weights of its shape, --random-weights as in real_model.py), in
the worker's engine and on the device given:
  1. version 1 loaded (compiled and warmed up with --compile on);
  2. 32 chat requests sampled at 0.9, rated by users who like a numbered list
     (feedback/tasks/numbered.py); random weights please nobody, so there every other answer is
     liked: the round's cost does not depend on what is learned (benchmarks/thumbs_loop.py measures
     learning);
  3. the fine-tune job's training (`train_candidate`, the LoRA recipe) on 24 of them and the gate's
     `feedback_shift` on the other 8, on the engine's thread as a worker would run it;
  4. under --streams clients that never pause: 5 s on version 1; the adapter attached as version 2
     and half the new requests sent to it (the experiment) for 5 s; the adapter merged into a copy
     of version 1's weights as version 3 (the promotion), loaded (and compiled) beside them, every
     new request sent to it, and version 1 unloaded with its adapter.
Prints each stage's time, tokens/s and TPOT p50/p99 per phase, the longest wait between two tokens
of one stream in each phase, and the requests that failed (0 expected).
"""

from __future__ import annotations

from workers.threads import spin_briefly

spin_briefly()  # the engine runs in this process as in a worker's: before torch loads

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from real_model import chat_prompts, describe, pct  # this script's directory is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from feedback.tasks.numbered import has_numbered_list
from feedback.tasks.task import Example
from feedback.training.dataset import Dataset, Judged
from feedback.training.gate import feedback_shift
from feedback.training.trainer import LORA_RECIPE, train_candidate
from tests.support.models import EndlessTokenizer
from tests.support.smollm2 import converted_smollm2, random_smollm2
from workers.engine import Engine, EngineConfig
from workers.loading import load_directory
from workers.models.loader import load_tokenizer, resolve_device, resolve_dtype
from workers.residency import Resident, ResidentAdapter, ResidentVersion
from workers.sampling import SamplingParams
from workers.sequence import GenerationParams

PHASE_S = 5.0


@dataclass
class Phase:
    """What the clients saw while one phase lasted."""

    tokens: int = 0
    seconds: float = 0.0
    tpot: list[float] = field(default_factory=list)
    longest_wait: float = 0.0
    failed: int = 0

    def line(self, label: str) -> str:
        p50, p99 = (pct(self.tpot, q) if self.tpot else float("nan") for q in (50, 99))
        return (
            f"{label:<44} {self.tokens / self.seconds:8.1f} tok/s   TPOT p50/p99 {p50:6.1f} / {p99:6.1f} ms  "
            f"longest wait {1000 * self.longest_wait:7.0f} ms   failed {self.failed}"
        )


class Load:
    """Clients that keep `streams` requests in flight, each sent to `route(i)` when it starts; what
    they see is booked to the phase running when it happens."""

    def __init__(self, engine: Engine, prompts: list[list[int]], streams: int, tokens: int):
        self.engine, self.prompts, self.streams, self.tokens = engine, prompts, streams, tokens
        self.route: list[Resident] = []
        self.phase = Phase()
        self._stop = asyncio.Event()

    async def _client(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            target = self.route[i % len(self.route)]
            params = GenerationParams(max_tokens=self.tokens)
            last = first = 0.0
            count = 0
            try:
                async for delta in self.engine.generate(
                    target.name, target.version, self.prompts[i % len(self.prompts)], params
                ):
                    now, phase = time.perf_counter(), self.phase
                    if last:
                        phase.longest_wait = max(phase.longest_wait, now - last)
                    first, last = first or now, now
                    count += len(delta.token_ids)
                    phase.tokens += len(delta.token_ids)
                if count > 1:
                    self.phase.tpot.append((last - first) / (count - 1))
            except Exception:
                self.phase.failed += 1
            i += self.streams

    async def run(self, phases: list[tuple[str, Callable[[], Awaitable[None]]]]) -> None:
        """Runs the phases in order: (label, a coroutine function that changes routes and returns
        when the phase may end), printing each."""
        clients = [asyncio.create_task(self._client(k)) for k in range(self.streams)]
        for label, change in phases:
            self.phase, started = Phase(), time.perf_counter()
            await change()
            await asyncio.sleep(PHASE_S)
            self.phase.seconds = time.perf_counter() - started
            print(self.phase.line(label))
        self._stop.set()
        await asyncio.gather(*clients)


async def sample_answers(
    engine: Engine, version: ResidentVersion, prompts: list[list[int]], tokens: int
) -> list[str]:
    """One answer to each prompt, sampled at 0.9 with seeds 1..n."""

    async def one(i: int, prompt: list[int]) -> str:
        params = GenerationParams(max_tokens=tokens, sampling=SamplingParams(temperature=0.9, seed=i + 1))
        ids = [
            t
            async for d in engine.generate(version.name, version.version, prompt, params)
            for t in d.token_ids
        ]
        return version.tokenizer.decode(ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on the CPU), or a dtype"
    )
    parser.add_argument("--compile", choices=("off", "on"), default="off")
    parser.add_argument("--random-weights", type=Path, metavar="DIR", help="SmolLM2's config and tokenizer")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    engine = Engine(EngineConfig(max_batch_size=args.streams, compile=args.compile == "on"))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            shape, directory = args.random_weights, Path(tmp) / "smollm2"
            checkpoint = random_smollm2(shape, directory) if shape else converted_smollm2(directory)
            asyncio.run(loop_round(engine, checkpoint, device, dtype, args))
    finally:
        engine.close()


async def loop_round(
    engine: Engine,
    checkpoint: Path,
    device: torch.device,
    dtype: torch.dtype | None,
    args: argparse.Namespace,
) -> None:
    def load(version: str) -> ResidentVersion:
        loaded = load_directory(checkpoint, "smollm2", version, device, dtype=dtype)
        loaded.tokenizer = EndlessTokenizer(loaded.tokenizer)  # type: ignore[assignment]
        return loaded

    started = time.perf_counter()
    v1 = engine.run(lambda: load("1"))
    engine.add(v1)
    weights, compiled = (
        " (random weights)" if args.random_weights else "",
        " and compiled" if args.compile == "on" else "",
    )
    print(f"SmolLM2-135M-Instruct{weights} on {describe(device)}, {v1.model.dtype}, compile {args.compile}, "
          f"torch {torch.__version__}")  # fmt: skip
    print(f"version 1 loaded{compiled} in {time.perf_counter() - started:.1f} s")
    tokenizer = load_tokenizer(checkpoint)  # with its end of sequence, which training appends
    prompts = chat_prompts(tokenizer, 32)
    texts = [tokenizer.decode(p) for p in prompts]
    started = time.perf_counter()
    answers = await sample_answers(engine, v1, prompts, args.tokens)
    liked = [has_numbered_list(a) if not args.random_weights else i % 2 == 0 for i, a in enumerate(answers)]
    print(f"32 answers sampled in {time.perf_counter() - started:.1f} s; {sum(liked)} liked")
    examples = [Example(prompt=t, thought=None, answer=a) for t, a in zip(texts, answers, strict=True)]
    dataset = Dataset(
        desirable=[e for e, good in zip(examples[:24], liked, strict=False) if good],
        undesirable=[e for e, good in zip(examples[:24], liked, strict=False) if not good],
        held_out=[Judged(e, good) for e, good in zip(examples[24:], liked[24:], strict=True)],
        size=32,
    )
    started = time.perf_counter()
    candidate, history = engine.run(
        lambda: train_candidate(v1.model, tokenizer, dataset, lambda rng: rng.choice(examples), LORA_RECIPE)
    )
    trained = time.perf_counter() - started
    steps = LORA_RECIPE.steps
    print(f"trained {steps} LoRA steps in {trained:.1f} s ({trained / steps * 1000:.0f} ms a step; "
          f"loss {history[0].loss:.3f} -> {history[-1].loss:.3f})")  # fmt: skip
    started = time.perf_counter()
    shift = engine.run(lambda: feedback_shift(v1.model, candidate, tokenizer, dataset.held_out))
    judged = time.perf_counter() - started
    print(f"gate's feedback_shift on {len(dataset.held_out)} held-out answers in {judged:.1f} s "
          f"(reward AUC {shift['reward_auc']:.2f})")  # fmt: skip
    assert candidate.adapter is not None
    adapter = ResidentAdapter("2", candidate.adapter.to(device, v1.model.dtype), v1)
    load_gen = Load(engine, prompts, args.streams, args.tokens)
    load_gen.route = [v1]

    async def steady() -> None:
        pass

    async def experiment() -> None:
        began = time.perf_counter()
        await asyncio.to_thread(engine.add, adapter)
        print(f"  adapter attached as version 2 in {1000 * (time.perf_counter() - began):.0f} ms")
        load_gen.route = [v1, adapter]

    async def promotion() -> None:
        began = time.perf_counter()

        def merged() -> ResidentVersion:
            v3 = load("3")
            candidate.adapter.merge_into(v3.model)  # type: ignore[union-attr,arg-type]  # checked above
            return v3

        v3 = await asyncio.to_thread(engine.run, merged)
        await asyncio.to_thread(engine.add, v3)
        load_gen.route = [v3]
        engine.remove(v1.name, v1.version)
        print(f"  merged version 3 loaded{compiled} and serving in "
              f"{time.perf_counter() - began:.1f} s; version 1 and its adapter unloaded")  # fmt: skip

    await load_gen.run([
        ("version 1", steady),
        ("versions 1 and 2 (the experiment)", experiment),
        ("version 3 (promoted)", promotion),
    ])  # fmt: skip


if __name__ == "__main__":
    main()
