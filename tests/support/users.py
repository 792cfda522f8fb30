"""Simulated users asking a running gateway from a thread of their own, for as long as a test or a
benchmark needs traffic (`reflow up --demo` runs `reflow simulate` as a process instead)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from feedback.tasks.simulate import Behaviour, SimulationReport, simulate
from feedback.tasks.task import Task


class Users:
    """`task`'s simulated users, behaving as `behaviour` says, from `start` to `stop`; `report` is
    what they have seen so far (per version: answers their oracle liked, and answers)."""

    def __init__(self, api_key: str, task: Task, behaviour: Behaviour, rate: float = 8, users: int = 1000):
        self.api_key, self.task, self.behaviour, self.rate, self.users = api_key, task, behaviour, rate, users
        self.report = SimulationReport()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, gateway: str) -> None:
        self._thread = threading.Thread(target=asyncio.run, args=(self._ask(gateway),), daemon=True)
        self._thread.start()

    async def _ask(self, gateway: str) -> None:
        def seen(report: SimulationReport) -> None:
            self.report = report

        asking = asyncio.create_task(
            simulate(gateway, self.api_key, task=self.task, rate=self.rate, duration_s=0, users=self.users,
                     on_request=seen, behaviour=self.behaviour)
        )  # fmt: skip
        stopped = asyncio.create_task(asyncio.to_thread(self._stop.wait))
        await asyncio.wait((asking, stopped), return_when=asyncio.FIRST_COMPLETED)
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
