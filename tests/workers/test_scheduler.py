"""The scheduler's plans: admission by batch rows and KV blocks, prefill chunks that depend on nothing
but the request, blocks taken as sequences grow and given back when they end."""

from __future__ import annotations

import pytest
import torch

from reflow.errors import NotFound, ResourceExhausted
from workers.models.builtin import TOKENIZER
from workers.scheduler import Request, Scheduler
from workers.sequence import GenerationParams, Sequence

TOK = TOKENIZER


def request(prompt: str, max_tokens: int = 4) -> Request:
    sequence = Sequence(TOK.encode(prompt), GenerationParams(max_tokens=max_tokens), TOK, 128)
    return Request(sequence, torch.Generator(), deliver=None)


def new_scheduler(
    rows: int = 8, waiting: int = 8, chunk: int = 64, budget: int = 64, blocks: int = 65
) -> Scheduler:
    return Scheduler(rows, waiting, chunk, budget, n_blocks=blocks, block_size=4)


def test_chunk_boundaries_never_depend_on_the_budget_left() -> None:
    scheduler = new_scheduler(budget=10)
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
    scheduler = new_scheduler(rows=2, waiting=2, chunk=8, budget=100)
    long = request("x" * 19)  # 20 tokens
    scheduler.submit(long)
    boundaries = []
    while long.prefilled < long.prompt_len:
        ((r, start, end),) = scheduler.schedule().prefill
        r.prefilled = end
        boundaries.append((start, end))
    assert boundaries == [(0, 8), (8, 16), (16, 20)]


def test_batch_rows_queue_and_closing() -> None:
    scheduler = new_scheduler(rows=1, waiting=1)
    first, second = request("1+1="), request("2+2=")
    scheduler.submit(first)
    scheduler.schedule()
    scheduler.submit(second)
    with pytest.raises(ResourceExhausted):
        scheduler.submit(request("3+3="))
    assert (scheduler.running, scheduler.waiting, first.blocks) == (1, 1, [1, 2])  # 5 prompt tokens
    first.cancelled = True
    scheduler.schedule()
    assert (scheduler.running, second.blocks) == (1, [1, 2])  # the cancelled one's blocks went to the next
    scheduler.close()
    with pytest.raises(NotFound):
        scheduler.submit(request("4+4="))
    assert scheduler.take_all() == [second] and not scheduler.has_work()
    assert scheduler.blocks_used == 0


def test_blocks_are_taken_as_a_sequence_grows_and_given_back_at_its_end() -> None:
    scheduler = new_scheduler(blocks=9)  # 8 usable blocks of 4 tokens
    r = request("1+1=", max_tokens=10)  # 5 prompt tokens, at most 15 in all: 4 blocks reserved
    scheduler.submit(r)
    ((_, start, end),) = scheduler.schedule().prefill
    assert (start, end, len(r.blocks), scheduler.blocks_used) == (0, 5, 2, 2)
    r.prefilled, r.next_input = end, 7
    for _ in range(9):
        r.sequence.output_ids.append(7)
        assert scheduler.schedule().decode == [r]
        assert len(r.blocks) == -(-r.sequence.total_len // 4)  # exactly what its tokens need
    assert scheduler.blocks_used == 4
    scheduler.finish(r)
    assert (scheduler.blocks_used, scheduler.running) == (0, 0)


def test_a_request_waits_until_the_pool_covers_its_longest_completion() -> None:
    scheduler = new_scheduler(blocks=9)  # 8 usable blocks
    big = [request("1+1=", max_tokens=27) for _ in range(2)]  # 5 + 27 = 32 tokens: 8 blocks each
    for r in big:
        scheduler.submit(r)
    plan = scheduler.schedule()
    assert [r for r, _, _ in plan.prefill] == [big[0]] and scheduler.waiting == 1
    assert scheduler.blocks_used == 2  # taken as needed, though all 8 are promised to it
    small = request("2+2=")
    scheduler.submit(small)
    scheduler.schedule()
    assert scheduler.waiting == 2  # first come, first served: nobody overtakes the head
    big[0].cancelled = True
    plan = scheduler.schedule()
    assert [r for r, _, _ in plan.prefill] == [big[1]] and scheduler.waiting == 1
