"""The scheduler's plans: admission by batch rows and KV blocks, prefill chunks that depend on nothing
but the request, blocks taken as sequences grow and given back when they end, and prompt prefixes
mapped from the blocks an earlier prompt prefilled (the prefix cache), and drafts within a step's
rows and a sequence's blocks."""

from __future__ import annotations

import pytest
import torch

from reflow.errors import NotFound, ResourceExhausted
from workers.batch_scheduler import SPECULATIVE_ROWS, BatchScheduler, Request
from workers.models.builtin import TOKENIZER
from workers.sequence import GenerationParams, Sequence

TOK = TOKENIZER


def request(prompt: str, max_tokens: int = 4, adapter: str = "") -> Request:
    sequence = Sequence(TOK.encode(prompt), GenerationParams(max_tokens=max_tokens), TOK, 128)
    return Request(sequence, torch.Generator(), deliver=None, adapter=adapter)


def new_scheduler(
    rows: int = 8,
    waiting: int = 8,
    chunk: int = 64,
    budget: int = 64,
    blocks: int = 65,
    cache: bool = True,
    drafts: int = 0,
) -> BatchScheduler:
    return BatchScheduler(
        max_running=rows,
        max_waiting=waiting,
        prefill_chunk=chunk,
        max_prefill_tokens=budget,
        n_blocks=blocks,
        block_size=4,
        prefix_cache=cache,
        speculative_tokens=drafts,
    )


def prefill(scheduler: BatchScheduler) -> list[tuple[Request, int, int]]:
    """One step's prefill chunks, run: as the engine reports them once its forward wrote them."""
    chunks = scheduler.schedule().prefill
    for r, _, end in chunks:
        scheduler.prefilled(r, end)
    return chunks


def test_chunk_boundaries_never_depend_on_the_budget_left() -> None:
    scheduler = new_scheduler(budget=10)
    requests = [request("47+38=") for _ in range(3)]  # 7 tokens each
    for r in requests:
        scheduler.submit(r)
    chunks = []
    for _ in range(3):
        chunks += [(requests.index(r), start, end) for r, start, end in prefill(scheduler)]
    assert chunks == [(0, 0, 7), (1, 0, 7), (2, 0, 7)]  # one whole prompt per step, never (0, 3)


def test_long_prompts_prefill_in_fixed_chunks() -> None:
    scheduler = new_scheduler(rows=2, waiting=2, chunk=8, budget=100)
    long = request("x" * 19)  # 20 tokens
    scheduler.submit(long)
    boundaries = []
    while long.prefilled < long.prompt_len:
        ((_, start, end),) = prefill(scheduler)
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
    ((_, start, end),) = prefill(scheduler)
    assert (start, end, len(r.blocks), scheduler.blocks_used) == (0, 5, 2, 2)
    r.next_input = 7
    for _ in range(9):
        r.sequence.output_ids.append(7)
        assert scheduler.schedule().decode == [r]
        assert len(r.blocks) == -(-r.sequence.total_len // 4)  # exactly what its tokens need
    assert scheduler.blocks_used == 4
    scheduler.finish(r)
    assert (scheduler.blocks_used, scheduler.running) == (0, 0)


def test_drafts_fill_a_step_up_to_its_rows_and_stay_within_the_tokens_reserved() -> None:
    assert SPECULATIVE_ROWS == 8
    scheduler = new_scheduler(drafts=3)
    requests = [request("1+2=1+2=1+2=", max_tokens=m) for m in (10, 10, 3, 10)]
    for r in requests:
        scheduler.submit(r)
    prefill(scheduler)
    for r in requests:
        r.sequence.output_ids.append(TOK.encode("1")[-1])  # "…1+2=1": "+2=1" recurs, then "+2="
        r.next_input = r.sequence.output_ids[-1]
    plan = scheduler.schedule()
    assert plan.decode == requests
    # 4 decode rows leave 4 of the step's rows for drafts: 3 to the first, 1 to the next, then none
    assert [r.draft for r in requests] == [TOK.encode("+2=")[-3:], TOK.encode("+")[-1:], [], []]
    for r in requests:
        assert len(r.blocks) == -(-(r.sequence.total_len + len(r.draft)) // 4)  # room for each row
    alone = new_scheduler(drafts=3)
    r = request("1+2=1+2=1+2=", max_tokens=3)
    alone.submit(r)
    prefill(alone)
    r.sequence.output_ids.append(TOK.encode("1")[-1])
    r.next_input = r.sequence.output_ids[-1]
    alone.schedule()
    assert len(r.draft) == 1  # 1 output, 1 drafted kept, 1 from the last row: its 3 max_tokens


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


PREFIX = "You are a helpful assistant. "  # 30 tokens with BOS: 7 full blocks of 4


def test_a_prompt_starting_like_an_earlier_one_prefills_only_its_suffix() -> None:
    scheduler = new_scheduler(chunk=8)
    first = request(PREFIX + "1+1=")  # 34 tokens: 8 full blocks
    scheduler.submit(first)
    while first.prefilled < first.prompt_len:
        prefill(scheduler)
    first_blocks = list(first.blocks)
    scheduler.finish(first)
    assert (scheduler.blocks_used, scheduler.blocks_cached) == (0, 8)  # kept, yet free to take
    second = request(PREFIX + "2+2=")  # the same first 7 blocks, then its own
    scheduler.submit(second)
    ((_, start, end),) = prefill(scheduler)
    assert (start, end, second.sequence.cached_tokens) == (
        28,
        32,
        28,
    )  # to the next chunk boundary, as without it
    assert second.blocks[:7] == first_blocks[:7]
    assert scheduler.hit_rate == 28 / 68
    scheduler.finish(second)
    again = request(PREFIX + "1+1=")  # all of it cached, but its last token is always computed
    scheduler.submit(again)
    ((_, start, end),) = prefill(scheduler)
    assert (start, end, again.sequence.cached_tokens) == (32, 34, 32)


def test_a_shared_block_outlives_a_holder_that_is_cancelled() -> None:
    scheduler = new_scheduler()
    a, b = request(PREFIX + "1+1="), request(PREFIX + "2+2=")
    scheduler.submit(a)
    prefill(scheduler)
    scheduler.submit(b)
    prefill(scheduler)
    assert b.blocks[:7] == a.blocks[:7] and b.sequence.cached_tokens == 28
    a.cancelled = True
    scheduler.schedule()
    assert scheduler.blocks_used == len(b.blocks)  # the shared ones still held, by b alone
    c = request(PREFIX + "3+3=")
    scheduler.submit(c)
    prefill(scheduler)
    assert c.blocks[:7] == b.blocks[:7]  # and still cached


def test_cancelled_mid_prefill_only_the_blocks_a_forward_filled_are_cached() -> None:
    scheduler = new_scheduler(chunk=6)  # chunks end inside blocks: 0-6 fills block 0, half of block 1
    a = request(PREFIX + "1+1=")
    scheduler.submit(a)
    ((_, _, end),) = prefill(scheduler)
    assert end == 6 and scheduler.blocks_cached == 1
    scheduler.schedule()  # the next chunk is planned, its blocks taken, but never written
    a.cancelled = True
    scheduler.schedule()
    b = request(PREFIX + "1+1=")
    scheduler.submit(b)
    ((_, start, _),) = prefill(scheduler)
    assert (start, b.sequence.cached_tokens) == (
        4,
        4,
    )  # block 0 only: the half-written and planned ones never match


def test_cached_blocks_nobody_holds_are_evicted_least_recent_first_and_never_make_a_request_wait() -> None:
    scheduler = new_scheduler(blocks=17, chunk=64)  # 16 usable blocks of 4 tokens
    old, recent = request("a" * 31, max_tokens=1), request("b" * 31, max_tokens=1)  # 8 blocks each
    for r in (old, recent):
        scheduler.submit(r)
        prefill(scheduler)
        scheduler.finish(r)
    assert (scheduler.blocks_used, scheduler.blocks_cached) == (0, 16)  # every block cached, none held
    new = request("c" * 27, max_tokens=1)  # 7 blocks
    scheduler.submit(new)
    assert len(prefill(scheduler)) == 1  # admitted at once, evicting
    scheduler.finish(new)
    assert scheduler.blocks_cached == 16  # new's 7, and 9 of the 16 before
    old_again = request("a" * 31, max_tokens=1)
    scheduler.submit(old_again)
    prefill(scheduler)
    assert (
        old_again.sequence.cached_tokens == 4
    )  # old's went first, tail before head: recent's 8 and old's head stayed


def test_an_engine_error_empties_the_cache() -> None:
    scheduler = new_scheduler()
    scheduler.submit(request(PREFIX + "1+1="))
    prefill(scheduler)
    assert scheduler.blocks_cached == 8
    scheduler.take_all()  # after a forward failed: on CUDA, an earlier one may have too
    assert (scheduler.blocks_cached, scheduler.blocks_used) == (0, 0)
    again = request(PREFIX + "1+1=")
    scheduler.submit(again)
    prefill(scheduler)
    assert again.sequence.cached_tokens == 0


def test_no_reuse_across_adapters_or_with_the_cache_off() -> None:
    scheduler = new_scheduler()
    base = request(PREFIX + "1+1=")
    scheduler.submit(base)
    prefill(scheduler)
    adapted = request(PREFIX + "1+1=", adapter="2")
    scheduler.submit(adapted)
    prefill(scheduler)
    assert adapted.sequence.cached_tokens == 0 and not set(adapted.blocks) & set(base.blocks)
    off = new_scheduler(cache=False)
    for _ in range(2):
        r = request(PREFIX + "1+1=")
        off.submit(r)
        prefill(off)
        off.finish(r)
        assert r.sequence.cached_tokens == 0
    assert (off.blocks_cached, off.hit_rate) == (0, 0.0)
