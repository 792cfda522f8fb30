"""What structured outputs buy and cost on SmolLM2-135M-Instruct, in one run.

    .venv/bin/python benchmarks/structured.py [--prompts 200] [--level 16] [--tokens 96] \
        [--dtype float32] [--rows 1 16]

1. Valid JSON. --prompts chat requests ask for a JSON object of one of five shapes (a person, a
   city, a book, a product, an event) about a subject, naming its fields and their types, greedy, up
   to --tokens each, --level in flight: once free (the instruction alone) and once held to the
   shape's JSON Schema (what `response_format` sends). Prints the share of answers that parse as
   JSON, the share valid under the schema, the share max_tokens cut short, and each run's output
   tokens/s.
2. What the masks cost a step. The held run's answers are replayed through the worker's constraints
   (workers/grammar.py: a mask computed and applied to a row of logits, then the token taken), as
   many at once as a decode step has rows (--rows), against a decode step of the model at that many
   rows: the median milliseconds of each and their ratio. The goal is under 10% at 16 rows.
3. The libraries. The same answers' masks from llguidance (what reflow uses) and, where it can be
   imported, xgrammar (not a dependency: `pip install --target DIR xgrammar apache-tvm-ffi` and put
   DIR on PYTHONPATH; its import needs transformers, which the test extras have): median and mean
   microseconds a mask, and each schema's compile time.
"""

from __future__ import annotations

from workers.threads import spin_briefly

spin_briefly()  # the engine runs in this process as in a worker's: before torch loads

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from reflow import structured_output
from reflow.v1 import inference_pb2
from tests.support.smollm2 import converted_smollm2
from workers.dtype_choice import decode_step
from workers.engine import Engine, EngineConfig
from workers.grammar import Grammars, vocabulary
from workers.loading import load_directory
from workers.metrics import WorkerMetrics
from workers.models.interface import Tokenizer
from workers.sequence import GenerationParams, Sequence

SHAPES: dict[str, tuple[dict[str, str], list[str]]] = {  # fields (name: type) and subjects
    "person": (
        {"name": "string", "age": "integer", "occupation": "string", "city": "string"},
        ["a famous scientist", "a chef", "a fictional detective", "a retired pilot", "a painter",
         "a football player", "a nurse", "a teacher"],
    ),
    "city": (
        {"name": "string", "country": "string", "population": "integer", "coastal": "boolean"},
        ["the capital of France", "a city in Japan", "a port in Brazil", "a mountain town",
         "a city on a river", "the largest city in Canada", "an ancient city", "a desert city"],
    ),
    "book": (
        {"title": "string", "author": "string", "year": "integer", "pages": "integer"},
        ["a mystery novel", "a cookbook", "a children's book", "a science fiction classic",
         "a history book", "a poetry collection", "a travel guide", "a biography"],
    ),
    "product": (
        {"name": "string", "price": "number", "in_stock": "boolean", "category": "string"},
        ["a laptop", "running shoes", "a coffee machine", "a bicycle", "a phone case",
         "a desk lamp", "a backpack", "a board game"],
    ),
    "event": (
        {"name": "string", "date": "string", "attendees": "integer", "outdoor": "boolean"},
        ["a music festival", "a wedding", "a marathon", "a book fair", "a science conference",
         "a school play", "a farmers market", "a chess tournament"],
    ),
}  # fmt: skip
TYPES = {"string": str, "integer": int, "number": float, "boolean": bool}


def model_of(shape: str) -> type[pydantic.BaseModel]:
    fields: Any = {name: (TYPES[kind], ...) for name, kind in SHAPES[shape][0].items()}
    return pydantic.create_model(shape.title(), __config__=pydantic.ConfigDict(extra="forbid"), **fields)


def workload(count: int) -> list[tuple[str, str]]:
    """(shape, instruction) of `count` requests, the shapes and their subjects in turn."""
    asks = []
    for shape, (fields, subjects) in SHAPES.items():
        named = ", ".join(f'"{name}" ({kind})' for name, kind in fields.items())
        asks += [(shape, f"Describe {s} as a JSON object with the fields {named}. Answer with the JSON only.")
                 for s in subjects]  # fmt: skip
    return list(itertools.islice(itertools.cycle(asks), count))


def grammar_of(shape: str) -> str:
    schema = json.dumps(model_of(shape).model_json_schema())
    return structured_output.grammar(inference_pb2.StructuredOutput(json_schema=schema)) or ""


async def answers(
    engine: Engine, tokenizer: Tokenizer, asks: list[tuple[str, str]], args: argparse.Namespace, held: bool
) -> tuple[list[list[int]], float]:
    """Each request's tokens (greedy, `args.level` in flight) and the run's output tokens/s."""
    semaphore = asyncio.Semaphore(args.level)

    async def one(shape: str, instruction: str) -> list[int]:
        prompt = tokenizer.encode(
            tokenizer.render_chat([{"role": "user", "content": instruction}]), bos=False
        )
        params = GenerationParams(max_tokens=args.tokens, grammar=grammar_of(shape) if held else None)
        async with semaphore:
            ids: list[int] = []
            async for delta in engine.generate("smollm2", "1", prompt, params):
                ids += delta.token_ids
            return ids

    started = time.perf_counter()
    outputs = await asyncio.gather(*(one(shape, instruction) for shape, instruction in asks))
    return list(outputs), sum(map(len, outputs)) / (time.perf_counter() - started)


def validity(
    tokenizer: Tokenizer, asks: list[tuple[str, str]], outputs: list[list[int]]
) -> tuple[float, float, float]:
    """Shares of answers that parse as JSON, that are valid under their shape's schema, and that
    max_tokens cut (no end token)."""
    parsed = valid = 0
    cut = sum(not ids or ids[-1] not in tokenizer.eos_ids for ids in outputs) / len(outputs)
    for (shape, _), ids in zip(asks, outputs, strict=True):
        text = tokenizer.decode(ids).strip()
        try:
            json.loads(text)
        except ValueError:
            continue
        parsed += 1
        try:
            model_of(shape).model_validate_json(text, strict=True)
            valid += 1
        except pydantic.ValidationError:
            pass
    return parsed / len(outputs), valid / len(outputs), cut


def mask_ms(
    grammars: Grammars, tokenizer: Tokenizer, traces: list[tuple[str, list[int]]], rows: int, vocab: int
) -> float:
    """Median milliseconds a step spends on the masks of `rows` held sequences replaying `traces`."""
    times = []
    for start in range(0, len(traces) - rows + 1, rows):
        batch = traces[start : start + rows]
        endless = GenerationParams(max_tokens=10**6)
        held = [(grammars.constraint(grammar_of(shape)), Sequence([0], endless, tokenizer, 10**6), ids)
                for shape, ids in batch]  # fmt: skip
        logits = torch.zeros(rows, vocab)
        for t in range(min(len(ids) for _, _, ids in held)):
            started = time.perf_counter()
            for row, (constraint, sequence, ids) in enumerate(held):
                constraint.restrict(logits[row : row + 1], sequence, [])
                constraint.accept(sequence, ids[t])
            times.append(time.perf_counter() - started)
            for _, sequence, ids in held:
                sequence.append(ids[t])
    return 1000 * statistics.median(times)


@torch.inference_mode()
def step_ms(model: Any, rows: int) -> float:
    step = decode_step(model, rows)
    step()
    times = []
    for _ in range(20):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def compare_libraries(
    tokenizer: Tokenizer, checkpoint: Path, traces: list[tuple[str, list[int]]], vocab: int
) -> None:
    import llguidance

    libraries = {"llguidance": llguidance_masks(llguidance, tokenizer, vocab)}
    try:
        import xgrammar
    except ImportError:
        print("  xgrammar: not importable (see this script's docstring to measure it too)")
    else:
        libraries["xgrammar"] = xgrammar_masks(xgrammar, checkpoint, vocab)
    for name, (compile_schema, masks) in libraries.items():
        compile_ms, per_mask = [], []
        for shape in SHAPES:
            started = time.perf_counter()
            compile_schema(shape)
            compile_ms.append(1000 * (time.perf_counter() - started))
        for shape, ids in traces:
            per_mask += masks(compile_schema(shape), ids)
        print(f"  {name:<10} mask: median {1e6 * statistics.median(per_mask):6.1f} us, "
              f"mean {1e6 * statistics.mean(per_mask):6.1f} us over {len(per_mask)}; "
              f"compile: median {statistics.median(compile_ms):.2f} ms a schema")  # fmt: skip


def llguidance_masks(llguidance: Any, tokenizer: Tokenizer, vocab: int) -> tuple[Any, Any]:
    table = vocabulary(tokenizer, vocab)

    def compile_schema(shape: str) -> Any:
        return llguidance.LLMatcher(table, grammar_of(shape))

    def masks(matcher: Any, ids: list[int]) -> list[float]:
        times = []
        for token in ids:
            started = time.perf_counter()
            np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            times.append(time.perf_counter() - started)
            matcher.consume_token(token)
        return times

    return compile_schema, masks


def xgrammar_masks(xgrammar: Any, checkpoint: Path, vocab: int) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    info = xgrammar.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(checkpoint), vocab_size=vocab
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile_schema(shape: str) -> Any:
        schema = json.dumps(model_of(shape).model_json_schema())
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False))

    def masks(matcher: Any, ids: list[int]) -> list[float]:
        times = []
        for token in ids:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - started)
            matcher.accept_token(token)
        return times

    return compile_schema, masks


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--level", type=int, default=16, help="requests in flight")
    parser.add_argument("--tokens", type=int, default=96, help="most output tokens a request")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="rows of the steps timed")
    args = parser.parse_args()
    engine = Engine(EngineConfig(), WorkerMetrics())
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = converted_smollm2(Path(tmp) / "smollm2")
        dtype = getattr(torch, args.dtype)
        version = engine.run(
            lambda: load_directory(checkpoint, "smollm2", "1", torch.device("cpu"), dtype=dtype)
        )
        engine.add(version)
        tokenizer, vocab = version.tokenizer, version.model.vocab_size
        asks = workload(args.prompts)
        threads = torch.get_num_threads()
        print(f"SmolLM2-135M-Instruct in {args.dtype}, greedy, {args.prompts} prompts, up to {args.tokens} "
              f"tokens, {args.level} in flight; torch {torch.__version__}, {threads} threads")  # fmt: skip
        print("1. valid JSON")
        runs = {}
        for held in (False, True):
            outputs, rate = asyncio.run(answers(engine, tokenizer, asks, args, held))
            parsed, valid, cut = validity(tokenizer, asks, outputs)
            runs[held] = outputs
            print(f"  {'schema' if held else 'free':<6}: parses {parsed:6.1%}  "
                  f"valid under the schema {valid:6.1%}  cut by max_tokens {cut:6.1%}  "
                  f"{rate:6.1f} tok/s")  # fmt: skip
        traces = [(shape, ids) for (shape, _), ids in zip(asks, runs[True], strict=True)]
        print("2. the masks' cost a step")
        grammars = Grammars(tokenizer, vocab)
        for rows in args.rows:
            masks = mask_ms(grammars, tokenizer, traces, rows, vocab)
            step = engine.run(lambda: step_ms(version.model, rows))  # noqa: B023  # run now
            print(f"  {rows:>3} rows: masks {masks:6.2f} ms, decode step {step:6.2f} ms: "
                  f"{masks / step:6.1%} of a step")  # fmt: skip
        print("3. the libraries, one mask at a time")
        compare_libraries(tokenizer, checkpoint, traces, vocab)
    engine.close()


if __name__ == "__main__":
    main()
