"""A Hugging Face tokenizer (`tokenizer.json` and its companion files) behind reflow's `Tokenizer` seam.

Ids, text and chat prompts are what transformers gives for the same files, with only the `tokenizers` library
(and jinja2, for the chat template) at runtime.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from workers.models.chat_template import ChatTemplate

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 writes the template
GENERATION_FILE = "generation_config.json"
TOKENIZER_FILES = (TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE, GENERATION_FILE)

# The named special tokens (transformers' SPECIAL_TOKENS_ATTRIBUTES), which a chat template sees by name
SPECIAL_TOKEN_NAMES = tuple(f"{kind}_token" for kind in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"))
ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the special tokens, end ids and chat template its config files name."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        """The tokenizer `files` hold (name -> content, as `TOKENIZER_FILES` names them; `tokenizer.json` at
        least); ValueError when they name no end-of-sequence token."""
        self._files = dict(files)
        config = json.loads(files.get(CONFIG_FILE, b"{}"))
        generation = json.loads(files.get(GENERATION_FILE, b"{}"))
        self._tokenizer = Tokenizer.from_str(files[TOKENIZER_FILE].decode())
        self._tokenizer.no_truncation()  # as transformers' __call__ without truncation or padding
        self._tokenizer.no_padding()
        self._special_tokens = {
            name: _content(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None
        }
        self._add_missing_tokens(config)
        added = self._tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        self._size = max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        eos = generation.get("eos_token_id")
        self._eos_ids = _as_ids(self._named_id("eos_token") if eos is None else eos)
        if not self._eos_ids:
            raise ValueError("the tokenizer's files name no end-of-sequence token")
        pad = self._named_id("pad_token")
        pad = generation.get("pad_token_id") if pad is None else pad
        self._pad_id: int = self._eos_ids[0] if pad is None else pad
        think, end_think = self._tokenizer.token_to_id("<think>"), self._tokenizer.token_to_id("</think>")
        self._markers = None if think is None or end_think is None else (think, end_think)
        template = _template_source(files, config)
        self._template = None if template is None else ChatTemplate(template, self._special_tokens)

    @classmethod
    def from_directory(cls, directory: Path) -> HFTokenizer:
        """The tokenizer whose files (`TOKENIZER_FILES`, `tokenizer.json` at least) are in `directory`."""
        paths = (directory / name for name in TOKENIZER_FILES)
        present = [path for path in paths if path.is_file() or path.name == TOKENIZER_FILE]  # which is a must
        return cls({path.name: path.read_bytes() for path in present})

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """`generation_config.json`'s `eos_token_id`s in order, else the config's `eos_token`."""
        return self._eos_ids

    @property
    def pad_id(self) -> int:
        """The pad token, else `generation_config.json`'s `pad_token_id`, else the first end id."""
        return self._pad_id

    @property
    def reasoning_markers(self) -> tuple[int, int] | None:
        """`<think>` and `</think>` when the vocabulary has both."""
        return self._markers

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """transformers' `tokenizer(text, add_special_tokens=bos)["input_ids"]`: the post-processor's ids (a
        beginning of sequence, when it adds one) around those of `text` unless `bos` is False."""
        return self._tokenizer.encode(text, add_special_tokens=bos).ids

    def decode(self, ids: Sequence[int]) -> str:
        """transformers' `decode(ids, skip_special_tokens=True)` (its clean-up of spaces, off by default and
        skipped for BPE models, is not done)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def decoder(self) -> HFDecoder:
        """A fresh decoder for one stream of generated ids."""
        return HFDecoder(self._tokenizer, self._special_ids)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """transformers' `apply_chat_template(messages, tools=tools, tokenize=False,
        add_generation_prompt=True)`, to be encoded with `bos=False`; ValueError without a template or
        when the template refuses `messages`."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a prompt instead of messages")
        return self._template.render(messages, tools)

    @property
    def chat_template(self) -> str | None:
        """The chat template's source; None without one."""
        return None if self._template is None else self._template.source

    def is_special(self, token_id: int) -> bool:
        """True for the added tokens flagged special: those decoding leaves out."""
        return token_id in self._special_ids

    def never_generated(self, vocab_size: int) -> list[int]:
        """The ids past the vocabulary (added tokens included) up to `vocab_size`, and only those: many chat
        models pad with their end id, and the pad and beginning ids stay allowed so that greedy answers are
        transformers' unconstrained greedy ones."""
        return list(range(self._size, vocab_size))

    def to_json(self) -> str:
        """`tokenizer.json` as the tokenizers library holds it, the tokens the config adds included."""
        return self._tokenizer.to_str()

    def save(self, directory: Path) -> None:
        """Writes back the files it was read from, as they were."""
        for name, content in self._files.items():
            (directory / name).write_bytes(content)

    def _named_id(self, name: str) -> int | None:
        content = self._special_tokens.get(name)
        return None if content is None else self._tokenizer.token_to_id(content)

    def _add_missing_tokens(self, config: dict[str, Any]) -> None:
        """Adds what the config names but `tokenizer.json` lacks, as transformers' TokenizersBackend does: the
        `added_tokens_decoder` entries (in id order), then the named special tokens."""
        decoder = sorted(config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0]))
        named = (config[name] for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None)
        specs = [spec for _, spec in decoder]
        specs += [
            {**({"content": spec} if isinstance(spec, str) else spec), "special": True} for spec in named
        ]
        present = {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}
        missing = []
        for spec in specs:
            if spec["content"] not in present:
                present.add(spec["content"])
                flags = {flag: spec[flag] for flag in ADDED_TOKEN_FLAGS if flag in spec}
                missing.append(AddedToken(spec["content"], **flags))
        self._tokenizer.add_tokens(missing)


class HFDecoder:
    """vLLM's incremental detokenization: each push decodes a short window of ids, with and without the new
    ones, and releases the difference unless it ends in an incomplete character (U+FFFD). The window starts
    at the ids of the text released last, so that decoders that look at neighbours (SentencePiece's leading
    space, byte fallback, byte-level pieces) see them; the cost per id is bounded.

    The text released is the whole decode, but where bytes do not make whole characters (a stream cut inside
    one, a model emitting stray bytes): byte fallback then turns the whole run of byte tokens into U+FFFDs,
    characters the stream has released already included; the stream keeps those and replaces only the
    incomplete bytes."""

    def __init__(self, tokenizer: Tokenizer, special_ids: frozenset[int]) -> None:
        """A decoder of the ids of `tokenizer`; `special_ids` decode to nothing."""
        self._tokenizer = tokenizer
        self._special_ids = special_ids
        self._window: list[int] = []  # the ids of the text released last, then the ids not yet released
        self._released = 0  # how many of the window's ids are the released ones

    def push(self, token_id: int) -> str:
        """The text `token_id` completes; empty while a character is incomplete."""
        if token_id in self._special_ids:
            return ""
        self._window.append(token_id)
        text = self._new_text()
        if not text or text.endswith("\ufffd"):
            return ""
        self._advance()
        return text

    def flush(self) -> str:
        """Whatever is held back, an incomplete character as U+FFFD."""
        text = self._new_text()
        self._advance()
        return text

    def _new_text(self) -> str:
        released = self._tokenizer.decode(self._window[: self._released])
        text = self._tokenizer.decode(self._window)
        if text.startswith(released):
            return text[len(released) :]
        return self._tokenizer.decode(self._window[self._released :])  # see the class's docstring

    def _advance(self) -> None:
        del self._window[: self._released]
        self._released = len(self._window)


def _content(spec: str | dict[str, Any]) -> str:
    """The text of a special token the config gives as a string or as an AddedToken's fields."""
    return spec if isinstance(spec, str) else str(spec["content"])


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else () if value is None else (value,)


def _template_source(files: Mapping[str, bytes], config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` (read with universal newlines, as transformers opens it), else the config's
    `chat_template`: a string or a list of named templates, of which the "default" one."""
    if TEMPLATE_FILE in files:
        return io.TextIOWrapper(io.BytesIO(files[TEMPLATE_FILE]), encoding="utf-8").read()
    template = config.get("chat_template")
    if isinstance(template, list):
        return next((entry["template"] for entry in template if entry["name"] == "default"), None)
    return template
