"""Runs the steps a copy's scheduler plans on the copy's paged KV cache: one forward over the step's
prompt chunks and decoding sequences together where the native kernel attends (every token a row,
a packed view), else one over the prefill chunks, then one batched decode over every sequence; the
rows of the adapters served over the copy join the same forwards."""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from reflow.errors import NotFound
from workers.batch_scheduler import BatchScheduler, Output, Request, StepPlan
from workers.metrics import WorkerMetrics
from workers.models.kv_cache import CacheView
from workers.models.linears import unpack_linears
from workers.models.lora import Adapter, AdapterRows, AdapterSet
from workers.residency import Copy, ResidentVersion
from workers.sampling import TokenLogprob, adjust, sample, token_logprob
from workers.sequence import Delta

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs one copy of a resident version: its KV block pool, its scheduler, its batched decode step
    (compiled or eager), and the slots of the adapters served over it, whose rows join the same
    steps and forwards."""

    def __init__(
        self, version: ResidentVersion, copy: Copy, n_blocks: int, scheduler: BatchScheduler, compile: bool
    ):
        self.name, self.version = version.name, version.version
        self.tokenizer = version.tokenizer
        self.grammars = version.grammars
        self.device = version.device
        self.model = copy.model
        self._set = AdapterSet()  # what the forwards apply: open slots and closed ones still in use
        self._slots: list[str] = []  # the adapter slot (its version) of each entry of _set
        self._open: set[str] = set()  # slots new requests may go through
        self._adapters_lock = threading.Lock()  # a request never joins an adapter being unstacked
        self.cache = self.model.new_cache(n_blocks)  # the scratch block included
        if compile:  # every step writes the pool in place: at a fixed address, CUDA graphs replay over it
            for pool in (self.cache.k, self.cache.v):  # [L, slots, KVH, D]
                torch._dynamo.mark_static_address(pool)
                for dim in (0, 2, 3):  # the model's, never tied to a batch's sizes; slots vary by pool
                    torch._dynamo.mark_static(pool, dim)
        self.scheduler = scheduler  # plans the steps over the blocks of this cache
        self.banned = version.banned_tokens  # [K] ids
        # padded to the model's min_batch_rows, a forward gives every row the same bits in any
        # batch mix on the CPU (docs/batching.md). Compiled, a size of 1 gets a graph of its own
        # (torch.compile specialises 0 and 1): rows and blocks read are padded to 2, so the one
        # graph compiled at warm-up serves every batch (a compile of SmolLM2 took 50 s to 2 minutes
        # on an H200's host).
        self.min_rows = max(self.model.min_batch_rows, 2 if compile else 1)
        self.min_blocks = 2 if compile else 1
        # Never inductor `freezing`: it bakes weights in, and in-place weight loads go silently wrong.
        # Without it, inductor cannot lower bfloat16 weights packed for oneDNN: compiled, they are
        # multiplied unpacked (eager packed is faster on the CPU: docs/benchmarks.md).
        if compile:
            unpack_linears(self.model)  # type: ignore[arg-type]  # a CausalLM is an nn.Module
        self.decode_step: Callable[[Tensor, CacheView, AdapterRows | None], Tensor] = (
            torch.compile(self._decode_step, dynamic=True) if compile else self._decode_step
        )
        # One forward a step where the kernel attends over packed views, unpadded: a step's prompt
        # tokens join its decode rows as rows of their own, one pass over the weights instead of
        # two (16 decode rows and a 50-token prompt of SmolLM2 in bfloat16: 59 ms against 79 in
        # two forwards), with each row's bits the same either way (docs/batching.md).
        self.packs = not compile and self.min_rows == 1 and self.cache.reads_packed

    def _decode_step(self, tokens: Tensor, view: CacheView, adapters: AdapterRows | None) -> Tensor:
        return self.model(tokens, self.cache, view, adapters)[:, -1]  # [B, V]

    def open_slot(self, slot: str, adapter: Adapter) -> None:
        """Serves an adapter over these weights from the next step: its tensors are stacked beside
        the others', nothing is copied or recompiled. A slot stacked already (open, or closed with
        sequences still on it) is served again as it is: versions never change their files."""
        with self._adapters_lock:
            if slot not in self._slots:
                self._set.add(adapter)
                self._slots.append(slot)
            self._open.add(slot)

    def close_slot(self, slot: str) -> None:
        """Stops sending new requests through an adapter; its running ones finish on it."""
        with self._adapters_lock:
            self._open.discard(slot)

    def submit(self, request: Request) -> None:
        """Queues a request for these weights or one of the adapters served over them."""
        with self._adapters_lock:
            if request.adapter and request.adapter not in self._open:
                raise NotFound(f"adapter {self.name}/{request.adapter} was unloaded just now")
            self.scheduler.submit(request)

    def _prune_adapters(self) -> None:
        """Unstacks closed slots no request goes through any more (on the engine thread)."""
        with self._adapters_lock:
            for index in reversed(range(len(self._slots))):
                slot = self._slots[index]
                if slot not in self._open and not self.scheduler.uses_adapter(slot):
                    self._set.remove(index)
                    del self._slots[index]

    def _adapter_rows(self, requests: list[Request], rows: int) -> AdapterRows | None:
        """The adapters of a forward over `requests`, padded to `rows` rows of the base alone."""
        slots = [self._slots.index(r.adapter) if r.adapter else None for r in requests]
        return self._set.rows(slots + [None] * (rows - len(requests)))

    @torch.inference_mode()
    def warm_up(self, batch_sizes: tuple[int, ...]) -> None:
        """Runs the decode step at each batch size on the scratch block (compiles it when enabled)."""
        device = self.device
        for rows in batch_sizes:
            tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
            self.decode_step(
                tokens, self.cache.view([[]] * rows, [[-1]] * rows, device, self.min_blocks), None
            )

    @torch.inference_mode()
    def step(self, metrics: WorkerMetrics | None) -> list[Output]:
        """One engine step for this copy; a failure fails the sequences of the forward it hit."""
        if len(self._slots) > len(self._open):
            self._prune_adapters()
        plan = self.scheduler.schedule()
        if metrics is not None and plan.decode:
            metrics.batch_size.observe(len(plan.decode))
        outputs: list[Output] = []
        ready: list[tuple[Request, Tensor]] = []  # requests with logits for their next tokens: [n, V]
        # a forward that fails fails its sequences: in two, a prefill's leaves the decoding ones be
        forwards = [plan] if self.packs else [StepPlan(prefill=plan.prefill), StepPlan(decode=plan.decode)]
        for forward in forwards:
            if not forward:
                continue
            try:
                last, rows = self._packed(forward) if self.packs else self._padded(forward)
            except Exception as error:
                for request in [*(r for r, _, _ in forward.prefill), *forward.decode]:
                    self._fail(request, error, outputs)
                continue
            for (request, _, end), row in zip(forward.prefill, last, strict=True):
                self.scheduler.prefilled(request, end)
                if end < request.prompt_len:
                    continue
                if request.sequence.params.max_tokens:
                    ready.append((request, row[None]))
                else:  # the prompt only: no token to pick
                    self._end_unanswered(request, outputs)
            ready += zip(forward.decode, rows, strict=True)
        if not ready:
            return outputs
        logits = torch.cat([rows for _, rows in ready])  # [N, V]
        if len(self.banned):  # by index: a [V] mask over every row cost 0.5 ms at 16 rows of SmolLM2
            logits.index_fill_(1, self.banned, float("-inf"))
        bounds = list(itertools.accumulate((len(rows) for _, rows in ready), initial=0))
        spans = [
            (request, start, end)
            for (request, _), start, end in zip(ready, bounds[:-1], bounds[1:], strict=True)
        ]
        adjusted = []
        for request, start, end in spans:
            try:
                self._adjust(request, logits[start:end])
            except Exception as error:
                self._fail(request, error, outputs)
            else:
                adjusted.append((request, start, end))
        # by max, whose index is argmax's (the first of equal maxima) at a third of its time on the
        # CPU, in the logits' own dtype: the index they would have widened to float32 (exactly), in
        # 0.4-0.65 ms against 0.5-1.1 for 16 rows of SmolLM2's bfloat16 logits
        greedy = logits.max(dim=-1).indices.tolist()  # [N]
        drafted = accepted = 0
        for request, start, end in adjusted:
            try:
                delta, kept = self._advance(request, logits[start:end], greedy[start:end])
            except Exception as error:
                self._fail(request, error, outputs)
                continue
            drafted, accepted = drafted + len(request.draft), accepted + kept
            request.next_input = delta.token_ids[-1]
            outputs.append((request, delta))
            if delta.finish_reason is not None:
                self.scheduler.finish(request)
        if metrics is not None and drafted:
            metrics.observe_drafts(drafted, accepted)
        return outputs

    @staticmethod
    def _adjust(request: Request, logits: Tensor) -> None:
        """Applies a request's grammar, logit bias and penalties, in place, to its rows [n, V]."""
        sequence, params = request.sequence, request.sequence.params.sampling
        if request.constraint is not None:
            request.constraint.restrict(logits, sequence, request.draft)
        if params.logit_bias or params.penalizes:
            adjust(logits, params, sequence.prompt_ids, sequence.output_ids, request.draft)

    def _advance(self, request: Request, logits: Tensor, greedy: list[int]) -> tuple[Delta, int]:
        """Appends the tokens a request's rows give, [n, V]: row 0's token, then row i+1's while the
        token row i picked is the draft token row i+1 was fed (so each row's token is picked, and
        drawn from the request's generator, exactly as a step without drafts would). Returns what
        they add and how many drafted tokens were kept."""
        draft, delta = request.draft, Delta()
        if not request.sequence.output_ids:  # its first token: the prompt's log probabilities come first
            delta.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
        top = request.sequence.params.top_logprobs
        for i, row in enumerate(logits):  # draft[i] is what row i+1 was fed
            token = self._pick(request, row, greedy[i])
            if request.constraint is not None:
                request.constraint.accept(request.sequence, token)
            delta.merge(request.sequence.append(token))
            if top is not None:  # of the logits it was picked from, adjusted, before temperature
                delta.logprobs.append(token_logprob(torch.log_softmax(row.float(), dim=-1), token, top))
            if i == len(draft) or token != draft[i] or delta.finish_reason is not None:
                break
        return delta, i + 1 if i < len(draft) and token == draft[i] else i  # draft[:i] were kept

    def _padded(self, plan: StepPlan) -> tuple[list[Tensor], list[Tensor]]:
        """Runs a plan of prefill chunks or of decoding sequences in padded rows: the logits of each
        chunk's last token [V], and each sequence's rows [1 + draft, V]."""
        if plan.prefill:
            return list(self._prefill(plan.prefill)), []
        return [], list(self._decode(plan.decode).split([1 + len(r.draft) for r in plan.decode]))

    def _packed(self, plan: StepPlan) -> tuple[list[Tensor], list[Tensor]]:
        """Runs a whole step in one forward, every token a row of its own (a packed view): each
        decoding sequence's next input and draft tokens, then each prefill chunk's tokens, a
        sequence's side by side. The output head runs over the rows whose logits are used alone:
        a sequence's, a chunk's last (all of a chunk whose prompt's log probabilities are asked
        for). Gives what `_padded` gives."""
        decoding = len(plan.decode)
        requests = [*plan.decode, *(r for r, _, _ in plan.prefill)]
        spans: list[Sequence[tuple[int, int | None]]] = [  # each request's rows: (position, token)
            *(list(enumerate([r.next_input, *r.draft], r.sequence.total_len - 1)) for r in plan.decode),
            *(list(enumerate(r.sequence.prompt_ids[s:e], s)) for r, s, e in plan.prefill),
        ]
        bounds = list(itertools.accumulate(map(len, spans), initial=0))
        used = [
            range(end - 1 if i >= decoding and not r.sequence.params.prompt_logprobs else first, end)
            for i, (r, first, end) in enumerate(zip(requests, bounds[:-1], bounds[1:], strict=True))
        ]
        device = self.device
        view = self.cache.packed_view(
            [r.blocks for r in requests], [[position for position, _ in span] for span in spans], device
        )
        tokens = torch.tensor([[token] for span in spans for _, token in span], device=device)  # [N, 1]
        owners = [r for r, span in zip(requests, spans, strict=True) for _ in span]
        at = torch.tensor([row for rows in used for row in rows], device=device)
        logits = self.model(tokens, self.cache, view, self._adapter_rows(owners, len(owners)), at=at)
        logits = logits.split([len(rows) for rows in used])
        last = []
        for (request, start, _), rows in zip(plan.prefill, logits[decoding:], strict=True):
            if request.sequence.params.prompt_logprobs:
                request.prompt_logprobs += prompt_logprobs(request, start, rows)
            last.append(rows[-1])
        return last, list(logits[:decoding])

    def _prefill(self, chunks: list[tuple[Request, int, int]]) -> Tensor:
        """Runs every chunk prompt[start:end] in one forward, rows padded to a common length:
        the logits of each chunk's last token, [N, V]."""
        device = self.device
        width = max(max(end - start for _, start, end in chunks), -(-self.min_rows // len(chunks)))
        tokens = [[*r.sequence.prompt_ids[s:e], *[0] * (width - e + s)] for r, s, e in chunks]
        positions = [[*range(s, e), *[-1] * (width - e + s)] for _, s, e in chunks]
        view = self.cache.view([r.blocks for r, _, _ in chunks], positions, device)
        adapters = self._adapter_rows([r for r, _, _ in chunks], len(chunks))
        last = torch.tensor([row * width + e - s - 1 for row, (_, s, e) in enumerate(chunks)], device=device)
        input_ids = torch.tensor(tokens, device=device)
        wants_prompt = any(r.sequence.params.prompt_logprobs for r, _, _ in chunks)
        if len(chunks) >= self.min_rows and not wants_prompt:  # the head over as many rows as a forward
            return self.model(input_ids, self.cache, view, adapters, at=last)  # the last tokens'
        logits = self.model(input_ids, self.cache, view, adapters)  # [N, T, V]
        for row, (request, start, end) in enumerate(chunks):
            if request.sequence.params.prompt_logprobs:
                request.prompt_logprobs += prompt_logprobs(request, start, logits[row, : end - start])
        return logits.flatten(0, 1)[last]

    def _decode(self, requests: list[Request]) -> Tensor:
        """Feeds each request's last token at its own position, then its draft's tokens at the
        positions after it, a row each, in one batch: logits [sum of 1 + draft, V]. A draft row reads
        the keys the rows before it write in the same forward, just as it would a step later."""
        rows = [
            (r, r.sequence.total_len - 1 + i, token)
            for r in requests
            for i, token in enumerate([r.next_input, *r.draft])
        ]
        pad = max(len(rows), self.min_rows) - len(rows)
        tokens = [token for _, _, token in rows] + [0] * pad
        positions = [[position] for _, position, _ in rows] + [[-1]] * pad
        device = self.device
        tables = [r.blocks for r, _, _ in rows] + [[]] * pad
        view = self.cache.view(tables, positions, device, self.min_blocks)
        adapters = self._adapter_rows([r for r, _, _ in rows], len(rows) + pad)
        logits = self.decode_step(torch.tensor(tokens, device=device)[:, None], view, adapters)  # [B, V]
        return logits[: len(rows)]

    @staticmethod
    def _pick(request: Request, logits: Tensor, greedy: int) -> int:
        forced = request.sequence.forced_token()
        if forced is not None:
            return forced
        params = request.sequence.params.sampling
        return greedy if params.temperature <= 0 else sample(logits, params, request.generator)

    def _end_unanswered(self, request: Request, outputs: list[Output]) -> None:
        delta = request.sequence.end_unanswered()
        delta.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
        self.scheduler.finish(request)
        outputs.append((request, delta))

    def _fail(self, request: Request, error: Exception, outputs: list[Output]) -> None:
        logger.exception("sequence failed in model=%s version=%s", self.name, self.version)
        self.scheduler.finish(request)
        outputs.append((request, error))


def prompt_logprobs(request: Request, start: int, logits: Tensor) -> list[TokenLogprob]:
    """The log probabilities of the prompt tokens a prefill chunk's logits [T, V] predict (those after
    `start` up to the next chunk's first), from the logits as they are; the prompt's first token
    first, at NaN: nothing predicts it."""
    prompt = request.sequence.prompt_ids
    top = request.sequence.params.top_logprobs or 0
    entries = [TokenLogprob(prompt[0], math.nan, ())] if start == 0 else []
    rows = torch.log_softmax(logits.float(), dim=-1)
    for offset, position in enumerate(range(start, min(start + len(logits), len(prompt) - 1))):
        entries.append(token_logprob(rows[offset], prompt[position + 1], top))
    return entries
