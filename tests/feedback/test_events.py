"""Feedback validation, derived feedback ids, and request ids signed for their tenant."""

from __future__ import annotations

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
    assert not RequestIds(b"another key").served_to(request_id, "acme")
