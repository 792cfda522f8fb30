"""A gateway stack serving from an event loop in a thread of its own, for tests that drive it with
blocking calls (schemathesis, hypothesis), and the tiny chat model the fuzz tests serve."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from reflow.settings import Settings
from tests.support.registry import local_registry
from tests.support.stack import Stack, start_stack, stop_stack

CHAT_MODEL = "chat"


class StackThread:
    """A Stack serving `model` from an event loop in a thread of its own."""

    def __init__(self, settings: Settings, model: str = CHAT_MODEL):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway-under-test", daemon=True)
        self.thread.start()
        self.stack: Stack = self.run(start_stack(settings, model=model))

    def run(self, coroutine: Any, timeout_s: float = 120) -> Any:
        """What `coroutine` returns, run on the stack's loop (TimeoutError after `timeout_s`)."""
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return future.result(timeout=timeout_s)

    def stop(self) -> None:
        self.run(stop_stack(self.stack))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


def tiny_chat_settings(settings: Settings, checkpoint: Path, root: Path) -> Settings:
    """`settings` with a registry of its own under `root` serving `checkpoint` (a tiny chat model:
    tests.support.smollm2.tiny_chat_checkpoint) as CHAT_MODEL v1 @champion, with a 128-token
    context, so that any max_tokens a fuzzer picks is generated or refused in milliseconds."""
    registry = local_registry(root, "fuzz-registry")
    registry.register(CHAT_MODEL, checkpoint, params={}, metrics={}, alias="champion")
    return settings.model_copy(
        update={"mlflow_tracking_uri": registry.tracking_uri, "mlflow_artifact_root": registry.artifact_root,
                "model_name": CHAT_MODEL, "max_model_len": 128, "max_prompt_chars": 512}
    )  # fmt: skip
