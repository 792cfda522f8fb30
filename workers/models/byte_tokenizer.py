"""The built-in model's tokenizer: UTF-8 bytes are tokens 0-255, special tokens follow."""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"

# Special tokens, in id order after the 256 byte tokens.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<think>", "</think>")
SPECIAL_IDS = {token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)}  # as tokenizer.json records them


@dataclass(frozen=True)
class ByteTokenizer:
    """Maps text to UTF-8 byte ids and back; specials never appear in decoded text."""

    pad_id: int = 256
    bos_id: int = 257
    eos_id: int = 258
    think_id: int = 259
    end_think_id: int = 260

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """`<eos>`."""
        return (self.eos_id,)

    @property
    def reasoning_markers(self) -> tuple[int, int]:
        """`<think>` and `</think>`."""
        return self.think_id, self.end_think_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids in use (bytes plus specials)."""
        return 256 + len(SPECIAL_TOKENS)

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """Token ids of `text`, prefixed with <bos> unless `bos` is False."""
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the byte tokens in `ids`; special tokens are dropped."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def decoder(self) -> ByteDecoder:
        """A fresh decoder for one stream of generated ids."""
        return ByteDecoder()

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """Never: the byte-level model has no chat template."""
        raise ValueError("this model has no chat template; send a prompt instead of messages")

    @property
    def chat_template(self) -> None:
        """None: the byte-level model has no chat template."""
        return None

    def is_special(self, token_id: int) -> bool:
        """True for <pad>, <bos>, <eos>, <think> and </think>."""
        return token_id >= 256

    def never_generated(self, model_vocab_size: int) -> list[int]:
        """Ids a model must never emit: <pad>, <bos> and the padding past this vocabulary."""
        return [self.pad_id, self.bos_id, *range(self.vocab_size, model_vocab_size)]

    def save(self, directory: Path) -> None:
        """Writes `tokenizer.json` so a version's artifacts describe their tokenizer."""
        spec = {"type": "byte", "special_tokens": SPECIAL_IDS}
        (directory / TOKENIZER_FILE).write_text(json.dumps(spec, indent=2) + "\n")

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> ByteTokenizer:
        """The tokenizer `tokenizer.json` (read into `spec`) describes; refuses other special ids."""
        if spec.get("type") != "byte" or spec.get("special_tokens") != SPECIAL_IDS:
            raise ValueError(f"unsupported byte tokenizer: {spec}")
        return cls()


class ByteDecoder:
    """Turns a stream of byte tokens into text, holding back incomplete UTF-8 sequences."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by `token_id` (empty while a character is incomplete)."""
        return self._decoder.decode(bytes([token_id])) if token_id < 256 else ""

    def flush(self) -> str:
        """Whatever is left, with incomplete sequences replaced by U+FFFD."""
        return self._decoder.decode(b"", final=True)
