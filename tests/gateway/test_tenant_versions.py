"""Each tenant is served what it opted into, through a real gateway and worker: a tenant training
its own is served its own champion and A/B tested on its own users; a tenant whose feedback trains
nothing, and one in the shared model, are served the champion's exact tokens and never take part;
no tenant is served another's own version, even by asking for it."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest

from feedback.experiments.lifecycle import reconcile
from gateway.assignment import ASSIGNMENT_KEY, assigned_arm
from gateway.tenants import create_tenant
from reflow.registry import CHALLENGER, CHAMPION, TENANT_TAG, Registry, tenant_alias
from reflow.scopes import Scope
from reflow.settings import Settings
from reflow.store.database import open_db
from reflow.store.secrets import shared_secret
from reflow.store.tables import TRAINS_NOTHING
from reflow.v1 import inference_pb2
from tests.support.models import MODEL, save_model, tiny_model
from tests.support.stack import Stack, start_stack, stop_stack
from tests.support.waiting import eventually
from workers.follower import AliasFollower

P = inference_pb2


async def ask(stack: Stack, key: str, user: str, model: str = "") -> tuple[P.GenerateResponse, str]:
    """The first message of a short greedy completion for `user` of the tenant holding `key`, and
    its text."""
    request = P.GenerateRequest(
        model=model, prompt="12+30=", user_id=user, sampling=P.SamplingParams(max_tokens=4)
    )
    metadata = (("authorization", f"Bearer {key}"),)
    messages = [m async for m in stack.stub.Generate(request, metadata=metadata)]
    return messages[0], "".join(m.text for m in messages)


async def test_each_tenant_is_served_its_own_versions_and_only_its_users_are_tested(
    swap_settings: Settings, tmp_path: Path
) -> None:
    registry = Registry.from_settings(swap_settings)
    three = registry.register(
        MODEL, save_model(tiny_model(2), tmp_path / "v3"), params={}, metrics={}, alias="",
        tags={TENANT_TAG: "own"},
    ).version  # fmt: skip
    registry.client.set_model_version_tag(MODEL, "2", TENANT_TAG, "own")  # v2 is "own"'s too
    stack = await start_stack(swap_settings, requests_per_minute=0)  # its tenant is in the shared model
    store = open_db(swap_settings.resolved_database_url)
    try:
        own_tenant, own_key = create_tenant(store, "own")  # trains its own: a new tenant's default
        _, off_key = create_tenant(store, "off", trains=TRAINS_NOTHING)
        own = Scope("own", own_tenant.id)
        registry.set_alias(MODEL, own.champion, "2")
        registry.set_alias(MODEL, own.challenger, three)
        experiment = reconcile(store, registry, MODEL, 0.5, own)
        assert experiment is not None and (experiment.tenant, experiment.champion_version) == ("own", "2")
        worker = stack.workers[0]  # follows the shared aliases, and so every tenant's own
        worker.servicer.follower = AliasFollower(worker.servicer.versions, MODEL, [CHAMPION, CHALLENGER], 0)
        await worker.servicer.follower.sync()
        assert {m.version: m.aliases for m in worker.engine.loaded()} == {
            "1": {CHAMPION}, "2": {own.champion}, three: {own.challenger}
        }  # fmt: skip
        await stack.pool.refresh()
        users = [f"user-{i}" for i in range(24)]
        expected = [
            assigned_arm(shared_secret(store, ASSIGNMENT_KEY), experiment.id, "own", u, 0.5) for u in users
        ]
        assert {CHAMPION, CHALLENGER} <= set(expected)
        tested = users[expected.index(CHALLENGER)]

        async def in_the_experiment() -> bool:  # once the gateway's view has read it
            return (await ask(stack, own_key, tested))[0].arm == CHALLENGER

        await eventually(in_the_experiment, what="the tenant's experiment")

        answers = [(await ask(stack, own_key, u))[0] for u in users]
        assert [m.arm for m in answers] == expected
        assert all(m.model_version == (three if m.arm == CHALLENGER else "2") for m in answers)
        _, champion_text = await ask(stack, stack.api_key, "anyone", model=f"{MODEL}/1")
        listed = {
            key: {
                (v.version, tuple(v.aliases))
                for m in (
                    await stack.stub.ListModels(
                        P.ListModelsRequest(), metadata=(("authorization", f"Bearer {key}"),)
                    )
                ).models
                for v in m.versions
            }
            for key in (own_key, off_key)
        }
        assert listed[own_key] == {("1", (CHAMPION,)), ("2", (own.champion,)), (three, (own.challenger,))}
        assert listed[off_key] == {("1", (CHAMPION,))}  # another tenant's versions are its own business
        for key in (off_key, stack.api_key):  # trains nothing; trains the shared model
            others = [await ask(stack, key, u) for u in users]  # the same user ids: other people
            assert {(m.arm, m.model_version) for m, _ in others} == {(CHAMPION, "1")}
            assert {text for _, text in others} == {champion_text}
            for asked in (f"{MODEL}/2", f"{MODEL}@{own.champion}", f"{MODEL}/{three}"):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await ask(stack, key, "curious", model=asked)
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND  # as if it were not served
                assert (
                    refused.value.details()
                    == f"no worker serves model {asked}; served now: {MODEL}/1 ['champion']"
                )
    finally:
        store.dispose()
        await stop_stack(stack)


async def test_the_shared_champion_waits_while_a_tenants_pin_cannot_be_served(
    swap_settings: Settings, tmp_path: Path
) -> None:
    """A worker that cannot load the version a tenant is pinned to keeps the shared champion where
    it was, rather than leave that tenant to be routed to a champion it must not see; once the pin
    loads, both move in one step."""
    registry = Registry.from_settings(swap_settings)
    broken = registry.register(
        MODEL, save_model(tiny_model(2), tmp_path / "v3"), params={}, metrics={}, alias=""
    )
    source = registry.client.get_model_version(MODEL, broken.version).source
    shutil.rmtree(Path(source.removeprefix("file://")))  # its files are gone from the artifact store
    stack = await start_stack(swap_settings, requests_per_minute=0)
    try:
        worker = stack.workers[0]
        follower = AliasFollower(worker.servicer.versions, MODEL, [CHAMPION, CHALLENGER], 0)
        pin = tenant_alias(7, CHAMPION)
        registry.set_alias(MODEL, pin, broken.version)
        registry.set_alias(MODEL, CHAMPION, "2")
        await follower.sync()
        assert {m.version: m.aliases for m in worker.engine.loaded() if m.aliases} == {"1": {CHAMPION}}

        registry.set_alias(MODEL, pin, "1")  # a version it can serve
        await follower.sync()
        assert {m.version: m.aliases for m in worker.engine.loaded() if m.aliases} == {
            "1": {pin},
            "2": {CHAMPION},
        }
    finally:
        await stop_stack(stack)
