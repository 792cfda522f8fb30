"""A/B routing through a real gateway and worker: no request is assigned until the challenger is
served, then each user keeps one arm, responses name it, and the stored events carry it."""

from __future__ import annotations

import asyncio
import itertools

import openai
from sqlalchemy import select
from sqlalchemy.orm import Session

from feedback.experiments.lifecycle import reconcile
from feedback.experiments.promotion import push_to_workers
from gateway.assignment import ASSIGNMENT_KEY, assigned_arm
from reflow.registry import CHALLENGER, CHAMPION, Registry
from reflow.settings import Settings
from reflow.store.database import open_db
from reflow.store.secrets import shared_secret
from reflow.store.tables import Inference
from reflow.v1 import inference_pb2
from reflow.worker_calls import WorkerTargets
from tests.support.kafka import consuming
from tests.support.models import MODEL
from tests.support.stack import Stack, start_stack, stop_stack
from tests.support.store import count
from tests.support.waiting import wait_for
from workers.follower import AliasFollower

P = inference_pb2


async def ask(stack: Stack, user: str, model: str = "") -> P.GenerateResponse:
    """The first message of a short completion for `user`."""
    request = P.GenerateRequest(
        model=model, prompt="12+30=", user_id=user, sampling=P.SamplingParams(max_tokens=2)
    )
    messages = [m async for m in stack.stub.Generate(request, metadata=stack.metadata)]
    return messages[0]


async def serve_the_challenger(stack: Stack, settings: Settings) -> None:
    """Has the stack's worker load what the aliases name (its follower never polls: a push moves
    it) and the gateway see it."""
    worker = stack.workers[0]
    pushing = settings.model_copy(update={"workers": [worker.address]})
    worker.servicer.follower = AliasFollower(
        worker.servicer.versions, MODEL, [CHAMPION, CHALLENGER], poll_s=0
    )
    assert (await asyncio.to_thread(push_to_workers, WorkerTargets.from_settings(pushing))) == {
        worker.address: "ok"
    }
    assert worker.engine.find(MODEL, "2") is not None
    await stack.pool.refresh()


async def test_users_keep_their_arm_once_the_challenger_is_served_and_events_carry_it(
    swap_settings: Settings,
) -> None:
    stack = await start_stack(swap_settings, requests_per_minute=0)
    store = open_db(swap_settings.resolved_database_url)
    registry = Registry.from_settings(swap_settings)
    worker = stack.workers[0]
    pushing = swap_settings.model_copy(update={"workers": [worker.address]})
    try:
        [refused] = (await asyncio.to_thread(push_to_workers, WorkerTargets.from_settings(pushing))).values()
        assert refused.startswith("FAILED_PRECONDITION")  # this worker follows no alias yet
        registry.set_alias(MODEL, CHALLENGER, "2")
        experiment = reconcile(store, registry, MODEL, traffic=0.5)
        assert experiment is not None
        await asyncio.sleep(3 * swap_settings.worker_poll_s)  # the gateway has seen the experiment
        waiting = await ask(stack, "early-user")  # the challenger is not loaded: not assigned
        assert (waiting.arm, waiting.model_version) == (CHAMPION, "1")

        await serve_the_challenger(stack, swap_settings)

        users = [f"user-{i}" for i in range(24)]
        first = [await ask(stack, u) for u in users]
        again = [await ask(stack, u) for u in users]
        key = shared_secret(store, ASSIGNMENT_KEY)  # every replica draws arms with the store's key
        expected = [assigned_arm(key, experiment.id, "acme", u, 0.5) for u in users]
        assert [m.arm for m in first] == [m.arm for m in again] == expected
        assert {CHAMPION, CHALLENGER} <= set(expected)
        assert all(m.model_version == ("2" if m.arm == CHALLENGER else "1") for m in first)
        pinned = await ask(stack, users[0], model=f"{MODEL}@{CHAMPION}")  # asked by name: not in it
        assert (pinned.arm, pinned.model_version) == (CHAMPION, "1")
        # several choices of a request without a user: each has a request id of its own, all the arm of
        # the first (so a preference among them compares one version's samples)
        sdk = openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key=stack.api_key, max_retries=0)
        several = [
            await sdk.completions.create(model=MODEL, prompt="12+30=", n=4, max_tokens=2) for _ in range(6)
        ]
        await sdk.close()
        choice_ids = [[(c.model_extra or {})["request_id"] for c in done.choices] for done in several]

        with consuming(swap_settings.kafka_bootstrap, store):
            stored = 2 * len(users) + 2 + 4 * len(several)
            await asyncio.to_thread(wait_for, lambda: count(store, Inference) == stored)
        with Session(store) as session:
            rows = {r.request_id: r for r in session.scalars(select(Inference))}
        for ids in choice_ids:
            arms = {(rows[i].arm, rows[i].version, rows[i].experiment_id) for i in ids}
            assert arms == {(rows[ids[0]].arm, rows[ids[0]].version, experiment.id)}
        for message in first + again:
            row = rows[message.request_id]
            assert (row.arm, row.version, row.experiment_id) == (
                message.arm,
                message.model_version,
                experiment.id,
            )
        assert (
            rows[waiting.request_id].experiment_id is None and rows[pinned.request_id].experiment_id is None
        )
    finally:
        store.dispose()
        await stop_stack(stack)


async def test_a_request_whose_challenger_went_away_is_answered_by_the_champion_in_its_arm(
    swap_settings: Settings,
) -> None:
    """The worker drops the challenger after the gateway last looked: a request assigned to it is
    answered by the champion and stays in the challenger's arm, in its response and its stored
    event, so that arm keeps every unit it was assigned (the split the sample ratio check tests)."""
    settings = swap_settings.model_copy(update={"worker_poll_s": 3600})  # the gateway looks when told
    stack = await start_stack(settings, requests_per_minute=0)
    store = open_db(settings.resolved_database_url)
    try:
        registry = Registry.from_settings(settings)
        registry.set_alias(MODEL, CHALLENGER, "2")
        experiment = reconcile(store, registry, MODEL, traffic=0.5)
        assert experiment is not None
        await stack.gateway.service.experiments.refresh()
        await serve_the_challenger(stack, settings)
        key = shared_secret(store, ASSIGNMENT_KEY)
        users = (f"user-{i}" for i in itertools.count())
        first, second = itertools.islice(
            (u for u in users if assigned_arm(key, experiment.id, "acme", u, 0.5) == CHALLENGER), 2
        )
        served = await ask(stack, first)
        assert (served.arm, served.model_version) == (CHALLENGER, "2")

        assert stack.workers[0].engine.remove(MODEL, "2")  # the gateway still routes the arm there
        answered = await ask(stack, second)
        assert (answered.arm, answered.model_version) == (CHALLENGER, "1")

        with consuming(settings.kafka_bootstrap, store):
            await asyncio.to_thread(wait_for, lambda: count(store, Inference) == 2)
        with Session(store) as session:
            row = session.get(Inference, answered.request_id)
            assert row is not None
            assert (row.arm, row.version, row.experiment_id) == (CHALLENGER, "1", experiment.id)
    finally:
        store.dispose()
        await stop_stack(stack)
