"""Feedback validation (ratings, stars, corrections, preferences), derived feedback ids, and request
ids signed for their tenant."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from feedback.bus.kafka import INFERENCES_TOPIC
from feedback.events import InvalidFeedback, NotYourRequest, decode, feedback_event, require_served
from reflow.request_ids import RequestIds
from reflow.store.database import migrate, open_engine
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
    engine = open_engine(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(engine)
    ids, replica = RequestIds.from_store(engine), RequestIds.from_store(engine)  # one key, shared
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
