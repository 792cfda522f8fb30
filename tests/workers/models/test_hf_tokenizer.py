"""HFTokenizer gives transformers' ids, text and chat prompts for the same files: SmolLM2's real byte-level
BPE (from its GGUF file) and a SentencePiece-style BPE with byte fallback built here, both saved by
transformers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from workers.models.hf_tokenizer import HFTokenizer

TEXTS = {
    "english": "Hello, world! How are you today? It's 3:45pm.",
    "french": "Le cœur a ses raisons que la raison ne connaît point. Ça va très bien, à bientôt !",
    "german": "Größenwahn: Fußgängerübergänge sind schön, Öl und Äpfel.",
    "russian": "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "chinese": "我们今天去公园散步吧，天气很好。",  # noqa: RUF001 (full-width punctuation, as written)
    "japanese": "日本語のテキスト：ひらがな、カタカナ、漢字。",  # noqa: RUF001
    "arabic": "مرحبا بالعالم، كيف حالك اليوم؟",
    "hindi": "नमस्ते दुनिया, आप कैसे हैं?",
    "emoji": "Emoji 😀🎉👍🏽, a family 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵 and 🏳️‍🌈.",
    "code": "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint({'a': [1, 2, 3]})\n",
    "whitespace": "  leading,\ttabs\t\tand   runs     of spaces  \n\n\n trailing   ",
    "empty": "",
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Where is the Eiffel tower?"},
        {"role": "assistant", "content": "À Paris, bien sûr."},
        {"role": "user", "content": "Et 東京タワー ? 🗼"},
    ],
]
SENTENCES = [  # what the SentencePiece-style tokenizer learns from: no CJK, no emoji
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you today? it's a fine day",
    "le cœur a ses raisons que la raison ne connaît point",
    "def f(x): return x * 2",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_by_transformers: Path) -> tuple[HFTokenizer, PreTrainedTokenizerBase, Path]:
    """Ours and transformers' tokenizer of the files transformers writes for SmolLM2's GGUF file."""
    directory = smollm2_by_transformers
    return HFTokenizer.from_directory(directory), AutoTokenizer.from_pretrained(directory), directory


@pytest.fixture(scope="module")
def sentencepiece(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[HFTokenizer, PreTrainedTokenizerBase, Path]:
    """A Llama-2-like BPE: `▁` for spaces, `<0x..>` tokens for unseen bytes, `<s>` added before each text."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()  # pieces learnt within words, as SentencePiece learns
    trained.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    learned = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{byte:02X}>": 3 + byte for byte in range(256)}
    for piece in learned["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(merge) for merge in learned["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    directory = tmp_path_factory.mktemp("sentencepiece")
    wrapped.save_pretrained(directory)
    return HFTokenizer.from_directory(directory), AutoTokenizer.from_pretrained(directory), directory


@pytest.fixture(scope="module")
def as_llama(sentencepiece: tuple[HFTokenizer, PreTrainedTokenizerBase, Path]) -> PreTrainedTokenizerBase:
    """transformers' LlamaTokenizer of the SentencePiece-style files: it builds its pre-tokenizer and decoder
    in code, keeping only the vocabulary, merges and post-processor of `tokenizer.json`."""
    return LlamaTokenizer.from_pretrained(sentencepiece[2])


@pytest.fixture(params=["smollm2", "sentencepiece", "as_llama"])
def pair(request: pytest.FixtureRequest) -> tuple[HFTokenizer, PreTrainedTokenizerBase]:
    """Ours and transformers' tokenizer of the same files."""
    if request.param == "as_llama":
        return request.getfixturevalue("sentencepiece")[0], request.getfixturevalue("as_llama")
    ours, theirs, _ = request.getfixturevalue(request.param)
    return ours, theirs


def streamed(tokenizer: HFTokenizer, ids: Sequence[int]) -> list[str]:
    """What the incremental decoder releases for `ids`, push by push, then the flush."""
    decoder = tokenizer.decoder()
    return [decoder.push(token_id) for token_id in ids] + [decoder.flush()]


@pytest.mark.parametrize("name", TEXTS)
def test_ids_and_text_are_transformers(pair: tuple[HFTokenizer, PreTrainedTokenizerBase], name: str) -> None:
    ours, theirs = pair
    text = TEXTS[name]
    for bos in (True, False):
        assert ours.encode(text, bos=bos) == theirs(text, add_special_tokens=bos)["input_ids"]
    ids = [*ours.encode(text), *ours.eos_ids]
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", TEXTS)
def test_streamed_text_is_the_whole_decode_in_whole_characters(
    pair: tuple[HFTokenizer, PreTrainedTokenizerBase], name: str
) -> None:
    ours, _ = pair
    ids = ours.encode(TEXTS[name])
    pieces = streamed(ours, ids)
    assert "".join(pieces) == ours.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_long_stream_of_every_text_decodes_piece_by_piece(
    pair: tuple[HFTokenizer, PreTrainedTokenizerBase],
) -> None:
    ours, theirs = pair
    ids = [token_id for text in TEXTS.values() for token_id in (*ours.encode(text), *ours.eos_ids)]
    pieces = streamed(ours, ids)
    assert "".join(pieces) == ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in piece for piece in pieces)


def test_an_incomplete_character_is_held_back_and_flushed_as_a_replacement(
    sentencepiece: tuple[HFTokenizer, PreTrainedTokenizerBase, Path],
) -> None:
    ours, theirs, _ = sentencepiece
    ids = ours.encode("the fox 😀", bos=False)
    assert theirs.convert_ids_to_tokens(ids) == ["▁the", "▁fox", "▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    decoder = ours.decoder()
    assert [decoder.push(token_id) for token_id in ids] == ["the", " fox", " ", "", "", "", "😀"]
    assert [decoder.push(token_id) for token_id in ids[3:6]] == ["", "", ""]  # the emoji again, cut short
    assert decoder.flush() == "\ufffd\ufffd\ufffd" == ours.decode(ids[3:6])
    # a whole decode replaces the run of byte tokens, the emoji released already included
    assert ours.decode(ids + ids[3:6]) == theirs.decode(ids + ids[3:6]) == "the fox " + "\ufffd" * 7


def test_byte_fallback_spells_what_the_vocabulary_lacks(
    sentencepiece: tuple[HFTokenizer, PreTrainedTokenizerBase, Path],
) -> None:
    ours, theirs, _ = sentencepiece
    for name in ("chinese", "japanese", "emoji", "hindi"):
        tokens = theirs.convert_ids_to_tokens(ours.encode(TEXTS[name], bos=False))
        assert sum(token.startswith("<0x") for token in tokens) > len(TEXTS[name])


def test_special_tokens_produce_no_text(pair: tuple[HFTokenizer, PreTrainedTokenizerBase]) -> None:
    ours, theirs = pair
    specials = sorted(theirs.all_special_ids)
    assert specials and all(ours.is_special(token_id) for token_id in specials)
    ids = [token_id for text in TEXTS.values() for token_id in (*specials, *ours.encode(text, bos=False))]
    text = ours.decode(ids)
    assert "".join(streamed(ours, ids)) == text == theirs.decode(ids, skip_special_tokens=True)
    assert not any(token in text for token in theirs.all_special_tokens)
    assert not any(ours.is_special(token_id) for token_id in ours.encode(TEXTS["english"], bos=False))


def test_smollm2_ends_and_pads_with_im_end_and_adds_no_bos(
    smollm2: tuple[HFTokenizer, PreTrainedTokenizerBase, Path],
) -> None:
    ours, theirs, _ = smollm2
    assert ours.eos_ids == (theirs.eos_token_id,) == (theirs.convert_tokens_to_ids("<|im_end|>"),)
    assert ours.pad_id == theirs.pad_token_id == ours.eos_ids[0]
    assert ours.encode("hi") == ours.encode("hi", bos=False)
    assert ours.reasoning_markers is None


def test_the_sentencepiece_tokenizer_begins_with_its_bos(
    sentencepiece: tuple[HFTokenizer, PreTrainedTokenizerBase, Path],
) -> None:
    ours, theirs, _ = sentencepiece
    assert ours.encode("hello")[0] == theirs.bos_token_id == 1
    assert ours.encode("hello")[1:] == ours.encode("hello", bos=False)
    assert (ours.eos_ids, ours.pad_id) == ((2,), 2)  # no pad token: the end id


def test_generation_config_names_the_end_ids_in_order(
    smollm2: tuple[HFTokenizer, PreTrainedTokenizerBase, Path], tmp_path: Path
) -> None:
    _, _, directory = smollm2
    shutil.copytree(directory, tmp_path, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2], "bos_token_id": 1}))
    tokenizer = HFTokenizer.from_directory(tmp_path)
    assert (tokenizer.eos_ids, tokenizer.pad_id) == ((0, 2), 2)  # pad_token <|im_end|>, as the config says


def test_only_ids_past_the_vocabulary_are_never_generated(
    smollm2: tuple[HFTokenizer, PreTrainedTokenizerBase, Path],
) -> None:
    ours, theirs, _ = smollm2
    assert len(theirs) == 49152
    assert ours.never_generated(49152) == []
    assert ours.never_generated(49152 + 64) == list(range(49152, 49152 + 64))  # not pad (= eos) nor bos


def test_think_markers_are_found_when_the_vocabulary_has_them(
    sentencepiece: tuple[HFTokenizer, PreTrainedTokenizerBase, Path], tmp_path: Path
) -> None:
    _, theirs, directory = sentencepiece
    thinking = AutoTokenizer.from_pretrained(directory)
    thinking.add_tokens(["<think>", "</think>"])  # as Qwen3 has them: added, not special
    thinking.save_pretrained(tmp_path)
    ours = HFTokenizer.from_directory(tmp_path)
    ids = thinking("<think>hmm</think>fox")["input_ids"]
    assert ours.reasoning_markers == (len(theirs), len(theirs) + 1)
    assert ours.reasoning_markers == (
        thinking.convert_tokens_to_ids("<think>"),
        thinking.convert_tokens_to_ids("</think>"),
    )
    assert ours.encode("<think>hmm</think>fox") == ids
    assert ours.decode(ids) == thinking.decode(ids, skip_special_tokens=True) == "".join(streamed(ours, ids))


def test_tokens_the_config_names_but_tokenizer_json_lacks_are_added_as_transformers_adds_them(
    smollm2: tuple[HFTokenizer, PreTrainedTokenizerBase, Path], tmp_path: Path
) -> None:
    _, _, directory = smollm2
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    token = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False, "special": True}
    config["added_tokens_decoder"] = {"49152": {"content": "<tool>", **token}}
    config["pad_token"] = {"content": "<pad>", **token, "__type": "AddedToken"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = HFTokenizer.from_directory(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    text = "a<tool>b<pad>c"
    assert ours.encode(text) == theirs(text)["input_ids"] == [81, 49152, 82, 49153, 83]
    assert ours.decode(ours.encode(text)) == theirs.decode(
        theirs(text)["input_ids"], skip_special_tokens=True
    )
    assert ours.pad_id == theirs.pad_token_id == 49153
    assert ours.never_generated(49160) == list(range(49154, 49160))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_chat_prompts_are_transformers(
    smollm2: tuple[HFTokenizer, PreTrainedTokenizerBase, Path], messages: list[dict[str, str]]
) -> None:
    ours, theirs, _ = smollm2
    prompt = ours.render_chat(messages)
    assert prompt == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ours.encode(prompt, bos=False) == expected


def test_saving_writes_back_the_files_read(
    smollm2: tuple[HFTokenizer, PreTrainedTokenizerBase, Path], tmp_path: Path
) -> None:
    ours, _, directory = smollm2
    ours.save(tmp_path)
    written = sorted(path.name for path in tmp_path.iterdir())
    assert written == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert all((tmp_path / name).read_bytes() == (directory / name).read_bytes() for name in written)
