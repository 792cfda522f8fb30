"""REFLOW_DTYPE=auto on the CPU: the dtype a Llama-family version is served in, chosen by measuring
this CPU when a worker first loads a model of its shape.

The candidates are float32 (the checkpoint's own arithmetic: greedy outputs equal transformers')
and bfloat16 (half the bytes; fast where the CPU multiplies bfloat16 natively: AMX, AVX-512 BF16).
Which wins depends on the CPU and the batch (docs/models.md#dtype-memory-and-speed), so the worker
times one decode step of each at 1 row and at its batch size (`max_batch_size`) and serves
bfloat16 when:

- its steps are at least MIN_SPEEDUP faster than float32's (the geometric mean over the row counts
  timed): a dtype that gives up float32's exactness must buy a clear gain, larger than the noise of
  a few timed steps on a shared machine; and
- its teacher-forced token agreement with float32 on the worker's fixed prompts
  (workers/quality.py) is at least AGREEMENT_FLOOR, the bar a quantized copy must pass too
  (measured only when it is faster: the forward passes cost a load time too).

Both candidates are timed as they would be served (`serving_layout`: projections fused, bfloat16
weights packed for oneDNN where each row keeps its bits in any batch, docs/batching.md#exactness,
float32 weights transposed where MKL multiplies them faster so).
For the built-in model, on CUDA, or with REFLOW_DTYPE set, nothing is measured. A worker measures
once per model shape: later versions of it (fine-tunes of the same base, hot-swapped in) are served
in the same dtype without a stall, so a champion and its challenger always compare in one dtype.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from workers.models.builtin import MODEL_TYPE as BUILTIN
from workers.models.greedy import greedy_ids
from workers.models.interface import CausalLM, Tokenizer
from workers.models.kv_cache import BLOCK_SIZE
from workers.models.llama import serving_layout
from workers.models.loader import load_checkpoint
from workers.quality import QUALITY_PROMPTS, QUALITY_TOKENS, teacher_forced_agreement
from workers.residency import DtypeCandidate, DtypeChoice, dtype_name

logger = logging.getLogger(__name__)

CANDIDATE = "bfloat16"  # what float32 is measured against
MIN_SPEEDUP = 1.1  # how much faster than float32 a candidate's steps must be
AGREEMENT_FLOOR = 0.95  # its least teacher-forced token agreement with float32
TIMED_STEPS = 5  # each step time is the median of this many, after one to warm up
STEP_POSITION = 40  # each timed row decodes at this position of its own blocks (a short chat turn)


class AutoDtype:
    """REFLOW_DTYPE=auto on one worker: the dtype each model shape it loaded was measured to serve."""

    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size  # the larger row count timed
        self.choices: dict[tuple[str, int, int, int], DtypeChoice] = {}  # by shape_key

    def load(
        self, directory: Path, device: torch.device, max_len: int = 0
    ) -> tuple[CausalLM, Tokenizer, DtypeChoice | None]:
        """The checkpoint in `directory` (`load_checkpoint`'s arguments) in the dtype REFLOW_DTYPE=auto
        serves it in, and how that was chosen (None where nothing is measured: `measures_dtype`). A
        dtype other than the one it loads in by default is read from the files, as REFLOW_DTYPE set to
        it reads them, never cast from the float32 copy."""
        model, tokenizer = load_checkpoint(directory, device, None, max_len)
        if not measures_dtype(model):
            return model, tokenizer, None
        key = shape_key(model)
        if (choice := self.choices.get(key)) is None:
            candidate, _ = load_checkpoint(directory, device, getattr(torch, CANDIDATE), max_len)
            for laid_out in (model, candidate):  # timed as they would be served
                serving_layout(laid_out)  # type: ignore[arg-type]  # a CausalLM is an nn.Module
            choice = self.choices[key] = choose_dtype(model, candidate, tokenizer, self.max_batch_size)
            capability = torch.backends.cpu.get_cpu_capability()
            logger.info(
                "REFLOW_DTYPE=auto measured %s model=%s: %s", capability, model.model_type, describe(choice)
            )
            return (candidate if choice.chosen == CANDIDATE else model), tokenizer, choice
        if choice.chosen != dtype_name(model):
            model, tokenizer = load_checkpoint(directory, device, getattr(torch, choice.chosen), max_len)
        return model, tokenizer, choice


def measures_dtype(model: CausalLM) -> bool:
    """Whether REFLOW_DTYPE=auto measures the dtype of `model`, loaded in its auto dtype: a
    Llama-family model loaded in float32, which is on the CPU."""
    return model.model_type != BUILTIN and model.dtype == torch.float32 and model.device.type == "cpu"


def shape_key(model: CausalLM) -> tuple[str, int, int, int]:
    """What makes two models time alike: their architecture and sizes (a fine-tune keeps them)."""
    return model.model_type, model.parameter_count(), model.vocab_size, model.kv_bytes_per_token


def choose_dtype(
    model: CausalLM, candidate: CausalLM, tokenizer: Tokenizer, max_batch_size: int
) -> DtypeChoice:
    """Measures `model` (float32) against the same weights in CANDIDATE on this CPU."""
    rows = tuple(dict.fromkeys((1, max_batch_size)))
    times = median_step_ms({"float32": model, CANDIDATE: candidate}, rows)
    return decide(rows, times["float32"], times[CANDIDATE], lambda: _agreement(model, candidate, tokenizer))


def decide(
    rows: tuple[int, ...],
    float32_ms: tuple[float, ...],
    candidate_ms: tuple[float, ...],
    agreement: Callable[[], float],
) -> DtypeChoice:
    """The rule: CANDIDATE where its steps (`candidate_ms` at each of `rows`) are MIN_SPEEDUP
    faster than float32's and its token agreement (asked of `agreement` only then) reaches
    AGREEMENT_FLOOR; float32 otherwise."""
    reference = DtypeCandidate("float32", float32_ms, 1.0)
    candidate = DtypeCandidate(CANDIDATE, candidate_ms, None)
    slower = DtypeChoice(rows, (reference, candidate), "float32")
    if slower.speedup(candidate) < MIN_SPEEDUP:
        return slower
    agreed = agreement()
    chosen = CANDIDATE if agreed >= AGREEMENT_FLOOR else "float32"
    return DtypeChoice(rows, (reference, replace(candidate, token_agreement=agreed)), chosen)


def describe(choice: DtypeChoice) -> str:
    """One line for the log: the dtype chosen, then each candidate's step times, speedup and agreement."""
    parts = []
    for c in choice.candidates:
        steps = ", ".join(f"{ms:.1f} ms at {n}" for n, ms in zip(choice.rows, c.step_ms, strict=True))
        agreement = "" if c.token_agreement is None else f", token agreement {c.token_agreement:.3f}"
        parts.append(f"{c.dtype} {steps} rows ({choice.speedup(c):.2f}x float32{agreement})")
    return f"serving {choice.chosen}; " + "; ".join(parts)


def decode_step(model: CausalLM, rows: int) -> Callable[[], torch.Tensor]:
    """One decode forward of `rows` sequences, each at STEP_POSITION of its own blocks."""
    per_row = STEP_POSITION // BLOCK_SIZE + 1
    cache = model.new_cache(1 + rows * per_row)  # block 0: scratch
    tables = [[1 + per_row * row + i for i in range(per_row)] for row in range(rows)]
    view = cache.view(tables, [[STEP_POSITION]] * rows, model.device)
    tokens = torch.zeros(rows, 1, dtype=torch.long, device=model.device)
    return lambda: model(tokens, cache, view)


@torch.inference_mode()
def median_step_ms(
    models: dict[str, CausalLM], rows: tuple[int, ...], timed_steps: int = TIMED_STEPS
) -> dict[str, tuple[float, ...]]:
    """Median milliseconds of `timed_steps` decode steps of each model at each row count, the
    models' steps interleaved (as the machine's load drifts, it drifts for all of them)."""
    steps = {(name, n): decode_step(model, n) for name, model in models.items() for n in rows}
    for step in steps.values():
        step()  # warm up: first-call allocations and kernel selection
    times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    for _ in range(timed_steps):
        for key, step in steps.items():
            started = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - started)
    return {name: tuple(1000 * statistics.median(times[name, n]) for n in rows) for name in models}


def _agreement(reference: CausalLM, other: CausalLM, tokenizer: Tokenizer) -> float:
    """`other`'s teacher-forced token agreement with `reference`'s greedy tokens on QUALITY_PROMPTS."""
    expected = greedy_ids(reference, tokenizer, QUALITY_PROMPTS, max_new_tokens=QUALITY_TOKENS)
    prompts = [tokenizer.encode(p) for p in QUALITY_PROMPTS]
    return teacher_forced_agreement(other, prompts, expected)
