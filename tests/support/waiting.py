"""Waiting for what a test expects to happen: the one polling helper, in a thread's and in an event
loop's flavour. A condition that never holds fails the test saying what it waited for."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], timeout_s: float = 60.0, what: str = "condition", interval_s: float = 0.05
) -> T:
    """Calls `condition` until it returns something truthy, and returns that; AssertionError after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
    return result


async def eventually(
    condition: Callable[[], object | Awaitable[object]],
    timeout_s: float = 15.0,
    what: str = "condition",
    interval_s: float = 0.01,
) -> None:
    """`wait_for` for a test running in an event loop: `condition` may be a coroutine function,
    and the loop keeps running while it waits."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(interval_s)
