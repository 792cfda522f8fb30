"""The records on reflow's topics: inference events and feedback, as validated JSON.

JSON keeps the topics open to pipelines in any language that write feedback straight to Kafka;
the pydantic models below are the one place where a record's shape and limits are defined, for
the gateway, `reflow feedback ingest` and the consumer alike.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import to_json

from feedback.bus.kafka import FEEDBACK_TOPIC, INFERENCES_TOPIC, Record

MAX_ID_CHARS = 128
MAX_REQUEST_ID_CHARS = 64
MAX_USER_ID_CHARS = 256
MAX_VERSION_CHARS = 32  # versions and arms (alias names)
MAX_TEXT_CHARS = 4096
MAX_LABELS = 16
MAX_LABEL_CHARS = 256
MAX_MESSAGES = 256  # messages of one conversation
MAX_ROLE_CHARS = 32
MAX_COUNT = 2**31 - 1  # token counts fit the store's INTEGER columns


def _no_nul(value: str) -> str:
    """PostgreSQL text cannot hold NUL: a record with one could never be stored."""
    if "\x00" in value:
        raise ValueError("must not contain NUL (\\x00) characters")
    return value


def storable(text: str) -> str:
    """`text` with NUL characters replaced by U+FFFD: what a model generates may hold any byte."""
    return text.replace("\x00", "\ufffd")


# Every string is bounded like the column that stores it, and free of NUL characters.
NoNul = AfterValidator(_no_nul)
Id = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS), NoNul]
RequestId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_REQUEST_ID_CHARS), NoNul]
UserId = Annotated[str, StringConstraints(max_length=MAX_USER_ID_CHARS), NoNul]
VersionId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_VERSION_CHARS), NoNul]
Arm = Annotated[str, StringConstraints(max_length=MAX_VERSION_CHARS), NoNul]
Text = Annotated[str, NoNul]
Correction = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS), NoNul]
LabelText = Annotated[str, StringConstraints(max_length=MAX_LABEL_CHARS), NoNul]
Role = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ROLE_CHARS), NoNul]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def record(self, topic: str, key: str) -> Record:
        # unset optional fields are left out: a consumer older than a field still reads the record
        return Record(topic, key.encode(), self.model_dump_json(exclude_none=True).encode())


class TokenUsage(BaseModel):
    """Tokens of one generation."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt_tokens: Count
    completion_tokens: Count
    reasoning_tokens: Count


class Latency(BaseModel):
    """Milliseconds from receiving the request to its first token and to its end."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    first_token_ms: float = Field(ge=0)
    total_ms: float = Field(ge=0)


class Routing(BaseModel):
    """How the gateway placed a generation to meet its deadline (the response's `routing`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    variant: Arm = ""  # "" where its workers hold no variants
    latency_budget_ms: Count = 0  # the request's; 0 = none
    predicted_first_token_ms: float = Field(ge=0)
    predicted_total_ms: float = Field(ge=0)
    reasoning_budget: Count = 0  # applied; 0 = none


class ChatMessage(BaseModel):
    """One message of the conversation a chat completion continues."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Role
    content: Text


class InferenceEvent(_Event):
    """A finished generation, published by the gateway to `reflow.inferences`, keyed by request_id."""

    request_id: RequestId
    tenant: Id
    user_id: UserId = ""
    model: Id
    version: VersionId
    arm: Arm = ""
    experiment: int | None = Field(None, ge=1, le=MAX_COUNT)  # the experiment that assigned `arm`
    prompt: Text  # "" for a chat completion, whose conversation is `messages`
    # the conversation of a chat completion; None (left out of the record) for a prompt
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    reasoning: Text = ""
    completion: Text = ""
    finish_reason: Literal["STOP", "LENGTH", "CANCELLED", "ERROR", "TOOL_CALLS"]
    usage: TokenUsage
    latency: Latency
    # None (left out of the record) for a failed request, which was never placed
    routing: Routing | None = None
    time: AwareDatetime
    # True when its texts were cut to fit the largest record the gateway publishes; None = whole
    truncated: bool | None = None

    def to_record(self) -> Record:
        return self.record(INFERENCES_TOPIC, self.request_id)

    def within(self, max_bytes: int) -> InferenceEvent:
        """This event if its record's value fits in `max_bytes`; else a copy marked `truncated`
        whose texts (prompt, conversation, reasoning, completion) are cut to fit: each longer than
        a common length is cut to it, keeping its beginning, and shorter ones are left whole. One
        that cannot fit even with no text left is returned with none (Kafka refuses it)."""
        if len(self.to_record().value) <= max_bytes:
            return self
        texts: dict[str | int, str] = {
            "prompt": self.prompt, "reasoning": self.reasoning, "completion": self.completion
        }  # fmt: skip
        texts |= {i: m.content for i, m in enumerate(self.messages or ())}
        sizes = {name: len(to_json(text)) for name, text in texts.items()}  # bytes of JSON
        rest = len(self._with(texts).to_record().value) - sum(sizes.values())  # all but the texts
        level = _level(sorted(sizes.values()), max_bytes - rest)
        return self._with({name: _cut(text, sizes[name] - level) for name, text in texts.items()})

    def _with(self, texts: dict[str | int, str]) -> InferenceEvent:
        """A copy with these texts (messages by index), marked truncated."""
        messages = [m.model_copy(update={"content": texts[i]}) for i, m in enumerate(self.messages or ())]
        return self.model_copy(
            update={
                "prompt": texts["prompt"], "reasoning": texts["reasoning"], "completion": texts["completion"],
                "messages": messages if self.messages is not None else None, "truncated": True,
            }
        )  # fmt: skip


def _level(sizes: list[int], budget: int) -> int:
    """The largest level such that `sizes` (ascending), each cut to it, add up to `budget` at most."""
    for i, size in enumerate(sizes):
        share = budget // (len(sizes) - i)
        if size > share:
            return share
        budget -= size
    return sizes[-1]


def _cut(text: str, over: int) -> str:
    """The longest beginning of `text` whose JSON is at least `over` bytes shorter than its own."""
    if over <= 0:
        return text
    target = len(to_json(text)) - over
    kept, too_long = 0, len(text) + 1  # found by bisection: escapes make bytes per character vary
    while too_long - kept > 1:
        middle = (kept + too_long) // 2
        kept, too_long = (middle, too_long) if len(to_json(text[:middle])) <= target else (kept, middle)
    return text[:kept]


def stars_rating(stars: int) -> int:
    """The rating a 1-5 star score counts as: 1-2 -> -1, 3 -> 0, 4-5 -> +1."""
    return -1 if stars <= 2 else 0 if stars == 3 else 1


class FeedbackEvent(_Event):
    """What a user said of one completion, on `reflow.feedback`, keyed by the request_id it rates:
    a rating (or stars, which set it), a correction, a preference over another completion."""

    feedback_id: Id
    request_id: RequestId
    tenant: Id
    rating: Literal[-1, 0, 1]
    correction: Correction = ""
    user_id: UserId = ""
    labels: Annotated[dict[LabelText, LabelText], Field(max_length=MAX_LABELS)] = {}
    # the request_id of a completion of the same conversation the user liked less; None = none
    preferred_over: RequestId | None = None
    stars: Annotated[int, Field(ge=1, le=5)] | None = None  # None = none; `rating` follows them
    time: AwareDatetime

    @model_validator(mode="before")
    @classmethod
    def _rating_from_stars(cls, data: object) -> object:
        """Stars set the rating (a rating given beside them must agree); a preference needs no
        rating. The wire's empty values (0 stars, "" preferred_over) mean none."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if not (k in ("stars", "preferred_over") and v in (0, ""))}
        stars = data.get("stars")
        if isinstance(stars, int) and not isinstance(stars, bool) and 1 <= stars <= 5:
            rating, implied = data.get("rating", 0), stars_rating(stars)
            if rating not in (0, implied):
                raise ValueError(
                    f"rating {rating} disagrees with {stars} stars, which count as {implied:+d} "
                    "(1-2 stars: -1, 3: 0, 4-5: +1); send one of them"
                )
            data["rating"] = implied
        elif data.get("preferred_over") and "rating" not in data:
            data["rating"] = 0
        return data

    @field_validator("rating", "stars", mode="before")
    @classmethod
    def _integer(cls, value: object, info: ValidationInfo) -> object:
        """true/false or 1.0 are not ratings (pydantic would take them as 1 and 0)."""
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            allowed = "-1, 0 or 1" if info.field_name == "rating" else "1 to 5"
            raise ValueError(f"{info.field_name} must be the integer {allowed}, not {value!r}")
        return value

    @model_validator(mode="after")
    def _preferred_over_another(self) -> FeedbackEvent:
        if self.preferred_over == self.request_id:
            raise ValueError("preferred_over names the rated completion itself; name the other one")
        return self

    def to_record(self) -> Record:
        return self.record(FEEDBACK_TOPIC, self.request_id)


EVENT_TYPES: dict[str, type[InferenceEvent] | type[FeedbackEvent]] = {
    INFERENCES_TOPIC: InferenceEvent,
    FEEDBACK_TOPIC: FeedbackEvent,
}


class InvalidFeedback(ValueError):
    """A feedback item that cannot be accepted; the message says why, for the person who sent it."""

    code = "INVALID_ARGUMENT"


class NotYourRequest(InvalidFeedback):
    """Feedback on a completion that was not served to the submitting tenant."""

    code = "PERMISSION_DENIED"


FEEDBACK_FIELDS = (
    "feedback_id", "request_id", "rating", "correction", "user_id", "labels", "preferred_over", "stars",
)  # fmt: skip


def derive_feedback_id(event: FeedbackEvent) -> str:
    """A stable id for feedback sent without one: the same item sent twice gets the same id, so a
    retried stream or a re-ingested file is stored once."""
    content: list[object] = [
        event.tenant,
        event.request_id,
        event.rating,
        event.correction,
        event.user_id,
        event.labels,
    ]
    if event.preferred_over is not None or event.stars is not None:  # ids of items without them stay
        content += [event.preferred_over, event.stars]
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    return "fb_" + digest[:32]


def feedback_event(tenant: str, fields: dict[str, object], time: datetime) -> FeedbackEvent:
    """Validates one item submitted by `tenant`; InvalidFeedback names what is wrong."""
    unknown = sorted(set(fields) - set(FEEDBACK_FIELDS))
    if unknown:
        raise InvalidFeedback(f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(FEEDBACK_FIELDS)}")
    given_id = fields.get("feedback_id")
    try:
        event = FeedbackEvent.model_validate(
            {**fields, "feedback_id": given_id or "-", "tenant": tenant, "time": time}
        )
    except ValidationError as error:
        raise InvalidFeedback(describe(error)) from None
    return event if given_id else event.model_copy(update={"feedback_id": derive_feedback_id(event)})


def require_served(event: FeedbackEvent, served_to: Callable[[str, str], bool]) -> FeedbackEvent:
    """`event` when `served_to(request_id, tenant)` says it rates a completion served to its
    tenant (RequestIds.served_to); NotYourRequest otherwise."""
    for field, request_id in (("request_id", event.request_id), ("preferred_over", event.preferred_over)):
        if request_id is not None and not served_to(request_id, event.tenant):
            raise NotYourRequest(
                f"{field}: request {request_id!r} was not served to this tenant; "
                "rate only completions your API key received"
            )
    return event


def decode(topic: str, value: bytes | None) -> InferenceEvent | FeedbackEvent:
    """The event in a record of `topic`; ValueError saying why when it is malformed."""
    if value is None:
        raise ValueError("empty record (no value)")
    try:
        return EVENT_TYPES[topic].model_validate_json(value)
    except ValidationError as error:
        raise ValueError(describe(error)) from None


def describe(error: ValidationError) -> str:
    """A pydantic error as one line a person can act on, e.g. `rating: Input should be -1, 0 or 1`."""
    problems = []
    for item in error.errors(include_url=False):
        where = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if where else message)
    return "; ".join(problems)
