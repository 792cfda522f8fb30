"""API keys: how they are made, how short they may be, and the hash they are stored and looked up by."""

from __future__ import annotations

import hashlib
import secrets

MIN_API_KEY_LENGTH = 16
KEY_PREFIX = "rf_"


def hash_key(api_key: str) -> str:
    """SHA-256 hex of a key; keys are long and random, so a fast unsalted hash is enough to look up."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_key() -> str:
    """A fresh API key with 256 bits of randomness."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def display_prefix(api_key: str) -> str:
    """What is stored to recognise a key: a few characters of generated keys, nothing of others."""
    return api_key[:8] if api_key.startswith(KEY_PREFIX) and len(api_key) > 32 else ""
