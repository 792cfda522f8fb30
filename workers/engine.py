"""Runs generations of the loaded versions: one decode step at a time on a dedicated torch thread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from reflow.errors import InvalidArgument, NotFound
from workers.loading import LoadedModel
from workers.sampling import make_generator, sample
from workers.sequence import Delta, GenerationParams, Sequence

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Decoder:
    """One sequence's decode loop on one model: prefill once, then one token per step."""

    def __init__(self, loaded: LoadedModel, sequence: Sequence):
        self.model = loaded.model
        self.sequence = sequence
        self.generator = make_generator(sequence.params.sampling)
        self.cache = self.model.new_cache(1)
        self.slots = torch.zeros(1, dtype=torch.long, device=loaded.device)  # [B=1]
        self.device = loaded.device
        self.banned = loaded.banned_tokens  # [V] bool: ids the model must never emit
        self.logits: torch.Tensor | None = None  # [V] for the next token

    @torch.inference_mode()
    def step(self) -> Delta:
        """Prefills on the first call; then picks one token, records it and runs it through."""
        seq = self.sequence
        if self.logits is None:
            self.logits = self._forward(seq.prompt_ids, 0)
        forced = seq.forced_token()
        token = forced if forced is not None else sample(self.logits, seq.params.sampling, self.generator)
        delta = seq.append(token)
        if seq.finish_reason is None:
            self.logits = self._forward([token], seq.total_len - 1)
        return delta

    def _forward(self, token_ids: list[int], start: int) -> torch.Tensor:
        tokens = torch.tensor([token_ids], device=self.device)  # [1, T]
        positions = torch.arange(start, start + len(token_ids), device=self.device)[None]  # [1, T]
        logits = self.model(tokens, positions, self.cache, self.slots)[0, -1]  # [V]
        return logits.masked_fill(self.banned, float("-inf"))


class Engine:
    """Holds loaded versions and runs their generations; torch work never blocks the event loop."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self._models: dict[tuple[str, str], LoadedModel] = {}
        self.running = 0
        self.waiting = 0

    def add(self, loaded: LoadedModel) -> None:
        """Makes a version servable (replacing the same version if it was loaded)."""
        self._models[(loaded.name, loaded.version)] = loaded

    def remove(self, name: str, version: str) -> bool:
        """Stops serving a version; its running sequences finish on the weights they hold."""
        return self._models.pop((name, version), None) is not None

    def loaded(self) -> list[LoadedModel]:
        """Every servable version."""
        return list(self._models.values())

    def find(self, name: str, version: str) -> LoadedModel | None:
        """The loaded version, or None."""
        return self._models.get((name, version))

    def get(self, name: str, version: str) -> LoadedModel:
        """The loaded version; NotFound names what is loaded instead."""
        loaded = self.find(name, version)
        if loaded is None:
            have = ", ".join(f"{n}/{v}" for n, v in self._models) or "nothing"
            raise NotFound(f"{name}/{version} is not loaded on this worker (loaded: {have})")
        return loaded

    async def run(self, fn: Callable[[], T]) -> T:
        """Runs torch work on the engine's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def generate(
        self, name: str, version: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[Delta]:
        """Streams the deltas of one completion; closing the iterator stops it at the next step."""
        loaded = self.get(name, version)
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty")
        if len(prompt_ids) >= loaded.max_len:
            raise InvalidArgument(
                f"the prompt is {len(prompt_ids)} tokens; model {name}/{version} takes at most "
                f"{loaded.max_len - 1}"
            )
        sequence = Sequence(prompt_ids, params, loaded.tokenizer, loaded.max_len)
        decoder = Decoder(loaded, sequence)
        self.waiting += 1
        started = False
        try:
            while sequence.finish_reason is None:
                delta = await self.run(decoder.step)
                if not started:
                    started = True
                    self.waiting -= 1
                    self.running += 1
                yield delta
        finally:
            if started:
                self.running -= 1
            else:
                self.waiting -= 1

    def close(self) -> None:
        """Stops the torch thread once queued work is done."""
        self._executor.shutdown(wait=True, cancel_futures=True)
