"""The gateway's view of a worker's health: one status poll that times out (a busy worker, or a
busy gateway) leaves the worker in routing, two in a row take it out, and a worker that refuses the
call is out at once; its next answer brings it back. A worker whose link is cut in the middle of a
call fails that call within seconds (the channel's pings go unanswered), never holding it until
the client's deadline."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from gateway.routing import MISSED_POLLS, WorkerPool
from reflow.settings import Settings
from reflow.v1 import worker_pb2, worker_pb2_grpc
from tests.support.relay import relaying
from tests.support.stack import generate, request, start_stack, start_worker, stop_stack
from tests.support.waiting import eventually

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


async def test_a_call_to_a_worker_whose_link_is_cut_fails_unavailable_not_at_the_clients_deadline(
    settings: Settings,
) -> None:
    worker = await start_worker(settings)
    port = int(worker.address.rsplit(":", 1)[1])
    unpolled = settings.model_copy(update={"worker_poll_s": 3600})  # only the call can find it out
    with relaying(socket.create_server(("127.0.0.1", 0)), ("127.0.0.1", port)) as link:
        stack = await start_stack(unpolled, n_workers=0, extra_addresses=(link.address,))
        try:
            assert [m.finish_reason for m in await generate(stack, request())][-1]  # through the link
            link.cut()  # no byte passes either way, and no reset arrives
            with pytest.raises(grpc.aio.AioRpcError) as failed:  # unanswered pings end it within 15 s
                await generate(stack, request(), timeout=45)  # gRPC's own ping timeout alone: 60 s
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
            assert "every worker serving arith@champion failed" in str(failed.value.details())
            link.restore()

            async def back() -> bool:  # status polls, answered once gRPC's reconnect backoff lets it connect
                await stack.pool.refresh()
                return all(w.healthy for w in stack.pool.workers)

            await eventually(back, 60, what="the worker back in routing once its link is", interval_s=0.5)
            assert [m.finish_reason for m in await generate(stack, request())][-1]
        finally:
            link.restore()
            await stop_stack(stack)
            await worker.server.stop(0)
            worker.engine.close()
