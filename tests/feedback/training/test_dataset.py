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
from reflow.store.tables import utcnow
from tests.support.store import migrated_store

QUESTION = (("user", "Any tips for sleeping better?"),)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Engine]:
    yield from migrated_store(f"sqlite:///{tmp_path / 'store.db'}")


def inference(request_id: str, completion: str, question: str = QUESTION[0][1]) -> InferenceEvent:
    return InferenceEvent(
        request_id=request_id, tenant="acme", model="chat", version="1", prompt="",
        messages=[ChatMessage(role="user", content=question)], completion=completion, finish_reason="STOP",
        usage=TokenUsage(prompt_tokens=5, completion_tokens=5, reasoning_tokens=0),
        latency=Latency(first_token_ms=1.0, total_ms=2.0), time=utcnow(),
    )  # fmt: skip


def feedback(feedback_id: str, request_id: str, user: str, **fields: object) -> FeedbackEvent:
    return FeedbackEvent.model_validate(
        {"feedback_id": feedback_id, "request_id": request_id, "tenant": "acme", "user_id": user,
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
