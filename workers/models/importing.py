"""Brings a checkpoint from outside into the shape a registered version has: a Hugging Face directory
(config, safetensors weights, tokenizer files) checked and copied, or one GGUF file converted.

Nothing is unpickled: pickled weights are refused with how to convert them, and a checkpoint is
loaded once (on the CPU) before it is accepted, so an architecture or tokenizer reflow does not
implement is refused at import, not when a worker first loads it. Nothing outside the checkpoint is
read: a link out of its directory, or a shard named with a path, is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from workers.models.gguf_checkpoint import gguf_tensor_bytes, gguf_to_checkpoint
from workers.models.hf_tokenizer import TOKENIZER_FILES
from workers.models.llama import CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, shard_names
from workers.models.loader import check_checkpoint, read_config

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONVERT_HINT = (
    "reflow never unpickles weights; convert them to safetensors where you trust the file, e.g. "
    'python -c "from transformers import AutoModelForCausalLM as M; '
    "M.from_pretrained('IN').save_pretrained('OUT')\" (transformers writes model.safetensors), "
    "then import OUT"
)
CHUNK = 8 << 20  # bytes hashed or copied between progress updates

Progress = Callable[[int], None]  # called with the bytes just processed


def source_files(path: Path) -> list[Path]:
    """The files of `path` an import reads, in a fixed order; ValueError for what cannot be imported."""
    if path.is_file():
        if path.suffix == ".gguf":
            return [path]
        if path.suffix in PICKLE_SUFFIXES:
            raise ValueError(f"{path} holds pickled weights; {CONVERT_HINT}")
        raise ValueError(f"{path} is neither a Hugging Face checkpoint directory nor a .gguf file")
    if not path.is_dir():
        raise ValueError(f"{path} does not exist")
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{path} has no {CONFIG_FILE}; a Hugging Face checkpoint directory has one")
    if (path / WEIGHTS_INDEX_FILE).is_file():
        weights = [WEIGHTS_INDEX_FILE, *shard_names(path / WEIGHTS_INDEX_FILE)]
    elif (path / WEIGHTS_FILE).is_file():
        weights = [WEIGHTS_FILE]
    elif pickled := sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES):
        raise ValueError(f"{path} holds pickled weights ({', '.join(pickled)}); {CONVERT_HINT}")
    else:
        raise ValueError(f"{path} has no {WEIGHTS_FILE} (or {WEIGHTS_INDEX_FILE} and its shards)")
    if not (path / TOKENIZER_FILES[0]).is_file():
        raise ValueError(
            f"{path} has no {TOKENIZER_FILES[0]}; transformers writes one for a tokenizer it can load: "
            "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
        )
    names = [CONFIG_FILE, *weights, *(f for f in TOKENIZER_FILES if (path / f).is_file())]
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}, which its {WEIGHTS_INDEX_FILE} names")
    files = [path / n for n in names]
    check_contained(path, files)
    read_config(path)  # a broken config.json is refused by name before anything is hashed
    return files


def check_contained(checkpoint: Path, files: list[Path]) -> None:
    """Refuses a file of `checkpoint` that is a link to somewhere outside it (a key, a password
    file), which an import would upload to the registry and a chat template would show in every
    prompt. A Hugging Face cache snapshot (`models--ORG--NAME/snapshots/REV/`) may link into its
    repository's `blobs/`, where the cache keeps every file once."""
    root = checkpoint.resolve()
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        root = root.parent.parent
    for file in files:
        target = file.resolve()
        if not target.is_relative_to(root):
            raise ValueError(
                f"{file} links to {target}, outside the checkpoint {checkpoint}; reflow imports only "
                "the checkpoint's own files: copy the file into the directory if it belongs to it"
            )


def total_bytes(files: list[Path]) -> int:
    """What hashing and then copying or converting `files` goes through, for a progress bar."""
    read = sum(f.stat().st_size for f in files)
    if files[0].suffix == ".gguf":
        return read + gguf_tensor_bytes(files[0])
    return 2 * read


def fingerprint(files: list[Path], progress: Progress | None = None) -> str:
    """SHA-256 over the names and contents of `files`: the same checkpoint imports once."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as source:
            for chunk in _chunks(source):
                digest.update(chunk)
                if progress is not None:
                    progress(len(chunk))
    return digest.hexdigest()


def prepare(files: list[Path], directory: Path, progress: Progress | None = None) -> Path:
    """Writes the version `files` make into `directory` (converting a GGUF file) and checks that
    reflow serves it; ValueError naming what it does not implement."""
    directory.mkdir(parents=True, exist_ok=True)
    if files[0].suffix == ".gguf":
        gguf_to_checkpoint(files[0], directory, progress)
    else:
        for file in files:
            with file.open("rb") as source, (directory / file.name).open("wb") as target:
                for chunk in _chunks(source):
                    target.write(chunk)
                    if progress is not None:
                        progress(len(chunk))
    check_checkpoint(directory)
    return directory


def _chunks(source: BinaryIO) -> Iterator[bytes]:
    """The bytes of an open file in CHUNK-sized pieces."""
    while chunk := source.read(CHUNK):
        yield chunk
