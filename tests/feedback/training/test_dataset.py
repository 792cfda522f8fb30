"""What the fine-tune job learns from, read from the store: every kind of feedback as its examples,
preference pairs only between completions of the same conversation, and held-out users apart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from feedback.events import ChatMessage, FeedbackEvent, InferenceEvent, Latency, TokenUsage
from feedback.intake.consumer import store_events
from feedback.tasks.task import Example
from feedback.training.dataset import Judged, Pair, build_dataset, count_new, is_held_out, load_new
from gateway.tenants import create_tenant
from reflow.scopes import SHARED, Scope, learning_scopes
from reflow.store.tables import TRAINS_NOTHING, TRAINS_OWN, TRAINS_SHARED, utcnow
from tests.support.store import migrated_store

QUESTION = (("user", "Any tips for sleeping better?"),)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Engine]:
    yield from migrated_store(f"sqlite:///{tmp_path / 'store.db'}")


def inference(
    request_id: str, completion: str, question: str = QUESTION[0][1], tenant: str = "acme"
) -> InferenceEvent:
    return InferenceEvent(
        request_id=request_id, tenant=tenant, model="chat", version="1", prompt="",
        messages=[ChatMessage(role="user", content=question)], completion=completion, finish_reason="STOP",
        usage=TokenUsage(prompt_tokens=5, completion_tokens=5, reasoning_tokens=0),
        latency=Latency(first_token_ms=1.0, total_ms=2.0), time=utcnow(),
    )  # fmt: skip


def feedback(
    feedback_id: str, request_id: str, user: str, tenant: str = "acme", **fields: object
) -> FeedbackEvent:
    return FeedbackEvent.model_validate(
        {"feedback_id": feedback_id, "request_id": request_id, "tenant": tenant, "user_id": user,
         "time": utcnow(), "rating": 0, **fields}
    )  # fmt: skip


def test_every_kind_of_feedback_becomes_its_examples(store: Engine) -> None:
    events = [
        inference("a", "1. Go to bed at the same time."), inference("b", "Sleep is important."),
        inference("c", "Drink less coffee."), inference("d", "Whatever."),
        inference("e", "1. Exercise."), inference("other", "Paris.", question="Where is the Louvre?"),
        feedback("up", "a", "ann", rating=1),
        feedback("down", "d", "ann", stars=1),  # 1 star: a thumbs down
        feedback("fix", "c", "ann", rating=-1, correction="1. Drink less coffee."),
        feedback("pref", "e", "ann", preferred_over="b"),  # e was chosen over b, same conversation
        feedback("apart", "a", "ann", preferred_over="other"),  # another conversation: no pair
        feedback("neutral", "b", "ann", rating=0),  # says nothing: not an item
    ]  # fmt: skip
    with store.begin() as connection:
        store_events(connection, events)

    assert count_new(store, "chat") == 5
    items = load_new(store, "chat", 10)
    dataset = build_dataset(items, 1e-9, lambda _prompt: None)  # (almost) no one held out

    def said(text: str) -> Example:
        return Example(QUESTION, None, text)

    assert dataset.supervised == [said("1. Go to bed at the same time."), said("1. Drink less coffee.")]
    assert dataset.desirable == [said("1. Go to bed at the same time.")]
    assert dataset.undesirable == [said("Whatever."), said("Drink less coffee.")]
    assert dataset.pairs == [Pair(said("1. Exercise."), said("Sleep is important."))]
    assert dataset.size == 5 and not dataset.held_out


def test_held_out_users_are_judged_on_everything_they_said_and_trained_on_nothing(store: Engine) -> None:
    users = [f"user-{i}" for i in range(40)]
    held = {u for u in users if is_held_out(u, 0.3)}
    assert 0 < len(held) < len(users)  # both sides have users
    events: list[InferenceEvent | FeedbackEvent] = []
    for i, user in enumerate(users):
        events += [inference(f"r{i}", f"answer {i}"), inference(f"s{i}", f"other {i}")]
        events += [
            feedback(f"up{i}", f"r{i}", user, rating=1),
            feedback(f"pref{i}", f"s{i}", user, preferred_over=f"r{i}"),
        ]
    with store.begin() as connection:
        store_events(connection, events)

    dataset = build_dataset(load_new(store, "chat", 100), 0.3, lambda _prompt: None)

    trained = {e.answer for e in dataset.supervised} | {p.chosen.answer for p in dataset.pairs}
    judged = {j.example.answer for j in dataset.held_out}
    assert trained.isdisjoint(judged)
    held_numbers = {int(u.split("-")[1]) for u in held}
    assert judged == {f"answer {i}" for i in held_numbers} | {f"other {i}" for i in held_numbers}
    # +1 then passed over: r{i} is wanted once and unwanted once; s{i}, preferred, wanted
    assert sorted(j.wanted for j in dataset.held_out if j.example.answer == f"other {min(held_numbers)}") == [
        True
    ]
    assert Judged(Example(QUESTION, None, f"answer {min(held_numbers)}"), False) in dataset.held_out
    assert len(dataset.pairs) == len(users) - len(held)


def test_each_scope_learns_from_its_own_tenants_feedback_alone(store: Engine) -> None:
    """Two tenants training their own, one in the shared model, one training nothing: each scope's
    training set holds its own tenants' feedback and nobody else's."""
    trains = {"a": TRAINS_OWN, "b": TRAINS_OWN, "shared": TRAINS_SHARED, "off": TRAINS_NOTHING}
    scopes = {name: create_tenant(store, name, trains=how)[0] for name, how in trains.items()}
    events: list[InferenceEvent | FeedbackEvent] = []
    for tenant in trains:
        for i in range(3):
            events += [inference(f"{tenant}{i}", f"{tenant} says {i}", tenant=tenant)]
            events += [feedback(f"fb{i}", f"{tenant}{i}", f"user-{i}", tenant=tenant, rating=1)]
    with store.begin() as connection:
        store_events(connection, events)

    def learned(scope: Scope) -> set[str]:
        return {item.completion.split()[0] for item in load_new(store, "chat", 100, scope)}

    assert learned(SHARED) == {"shared"} and count_new(store, "chat", SHARED) == 3
    for name in ("a", "b"):
        own = Scope(name, scopes[name].id)
        assert learned(own) == {name} and count_new(store, "chat", own) == 3
    assert [s.tenant for s in learning_scopes(store)] == ["", "a", "b"]  # "off" trains nothing


def test_a_busy_user_gives_a_run_no_more_than_max_per_user_items(store: Engine) -> None:
    """One user rating ten times as much as each of the others: a run takes at most
    `max_per_user` of theirs (the oldest), the others' all; the rest waits for later runs."""
    events: list[InferenceEvent | FeedbackEvent] = []
    for i in range(30):
        events += [inference(f"busy{i}", f"busy {i}"), feedback(f"b{i}", f"busy{i}", "busy", rating=1)]
    for user in ("ann", "bob", "cy"):
        for i in range(3):
            request = f"{user}{i}"
            events += [inference(request, f"{user} {i}"), feedback(f"{user}{i}", request, user, rating=-1)]
    with store.begin() as connection:
        store_events(connection, events)

    assert count_new(store, "chat", SHARED, max_per_user=5) == 5 + 9
    taken = load_new(store, "chat", 100, SHARED, max_per_user=5)
    assert [i.completion for i in taken if i.user_id == "busy"] == [f"busy {i}" for i in range(5)]
    assert sum(i.user_id != "busy" for i in taken) == 9
    assert count_new(store, "chat", SHARED) == 39  # uncapped, every item counts


def test_completions_cut_to_fit_kafka_are_not_learned_from(store: Engine) -> None:
    """An inference event cut to REFLOW_MAX_EVENT_BYTES holds texts the user never saw whole: its
    feedback (and a preference over it) trains nothing, however it was rated."""
    whole = inference("whole", "a whole answer")
    cut = inference("cut", "a cut answ").model_copy(update={"truncated": True})
    events: list[InferenceEvent | FeedbackEvent] = [
        whole, cut,
        feedback("fb-whole", "whole", "ann", rating=1),
        feedback("fb-cut", "cut", "bob", rating=1),
        feedback("fb-pair", "whole", "cy", preferred_over="cut"),
    ]  # fmt: skip
    with store.begin() as connection:
        store_events(connection, events)

    taken = load_new(store, "chat", 100, SHARED)
    assert [i.feedback_id for i in taken] == ["fb-whole", "fb-pair"]
    assert count_new(store, "chat", SHARED) == 2
    assert taken[1].preferred_over is None  # the pair says nothing against a text cut short
