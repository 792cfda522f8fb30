"""Feedback validation (ratings, stars, corrections, preferences), derived feedback ids, request
ids signed for their tenant, and inference events cut to fit a record."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from feedback.bus.kafka import INFERENCES_TOPIC
from feedback.events import (
    ChatMessage,
    InferenceEvent,
    InvalidFeedback,
    Latency,
    NotYourRequest,
    TokenUsage,
    decode,
    feedback_event,
    require_served,
)
from reflow.request_ids import RequestIds
from reflow.store.database import migrate, open_db
from reflow.store.tables import utcnow


def event(**fields: object):
    return feedback_event("acme", {"request_id": "r1", "rating": 1, **fields}, utcnow())


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"rating": 2}, "rating"),
        ({"rating": True}, "rating must be the integer"),
        ({"rating": "1"}, "rating must be the integer"),
        ({"request_id": ""}, "request_id"),
        ({"correction": "x" * 4097}, "correction"),
        ({"user_id": "u" * 257}, "user_id"),
        ({"request_id": "r" * 65}, "request_id"),
        ({"correction": "4\x002"}, "NUL"),
        ({"labels": {"k\x00": "v"}}, "NUL"),
        ({"correction": "4\ud8002"}, "unicode string"),  # a lone surrogate (JSON's \\ud800)
        ({"labels": {f"k{i}": "v" for i in range(17)}}, "labels"),
        ({"labels": {"k": "v" * 257}}, "labels"),
        ({"score": 3}, "unknown field(s) score"),
        ({"stars": 6}, "stars"),
        ({"stars": True}, "stars must be the integer 1 to 5"),
        ({"stars": 2, "rating": 1}, "rating 1 disagrees with 2 stars, which count as -1"),
        ({"preferred_over": "r1"}, "preferred_over names the rated completion itself"),
        ({"preferred_over": "r" * 65}, "preferred_over"),
    ],
)
def test_invalid_feedback_says_what_is_wrong(fields: dict, complaint: str) -> None:
    with pytest.raises(InvalidFeedback, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        event(**fields)


def test_feedback_without_an_id_gets_one_derived_from_its_content() -> None:
    first, again = event(correction="42"), event(correction="42", feedback_id="")
    assert first.feedback_id == again.feedback_id and first.feedback_id.startswith("fb_")
    assert event(correction="43").feedback_id != first.feedback_id
    assert event(rating=-1, correction="42").feedback_id != first.feedback_id
    assert feedback_event(
        "other", {"request_id": "r1", "rating": 1, "correction": "42"}, utcnow()
    ).feedback_id != (first.feedback_id)
    assert event(feedback_id="mine").feedback_id == "mine"
    # an item without preferred_over or stars keeps the id it had before they existed
    content = json.dumps(["acme", "r1", 1, "42", "", {}], sort_keys=True).encode()
    assert first.feedback_id == "fb_" + hashlib.sha256(content).hexdigest()[:32]
    assert event(preferred_over="r0").feedback_id != event().feedback_id


@pytest.mark.parametrize(("stars", "rating"), [(1, -1), (2, -1), (3, 0), (4, 1), (5, 1)])
def test_stars_count_as_the_rating_of_their_half(stars: int, rating: int) -> None:
    given = feedback_event("acme", {"request_id": "r1", "stars": stars}, utcnow())
    assert (given.stars, given.rating) == (stars, rating)
    assert event(stars=stars, rating=rating).rating == rating  # a rating beside them must agree
    assert event(stars=stars, rating=0).rating == rating  # the wire's unset rating


def test_a_preference_needs_no_rating_and_the_wires_empty_values_mean_none() -> None:
    preferred = feedback_event("acme", {"request_id": "r1", "preferred_over": "r0"}, utcnow())
    assert (preferred.rating, preferred.preferred_over, preferred.stars) == (0, "r0", None)
    from_grpc = event(preferred_over="", stars=0)  # what an unset proto field reads as
    assert (from_grpc.preferred_over, from_grpc.stars, from_grpc.rating) == (None, None, 1)
    # a record without them is what a consumer older than them reads
    assert "preferred_over" not in from_grpc.to_record().value.decode()
    with pytest.raises(InvalidFeedback, match="rating: Field required"):
        feedback_event("acme", {"request_id": "r1", "correction": "42"}, utcnow())


def test_a_malformed_record_is_described() -> None:
    with pytest.raises(ValueError, match="JSON"):
        decode(INFERENCES_TOPIC, b"{")
    with pytest.raises(ValueError, match="empty record"):
        decode(INFERENCES_TOPIC, None)
    with pytest.raises(ValueError, match="prompt: Field required"):
        decode(INFERENCES_TOPIC, b'{"request_id": "r"}')


def test_request_ids_are_signed_for_their_tenant(tmp_path: Path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(db)
    ids, replica = RequestIds.from_store(db), RequestIds.from_store(db)  # one key, shared
    request_id = ids.new("acme")
    assert len(request_id) == 48 and request_id != ids.new("acme")
    assert replica.served_to(request_id, "acme")
    assert not ids.served_to(request_id, "globex")
    forged = request_id[:-1] + ("0" if request_id[-1] != "0" else "1")
    assert not ids.served_to(forged, "acme")
    assert not ids.served_to("short", "acme")
    assert not ids.served_to("é" * 48, "acme")  # refused, not an error
    assert require_served(event(request_id=request_id), ids.served_to).request_id == request_id
    with pytest.raises(NotYourRequest, match="not served to this tenant"):
        require_served(event(request_id=ids.new("globex")), ids.served_to)
    mine = ids.new("acme")
    assert (
        require_served(event(request_id=request_id, preferred_over=mine), ids.served_to).preferred_over
        == mine
    )
    with pytest.raises(NotYourRequest, match=r"preferred_over: request .* was not served to this tenant"):
        require_served(event(request_id=request_id, preferred_over=ids.new("globex")), ids.served_to)
    assert not RequestIds(b"another key").served_to(request_id, "acme")


def inference(**texts: object) -> InferenceEvent:
    return InferenceEvent(
        request_id="r1", tenant="acme", model="m", version="1", finish_reason="STOP",
        usage=TokenUsage(prompt_tokens=1, completion_tokens=1, reasoning_tokens=0),
        latency=Latency(first_token_ms=1.0, total_ms=2.0), time=utcnow(), **{"prompt": "", **texts},
    )  # fmt: skip


MAX_BYTES = 100_000


def test_an_event_that_fits_is_left_whole() -> None:
    whole = inference(prompt="12+30=", completion="42")
    assert whole.within(MAX_BYTES) is whole
    assert "truncated" not in json.loads(whole.to_record().value)  # older consumers read it as before


@pytest.mark.parametrize("character", ["x", "é", "🙂", "\n"])  # 1 to 4 bytes of UTF-8; 2 of JSON
def test_an_event_over_the_bound_has_its_long_texts_cut_to_fit_and_says_so(character: str) -> None:
    prompt, reasoning, completion = character * 150_000, "r" * 20_000, "c" * 30_000
    cut = inference(prompt=prompt, reasoning=reasoning, completion=completion).within(MAX_BYTES)
    value = cut.to_record().value
    assert MAX_BYTES - 4 < len(value) <= MAX_BYTES  # no more cut than needed (one character at most)
    assert cut.truncated is True and json.loads(value)["truncated"] is True
    assert prompt.startswith(cut.prompt) and len(cut.prompt) < len(prompt)  # its beginning kept
    assert (cut.reasoning, cut.completion) == (reasoning, completion)  # short enough: left whole
    assert decode(INFERENCES_TOPIC, value) == cut  # the consumer takes it


def test_a_conversation_and_its_completion_are_cut_to_one_length() -> None:
    messages = [ChatMessage(role="user", content=c * n) for c, n in (("a", 60_000), ("b", 70_000), ("c", 10))]
    cut = inference(messages=messages, completion="d" * 60_000).within(MAX_BYTES)
    assert MAX_BYTES - 3 < len(cut.to_record().value) <= MAX_BYTES and cut.truncated
    assert cut.messages is not None
    a, b, c = (m.content for m in cut.messages)  # every message kept, in order
    assert a == "a" * len(a) and b == "b" * len(b) and c == "c" * 10
    assert len(a) == len(b) == len(cut.completion) < 60_000
