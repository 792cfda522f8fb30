"""The store's tables (SQLAlchemy ORM) and the timestamp helpers every process shares."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    and_,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    """Timezone-aware now, for timestamp columns."""
    return datetime.now(UTC)


def aware(moment: datetime) -> datetime:
    """`moment` with its time zone: SQLite hands timestamps back naive, and they were stored in UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    """Declarative base of every table; its metadata is what migrations target."""


# What a tenant's feedback trains (`tenants.trains`): nothing; the shared model, with every other
# tenant that opted into it; or its own versions, which only its own traffic is served and tests.
TRAINS_NOTHING, TRAINS_SHARED, TRAINS_OWN = "nothing", "shared", "own"
TRAINS = (TRAINS_NOTHING, TRAINS_SHARED, TRAINS_OWN)


DEFAULT_MAX_STREAMS = 32  # a new tenant's concurrent streams


class Tenant(Base):
    """A customer of the gateway: one API key (stored hashed), its quotas, and what its feedback trains."""

    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the key
    key_prefix: Mapped[str] = mapped_column(String(16))  # first characters, to recognise a key
    # the quotas (gateway/quotas.py); 0 = no limit
    max_concurrent_streams: Mapped[int] = mapped_column(Integer, default=DEFAULT_MAX_STREAMS)
    requests_per_minute: Mapped[int] = mapped_column(Integer, default=600)
    tokens_per_minute: Mapped[int] = mapped_column(Integer, default=0)  # prompt + completion tokens
    trains: Mapped[str] = mapped_column(String(8), default=TRAINS_SHARED, server_default=TRAINS_SHARED)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class Inference(Base):
    """One finished generation, as the gateway published it; the completion feedback rates."""

    __tablename__ = "inferences"

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    user_id: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(128))
    version: Mapped[str] = mapped_column(String(32))
    arm: Mapped[str] = mapped_column(String(32))  # its A/B arm, as assigned; "" when pinned
    prompt: Mapped[str] = mapped_column(Text)  # "" for a chat completion
    # the conversation of a chat completion ({"role", "content"} each); [] for a prompt
    messages: Mapped[list[dict[str, str]]] = mapped_column(JSON, default=list, server_default=text("'[]'"))
    reasoning: Mapped[str] = mapped_column(Text)
    completion: Mapped[str] = mapped_column(Text)
    finish_reason: Mapped[str] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    reasoning_tokens: Mapped[int] = mapped_column(Integer)
    first_token_ms: Mapped[float] = mapped_column(Float)
    total_ms: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))  # when it finished
    stored_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the experiment that assigned its arm; None outside experiments (and for pinned versions)
    experiment_id: Mapped[int | None] = mapped_column(Integer, index=True, default=None)
    # how the gateway placed it for its deadline (docs/latency.md); "" / 0 where it did not say
    variant: Mapped[str] = mapped_column(String(32), default="", server_default="")
    latency_budget_ms: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    predicted_total_ms: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    reasoning_budget: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # its texts were cut to fit a Kafka record (REFLOW_MAX_EVENT_BYTES): kept out of training sets
    truncated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class FeedbackItem(Base):
    """What a user said of a completion; joined with `inferences` on (request_id, tenant) when read.

    No foreign key: feedback may be stored before the inference event it rates arrives.
    `id` grows with arrival; `finetune_run_id` marks the fine-tune run that used the item.
    """

    __tablename__ = "feedback"
    # the idempotency key is the tenant's: one tenant's ids never collide with another's
    __table_args__ = (UniqueConstraint("tenant", "feedback_id", name="uq_feedback_tenant_feedback_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    feedback_id: Mapped[str] = mapped_column(String(128))
    request_id: Mapped[str] = mapped_column(String(64), index=True)
    tenant: Mapped[str] = mapped_column(String(128))
    rating: Mapped[int] = mapped_column(SmallInteger)  # -1, 0 or +1 (what `stars` count as, if given)
    correction: Mapped[str] = mapped_column(Text)
    user_id: Mapped[str] = mapped_column(String(256))
    labels: Mapped[dict[str, str]] = mapped_column(JSON)
    # the request_id of a completion of the same conversation the user liked less; "" = none
    preferred_over: Mapped[str] = mapped_column(String(64), default="", server_default="")
    stars: Mapped[int] = mapped_column(SmallInteger, default=0, server_default="0")  # 1-5; 0 = none
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))  # when it was submitted
    stored_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finetune_run_id: Mapped[int | None] = mapped_column(Integer, index=True, default=None)


# feedback joined with the completion it rates (feedback may arrive first: the join is made on read)
RATES = and_(Inference.request_id == FeedbackItem.request_id, Inference.tenant == FeedbackItem.tenant)


class FinetuneRun(Base):
    """One fine-tune job: the feedback it used, what it produced, and why it was (not) registered."""

    __tablename__ = "finetune_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(128))
    # the tenant whose own versions it trained, on its feedback alone; "" = the shared model
    tenant: Mapped[str] = mapped_column(String(128), default="", server_default="")
    parent_version: Mapped[str] = mapped_column(String(32))  # the champion it started from
    status: Mapped[str] = mapped_column(String(16), index=True)  # running, registered, rejected, failed
    first_feedback_id: Mapped[int] = mapped_column(Integer)  # feedback.id range it considered
    last_feedback_id: Mapped[int] = mapped_column(Integer)  # (items are marked with finetune_run_id)
    samples: Mapped[int] = mapped_column(Integer)  # labelled feedback items it used
    dataset_hash: Mapped[str] = mapped_column(String(64))
    mlflow_run_id: Mapped[str] = mapped_column(String(64), default="")
    version: Mapped[str] = mapped_column(String(32), default="")  # registered version, if any
    message: Mapped[str] = mapped_column(Text, default="")  # the gate's verdict or the error
    metrics: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class Experiment(Base):
    """An A/B test of a model's challenger against its champion on live traffic."""

    __tablename__ = "experiments"
    __table_args__ = (  # one running experiment per model and scope, even with two schedulers racing
        Index(
            "ix_experiments_one_running", "model", "tenant", unique=True,
            sqlite_where=text("status = 'running'"), postgresql_where=text("status = 'running'"),
        ),
    )  # fmt: skip

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(128))
    # the tenant whose own versions it tests, on its traffic alone; "" = the shared model's
    tenant: Mapped[str] = mapped_column(String(128), default="", server_default="")
    champion_version: Mapped[str] = mapped_column(String(32))
    challenger_version: Mapped[str] = mapped_column(String(32))
    traffic: Mapped[float] = mapped_column(Float)  # share of assignment units sent to the challenger
    # running, promoted, rolled_back, invalid (sample ratio mismatch), expired, or ended (aliases
    # moved by hand)
    status: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")  # why it ended
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class ExperimentDecision(Base):
    """One evaluation of a running experiment: the numbers per arm and what was decided."""

    __tablename__ = "experiment_decisions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    experiment_id: Mapped[int] = mapped_column(ForeignKey("experiments.id"), index=True)
    outcome: Mapped[str] = mapped_column(String(16))  # continue, promote, rollback, invalid, expire
    reason: Mapped[str] = mapped_column(Text)
    champion: Mapped[dict[str, Any]] = mapped_column(JSON)  # the arm's ArmStats (feedback.experiments)
    challenger: Mapped[dict[str, Any]] = mapped_column(JSON)
    likelihood_ratio: Mapped[float] = mapped_column(Float)
    difference: Mapped[float] = mapped_column(Float)  # challenger rate minus champion rate
    srm_p: Mapped[float] = mapped_column(Float)
    decided_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Secret(Base):
    """A named server-side secret shared by every gateway replica (e.g. the request-id signing key)."""

    __tablename__ = "secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Lease(Base):
    """A named lease that one process at a time holds by renewing it before it expires (the
    scheduler's: reflow/store/leases.py)."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
