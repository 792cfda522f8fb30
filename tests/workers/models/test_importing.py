"""What an import reads of a checkpoint directory: its own files only. A link out of it (a chat
template pointing at a private key) and a shard named with a path are refused; a Hugging Face cache
snapshot, whose files link into its repository's blobs, still imports; a broken config.json,
safetensors or GGUF file is refused by name."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.support.hf import COMMON
from workers.models.importing import source_files, total_bytes
from workers.models.llama import weight_files
from workers.models.loader import check_checkpoint

SECRET = "-----BEGIN PRIVATE KEY-----\nnot for any prompt\n-----END PRIVATE KEY-----\n"


def checkpoint(directory: Path, **files: str) -> Path:
    """A directory with the files an import looks for (contents an import does not read yet), and
    `files` (name -> content) beside or instead of them."""
    directory.mkdir(parents=True)
    contents = {
        "config.json": json.dumps({"model_type": "llama"}),
        "model.safetensors": "weights",
        "tokenizer.json": "{}",
    }
    for name, content in {**contents, **files}.items():
        (directory / name).write_text(content)
    return directory


def test_a_file_linked_from_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "id_ed25519"
    key.write_text(SECRET)
    model = checkpoint(tmp_path / "model")
    (model / "chat_template.jinja").symlink_to(key)
    with pytest.raises(ValueError, match=r"template\.jinja links to .*id_ed25519, outside the checkpoint"):
        source_files(model)


def test_a_link_inside_the_checkpoint_is_read(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "model", **{"templates.jinja": "{{ messages }}"})
    (model / "chat_template.jinja").symlink_to("templates.jinja")
    assert model / "chat_template.jinja" in source_files(model)


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/model.safetensors", "model.bin"]
)
def test_shards_named_with_a_path_or_not_safetensors_are_refused(tmp_path: Path, shard: str) -> None:
    (tmp_path / "outside.safetensors").write_text("another model's weights")
    index = json.dumps({"weight_map": {"model.embed_tokens.weight": shard}})
    model = checkpoint(tmp_path / "model", **{"model.safetensors.index.json": index})
    (model / "sub").mkdir()
    (model / "sub" / "model.safetensors").write_text("weights")
    (model / "model.bin").write_text("a pickle")
    message = f"maps tensors to '{shard}'; a shard is a \\*.safetensors file in the checkpoint directory"
    with pytest.raises(ValueError, match=message):
        source_files(model)
    with pytest.raises(ValueError, match=message):  # nor does a worker load one from a registered version
        weight_files(model)


def test_a_hugging_face_cache_snapshot_imports_through_its_links_into_blobs(tmp_path: Path) -> None:
    repository = tmp_path / "hub" / "models--org--tiny"
    blobs, snapshot = repository / "blobs", repository / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    names = {
        "config.json": json.dumps({"model_type": "llama"}),
        "model.safetensors.index.json": json.dumps({"weight_map": dict(zip("ab", shards, strict=True))}),
        **{shard: f"shard {i}" for i, shard in enumerate(shards)},
        "tokenizer.json": "{}",
    }
    for i, (name, content) in enumerate(names.items()):
        (blobs / f"{i:040x}").write_text(content)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", f"{i:040x}"))  # as huggingface_hub links
    assert [f.name for f in source_files(snapshot)] == list(names)


def test_a_broken_config_is_refused_naming_the_file(tmp_path: Path) -> None:
    broken = checkpoint(tmp_path / "broken", **{"config.json": '{"model_type": "llama",'})
    with pytest.raises(ValueError, match=r"broken/config\.json is not valid JSON"):
        source_files(broken)
    listed = checkpoint(tmp_path / "listed", **{"config.json": "[]"})
    with pytest.raises(ValueError, match=r"listed/config\.json holds a JSON list"):
        source_files(listed)


def test_a_config_or_weights_a_model_cannot_be_built_from_are_refused_by_name(tmp_path: Path) -> None:
    incomplete = checkpoint(tmp_path / "incomplete")  # {"model_type": "llama"} and nothing else
    with pytest.raises(ValueError, match=r"config\.json does not describe a model .* 'num_attention_heads'"):
        check_checkpoint(incomplete)
    cut = checkpoint(tmp_path / "cut", **{"config.json": json.dumps({"model_type": "llama", **COMMON})})
    (cut / "model.safetensors").write_bytes(struct.pack("<Q", 64) + b'{"model.norm.weight":')
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        check_checkpoint(cut)


def test_a_truncated_gguf_file_is_refused_as_damaged(tmp_path: Path) -> None:
    cut = tmp_path / "model.gguf"
    cut.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1))  # version 3, a tensor and a key: then nothing
    with pytest.raises(ValueError, match=r"model\.gguf is a damaged GGUF file \(truncated or corrupt"):
        total_bytes(source_files(cut))
