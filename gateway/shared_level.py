"""The shared level of the gateway's caches: one Redis (REFLOW_REDIS_URL: `redis://`, or `rediss://`
for TLS, with an ACL user as `rediss://user:password@host:port/0`) that every replica's key cache
and quotas use, and whether it answers now.

Redis is never a single point of failure: a call that fails marks it down (logged once, saying
why, the URL's password never), callers then serve from their own level (the key cache from L1
and the store, quotas per replica), and a probe brings it back by itself when it answers again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

logger = logging.getLogger(__name__)
OUTAGE = (RedisError, OSError)  # what a call to an unreachable, restarting or failing Redis raises


def shared_key(prefix: str, *parts: object) -> str:
    """The Redis key (or channel) `parts` names under a deployment's REFLOW_REDIS_PREFIX."""
    return prefix + ":".join(str(part) for part in parts)


@dataclass(frozen=True)
class RedisConfig:
    """Where the shared level is (REFLOW_REDIS_URL and its neighbours)."""

    url: str = field(repr=False)  # may hold a password
    prefix: str
    timeout_s: float  # the longest wait for a reply
    key_ttl_s: float  # how long L2 keeps a found key


def safe_url(url: str) -> str:
    """`url` without its user, password and query (which redis-py reads a password from too), for logs."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2].partition('?')[0]}"  # the last @: a password may hold one


def trouble(error: BaseException) -> str:
    """What a failed call says of the shared level, for a person to act on."""
    if isinstance(error, AuthenticationError):
        return "refuses the user name or password of REFLOW_REDIS_URL"
    if isinstance(error, NoPermissionError):
        return "denies the ACL user of REFLOW_REDIS_URL a key or channel under REFLOW_REDIS_PREFIX"
    return f"is unreachable ({type(error).__name__})"


class SharedLevel:
    """A Redis client with the key prefix of this deployment, up or down."""

    def __init__(self, config: RedisConfig, probe_interval_s: float = 1.0):
        # One retry, at once, on a new connection: after Redis restarts, each pooled connection
        # fails once (and a lost give-back would hold its slot for a lease); more would make a
        # request wait for Redis to come back, when it should use its own level instead.
        self.client = redis.Redis.from_url(
            config.url,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self.config = config
        self.probe_interval_s = probe_interval_s
        self.available = True
        self.on_recovery: list[Callable[[], None]] = []  # what to redo when it answers again
        self._probe: asyncio.Task[None] | None = None

    def key(self, *parts: object) -> str:
        """A key of this deployment, e.g. key("tenant", "{7}", "streams")."""
        return shared_key(self.config.prefix, *parts)

    def failed(self, error: BaseException) -> None:
        """A call failed: serve without Redis until the probe reaches it again."""
        if not self.available:
            return
        self.available = False
        logger.warning(
            "Redis at %s %s: serving from this gateway's own cache, quotas per replica, until it "
            "answers again",
            safe_url(self.config.url), trouble(error),
        )  # fmt: skip
        self._probe = asyncio.get_running_loop().create_task(self._wait_for_recovery())

    async def _wait_for_recovery(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.client.ping()
            except OUTAGE:
                continue
            logger.info(
                "Redis at %s answers again: quotas and keys are shared again", safe_url(self.config.url)
            )
            self.available = True
            for recovered in self.on_recovery:
                recovered()
            return

    async def close(self) -> None:
        """Stops the probe and closes the connections."""
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        await self.client.aclose()
