"""The seams between the runtime and a model: `CausalLM` and `Tokenizer`.

The engine, the decoding state of a sequence and the fine-tune job see a model only through these
protocols; each implementation (the decoder of llama.py, of which the built-in model is a preset;
the byte tokenizer, ...) lives beside this module, and `loader.load_checkpoint` picks the one a
checkpoint's files name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from workers.models.kv_cache import CacheView, PagedKVCache
from workers.models.lora import Adapter, AdapterRows


class CausalLM(Protocol):
    """A decoder-only language model: a batched forward over tokens and a paged KV cache."""

    @property
    def model_type(self) -> str:
        """Its architecture, as its `config.json` names it (`reflow`: the built-in model)."""
        ...

    @property
    def adapter(self) -> Adapter | None:
        """The LoRA adapter it is seen through (`adapted`); None for a model's own weights."""
        ...

    @property
    def vocab_size(self) -> int:
        """Columns of the logits (ids past the tokenizer's vocabulary included)."""
        ...

    @property
    def max_seq_len(self) -> int:
        """Longest prompt plus completion the model attends over, in tokens."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its weights and of the caches it makes."""
        ...

    @property
    def device(self) -> torch.device:
        """Where its weights are."""
        ...

    @property
    def min_batch_rows(self) -> int:
        """Rows the engine pads each forward to, so that a sequence's logits are bit-identical
        alone and in any batch on the CPU; 1 where padding buys nothing."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one held token takes, over all layers."""
        ...

    def __call__(
        self,
        tokens: Tensor,
        cache: PagedKVCache | None = None,
        view: CacheView | None = None,
        adapters: AdapterRows | None = None,
        at: Tensor | None = None,
    ) -> Tensor:
        """Logits [B, T, V] of tokens [B, T]: a causal pass over whole rows without a cache (training),
        else the tokens placed in the cache's blocks where `view` says; each row through its LoRA
        adapter where `adapters` gives it one (ValueError for an adapted model: its own only). With
        `at` ([N] indices of tokens among the B*T, row by row), only those tokens' logits, [N, V]: a
        prefill wants its last token's alone, and the output head is the widest product of a
        forward."""
        ...

    def adapted(self, adapter: Adapter) -> CausalLM:
        """Its weights, frozen and shared, seen through `adapter` in place of any it has: a model
        whose parameters and saved files are the adapter's alone."""
        ...

    def new_cache(self, n_blocks: int) -> PagedKVCache:
        """An empty pool of `n_blocks` KV blocks on its device, in its dtype."""
        ...

    def parameter_count(self) -> int:
        """Number of weights it trains (an adapted model's: its adapter's)."""
        ...

    def save(self, directory: Path) -> None:
        """Writes its weights (safetensors, never a pickle) and `config.json` into `directory`; an
        adapted model its adapter, in PEFT's format."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Its weights, for an optimizer (an adapted model's: its adapter's tensors)."""
        ...

    def train(self, mode: bool = True) -> CausalLM:
        """Training mode (torch.nn.Module's)."""
        ...

    def eval(self) -> CausalLM:
        """Inference mode (torch.nn.Module's)."""
        ...


class IncrementalDecoder(Protocol):
    """Text of one stream of generated ids, released as soon as it is whole."""

    def push(self, token_id: int) -> str:
        """The text `token_id` completes; empty while a UTF-8 character is still incomplete."""
        ...

    def flush(self) -> str:
        """Whatever is held back, an incomplete character replaced by U+FFFD."""
        ...


class Tokenizer(Protocol):
    """Text to token ids and back, for one model."""

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end a sequence; the first is the one a training example ends with."""
        ...

    @property
    def reasoning_markers(self) -> tuple[int, int] | None:
        """The ids that open and close a thought (`<think>`, `</think>`), when the model has them."""
        ...

    @property
    def pad_id(self) -> int:
        """An id to fill batch rows with; it is never attended to nor learned."""
        ...

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """Ids of `text`, after the beginning-of-sequence id the model expects unless `bos` is False."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens left out."""
        ...

    def decoder(self) -> IncrementalDecoder:
        """A fresh decoder for one stream of generated ids."""
        ...

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """The prompt text of a conversation (`role`, `content` per message, and OpenAI's `tool_calls`
        and `tool_call_id` where a turn has them) as the model's chat template renders it with
        `tools` (OpenAI's function entries), ready for the assistant's turn; ValueError when it has
        no template."""
        ...

    @property
    def chat_template(self) -> str | None:
        """The chat template's source; None without one."""
        ...

    def is_special(self, token_id: int) -> bool:
        """True for ids that stand for no text (markers, padding, beginning and end of sequence)."""
        ...

    def never_generated(self, vocab_size: int) -> list[int]:
        """Ids a model with `vocab_size` logits must never emit: at least those past this vocabulary
        (the byte tokenizer also bans padding and beginning of sequence; a Hugging Face tokenizer
        bans nothing more, since chat models often pad with their end id)."""
        ...

    def save(self, directory: Path) -> None:
        """Writes the tokenizer's files into `directory`, as a version carries them."""
        ...
