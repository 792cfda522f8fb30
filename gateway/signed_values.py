"""Values the gateway keeps in Redis, signed with an HMAC under a secret in the store (which every
replica shares and Redis never sees): what a gateway reads back is only what a gateway wrote, so
write access to Redis is not a tenant's identity."""

from __future__ import annotations

import hashlib
import hmac
import logging

logger = logging.getLogger(__name__)
SECRET_NAME = "redis-values"  # the store secret (reflow/store/secrets.py) values are signed with


class Signer:
    """Signs a value for the Redis key it is stored under, and opens what was signed so."""

    def __init__(self, secret: bytes):
        self.secret = secret
        self._warned = False

    def sign(self, key: str, value: bytes) -> bytes:
        """`value` with its signature in front, valid under `key` only (a signed value copied to
        another key, e.g. another API key's hash, does not open)."""
        return self._mac(key, value) + b"." + value

    def open(self, key: str, signed: bytes) -> bytes | None:
        """The value `signed` carries, if a gateway of this store signed it for `key`; None (and a
        warning, the first time) for anything else."""
        mac, dot, value = signed.partition(b".")
        if dot and hmac.compare_digest(mac, self._mac(key, value)):
            return value
        if not self._warned:
            self._warned = True
            logger.warning(
                "Redis holds %s without a valid signature: ignored, as every such value will be. "
                "Something other than a gateway of this store writes to Redis; check who can",
                key,
            )
        return None

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self.secret, key.encode() + b"\0" + value, hashlib.sha256).hexdigest().encode()
