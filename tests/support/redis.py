"""Redis for tests: the machine's own at 127.0.0.1:6379 under a key prefix of the test's, and a
redis-server a test starts, stops and restarts itself (for outages)."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from gateway.shared_level import RedisConfig, SharedLevel
from reflow.serving import free_port
from reflow.settings import Settings
from tests.support.waiting import wait_for

MACHINE_REDIS = "redis://127.0.0.1:6379/0"


def unique_prefix() -> str:
    """A key prefix no other test (or run) shares."""
    return f"reflow-test:{uuid.uuid4().hex[:12]}:"


@dataclass(frozen=True)
class SharedRedis:
    """A Redis and the prefix of one test's keys in it."""

    url: str
    prefix: str

    @property
    def config(self) -> RedisConfig:
        return RedisConfig(self.url, self.prefix, timeout_s=0.5, key_ttl_s=60)

    def level(self) -> SharedLevel:
        """A gateway replica's connection to it (one per replica)."""
        return SharedLevel(self.config, probe_interval_s=0.1)

    def held_slots(self) -> list[str]:
        """The stream slots (lease members) whose lease has not run out, on Redis's clock."""
        with redis.Redis.from_url(self.url) as client:
            seconds, micros = client.time()
            now_ms = seconds * 1000 + micros // 1000
            return [
                member.decode()
                for key in client.scan_iter(match=f"{self.prefix}tenant:*:streams")
                for member in client.zrangebyscore(key, now_ms, "+inf")
            ]

    def settings(self, settings: Settings) -> Settings:
        """`settings` with this Redis as every gateway's shared level."""
        return settings.model_copy(update={"redis_url": self.url, "redis_prefix": self.prefix})


def forget(shared: SharedRedis) -> None:
    """Deletes every key under the prefix."""
    with redis.Redis.from_url(shared.url, socket_timeout=2) as client:
        for key in client.scan_iter(match=f"{shared.prefix}*", count=1000):
            client.delete(key)


class RedisServer:
    """A memory-only redis-server on a free port, in `directory`."""

    def __init__(self, directory: Path):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("needs redis-server (apt install redis-server) to stop and restart a Redis")
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.shared = SharedRedis(self.url, unique_prefix())
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Starts it (again, on the same port) and waits until it answers."""
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

        def answers() -> bool:
            try:
                with redis.Redis.from_url(self.url, socket_timeout=0.5) as client:
                    return bool(client.ping())
            except redis.RedisError:
                return False

        wait_for(answers, 10, what=f"redis-server on port {self.port}", interval_s=0.05)

    def stop(self) -> None:
        """Kills it (no shutdown handshake: an outage, not a maintenance)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None
