"""Request ids that prove who was served: a random nonce and an HMAC of it with the tenant's name.

Feedback names the completion it rates by request_id. Because the id is signed for the tenant it
was served to, the gateway can tell whether a tenant rates its own completion without looking the
request up (its inference event may not be stored yet). The key lives in the store, so every
gateway replica and `reflow feedback ingest` share it.
"""

from __future__ import annotations

import hmac
import re
import secrets

from sqlalchemy import Engine

from reflow.store.secrets import shared_secret

KEY_NAME = "request_id_key"
NONCE_HEX = 24  # 96 random bits
TAG_HEX = 24  # 96 bits of HMAC-SHA256
_HEX = re.compile(f"[0-9a-f]{{{NONCE_HEX + TAG_HEX}}}")


class RequestIds:
    """Mints request ids for a tenant and checks that an id was minted for that tenant."""

    def __init__(self, key: bytes):
        self._key = key

    @classmethod
    def from_store(cls, db: Engine) -> RequestIds:
        """Uses the store's signing key, creating it on first use."""
        return cls(shared_secret(db, KEY_NAME))

    def _tag(self, nonce: str, tenant: str) -> str:
        return hmac.digest(self._key, f"{nonce}:{tenant}".encode(), "sha256").hex()[:TAG_HEX]

    def new(self, tenant: str) -> str:
        """A fresh request id served to `tenant`."""
        nonce = secrets.token_hex(NONCE_HEX // 2)
        return nonce + self._tag(nonce, tenant)

    def served_to(self, request_id: str, tenant: str) -> bool:
        """True when `request_id` was minted for `tenant` (by any gateway sharing the store)."""
        if not _HEX.fullmatch(request_id):
            return False
        nonce, tag = request_id[:NONCE_HEX], request_id[NONCE_HEX:]
        return hmac.compare_digest(tag, self._tag(nonce, tenant))
