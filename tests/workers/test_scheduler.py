"""The scheduler's plans: admission into slots, prefill chunks that depend on nothing but the request."""

from __future__ import annotations

import pytest
import torch

from reflow.errors import NotFound, ResourceExhausted
from workers.models.builtin import TOKENIZER
from workers.scheduler import Request, Scheduler
from workers.sequence import GenerationParams, Sequence

TOK = TOKENIZER


def request(prompt: str) -> Request:
    sequence = Sequence(TOK.encode(prompt), GenerationParams(max_tokens=4), TOK, 128)
    return Request(sequence, torch.Generator(), deliver=None)


def test_chunk_boundaries_never_depend_on_the_budget_left() -> None:
    scheduler = Scheduler(n_slots=8, max_waiting=8, prefill_chunk=64, max_prefill_tokens=10)
    requests = [request("47+38=") for _ in range(3)]  # 7 tokens each
    for r in requests:
        scheduler.submit(r)
    chunks = []
    for _ in range(3):
        plan = scheduler.schedule()
        for r, start, end in plan.prefill:
            r.prefilled = end
            chunks.append((requests.index(r), start, end))
    assert chunks == [(0, 0, 7), (1, 0, 7), (2, 0, 7)]  # one whole prompt per step, never (0, 3)


def test_long_prompts_prefill_in_fixed_chunks() -> None:
    scheduler = Scheduler(n_slots=2, max_waiting=2, prefill_chunk=8, max_prefill_tokens=100)
    long = request("x" * 19)  # 20 tokens
    scheduler.submit(long)
    boundaries = []
    while long.prefilled < long.prompt_len:
        ((r, start, end),) = scheduler.schedule().prefill
        r.prefilled = end
        boundaries.append((start, end))
    assert boundaries == [(0, 8), (8, 16), (16, 20)]


def test_slots_queue_and_closing() -> None:
    scheduler = Scheduler(n_slots=1, max_waiting=1, prefill_chunk=64, max_prefill_tokens=64)
    first, second = request("1+1="), request("2+2=")
    scheduler.submit(first)
    scheduler.schedule()
    scheduler.submit(second)
    with pytest.raises(ResourceExhausted):
        scheduler.submit(request("3+3="))
    assert (scheduler.running, scheduler.waiting, first.slot) == (1, 1, 0)
    first.cancelled = True
    scheduler.schedule()
    assert (scheduler.running, second.slot) == (1, 0)  # the cancelled one's slot went to the next
    scheduler.close()
    with pytest.raises(NotFound):
        scheduler.submit(request("4+4="))
    assert scheduler.take_all() == [second] and not scheduler.has_work()
