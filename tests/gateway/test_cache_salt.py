"""A tenant's prefix-cache salt: keyed with a secret every gateway replica shares, so the tenant's
cached blocks serve it through any replica, while whoever reaches a worker cannot name the salt to
learn from `cached_tokens` what the tenant's prompts start with."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from reflow.store.database import open_db
from reflow.store.tables import Tenant
from reflow.v1 import worker_pb2
from tests.support.stack import Stack, request, start_replica, stop_stack

PROMPT = "1234567890123456789+1="  # 23 tokens: one full block of 16 to cache


async def cached_tokens(stack: Stack) -> int:
    """What the prefix cache held of PROMPT for the stack's tenant, through the stack's gateway."""
    messages = [m async for m in stack.stub.Generate(request(PROMPT, max_tokens=4), metadata=stack.metadata)]
    return messages[-1].usage.cached_tokens


async def test_a_tenants_blocks_serve_it_through_every_replica_and_nobody_can_name_its_salt(
    stack: Stack,
) -> None:
    replica = await start_replica(stack)
    try:
        assert [await cached_tokens(stack), await cached_tokens(replica)] == [0, 16]
    finally:
        await stop_stack(replica)
    with Session(open_db(stack.settings.resolved_database_url)) as session:
        tenant_id = session.scalars(select(Tenant.id).where(Tenant.name == "acme")).one()
    for guess in (f"tenant {tenant_id}", str(tenant_id), "acme", ""):  # what a salt used to be, and others
        probe = worker_pb2.WorkerGenerateRequest(
            model="arith", version="1", prompt=PROMPT, sampling={"max_tokens": 1}, cache_salt=guess
        )
        answer = [m async for m in stack.worker_stub().Generate(probe)]
        assert answer[-1].cached_tokens == 0, guess
