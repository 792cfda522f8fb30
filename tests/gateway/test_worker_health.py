"""The gateway's view of a worker's health: one status poll that times out (a busy worker, or a
busy gateway) leaves the worker in routing, two in a row take it out, and a worker that refuses the
call is out at once; its next answer brings it back."""

from __future__ import annotations

import asyncio

import grpc

from gateway.routing import MISSED_POLLS, WorkerPool
from reflow.v1 import worker_pb2, worker_pb2_grpc

LOADED = worker_pb2.LoadedVersion(model="arith", version="1", aliases=["champion"])


class HeldStatus(worker_pb2_grpc.WorkerServicer):
    """A worker whose Status answers at once, or waits while `held` is clear (past any deadline)."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.held.set()

    async def Status(
        self, request: worker_pb2.WorkerStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatusResponse:
        await self.held.wait()
        return worker_pb2.WorkerStatusResponse(loaded=[LOADED])


async def test_a_worker_leaves_routing_after_missed_polls_in_a_row_or_a_refusal_and_comes_back() -> None:
    servicer = HeldStatus()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = WorkerPool([f"127.0.0.1:{port}"], poll_s=3600)  # polled by hand here
    [worker] = pool.workers
    try:
        await pool.refresh()
        assert worker.healthy and list(worker.loaded) == [LOADED]
        servicer.held.clear()  # every poll now runs past its deadline
        for missed in range(1, MISSED_POLLS + 1):
            await pool.refresh()
            assert (worker.missed_polls, worker.healthy) == (missed, missed < MISSED_POLLS)
        servicer.held.set()
        await pool.refresh()
        assert (worker.missed_polls, worker.healthy) == (0, True)
        servicer.held.clear()
        await pool.refresh()  # one slow answer between good ones: still routed to
        servicer.held.set()
        await pool.refresh()
        assert (worker.missed_polls, worker.healthy) == (0, True)
        await server.stop(0)  # refused: out at once
        await pool.refresh()
        assert not worker.healthy
    finally:
        servicer.held.set()
        await server.stop(0)
        await pool.close()
