"""The fine-tuning dataset: what users said of completions, joined with the completions, as examples.

No answer key is needed: a correction, or a completion rated +1, becomes a supervised example
(rejection-sampling fine-tuning on what users liked); every rated completion is a KTO example (+1
desirable, -1 undesirable); a preference of one completion over another of the same conversation
is a DPO pair. Items are split into train and held-out by user (a hash of user_id; an item without
one is a user of its own), so one user's items are never on both sides and the gate judges a
candidate on people it did not learn from. Each item is used by one fine-tune run at most: the
run marks the items it takes (`feedback.finetune_run_id`), so feedback that is joined late (its
inference event came after it) is still used by a later run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Engine, Select, func, or_, select
from sqlalchemy.orm import Session

from feedback.tasks.task import Example
from reflow.scopes import SHARED, Scope
from reflow.store.tables import RATES, TRAINS_OWN, TRAINS_SHARED, FeedbackItem, Inference, Tenant
from workers.models.prompts import Prompt, conversation


@dataclass(frozen=True, kw_only=True)
class RatedCompletion:
    """One feedback item that says something, with the completion it rates."""

    id: int  # feedback.id: grows with arrival
    feedback_id: str
    prompt: str
    reasoning: str
    completion: str
    rating: int
    correction: str
    messages: list[dict[str, str]] = field(default_factory=list)  # a chat completion's conversation
    user_id: str = ""
    # the completion it was preferred over, when that one answered the same conversation
    preferred_over: Example | None = None

    @property
    def model_prompt(self) -> Prompt:
        """What the model was given: the conversation of a chat completion, else the prompt text."""
        return conversation(self.messages) if self.messages else self.prompt


@dataclass(frozen=True)
class Pair:
    """Two completions of one prompt, the first preferred (a DPO pair)."""

    chosen: Example
    rejected: Example


@dataclass(frozen=True)
class Judged:
    """A held-out completion and whether users wanted it (a correction, +1 or preferred) or not."""

    example: Example
    wanted: bool


@dataclass
class Dataset:
    """Train examples by kind, and held-out completions the gate judges a candidate on."""

    supervised: list[Example] = field(default_factory=list)
    desirable: list[Example] = field(default_factory=list)
    undesirable: list[Example] = field(default_factory=list)
    pairs: list[Pair] = field(default_factory=list)
    held_out: list[Judged] = field(default_factory=list)
    held_out_answers: list[tuple[Prompt, str]] = field(default_factory=list)  # (prompt, wanted answer)
    size: int = 0  # feedback items it was built from
    digest: str = ""  # sha256 of the items, to recognise the same data

    @property
    def rated(self) -> int:
        return len(self.desirable) + len(self.undesirable)


def _unused_labelled(model: str, scope: Scope, max_per_user: int) -> Select[tuple[int]]:
    """The ids of feedback on completions of `model` served in `scope` that says something (a
    rating, a correction or a preference) and that no fine-tune run has used yet: of the shared
    model, what tenants in it said; of a tenant's own, what that tenant said, while it trains its
    own. Each user's oldest `max_per_user` items only (the rater, else the user served, else the
    completion: one busy user cannot outweigh the others); the rest waits for later runs."""
    user = func.coalesce(
        func.nullif(FeedbackItem.user_id, ""), func.nullif(Inference.user_id, ""), FeedbackItem.request_id
    )
    rank = func.row_number().over(partition_by=(FeedbackItem.tenant, user), order_by=FeedbackItem.id)
    # a tenant the store does not know (rows written by hand) counts as in the shared model, as
    # every tenant was before tenants chose; the gateway and `reflow feedback ingest` serve and
    # take only known tenants, and tenants are revoked, never deleted
    trains = func.coalesce(Tenant.trains, TRAINS_SHARED)
    whose = (
        (trains == TRAINS_OWN, Inference.tenant == scope.tenant)
        if scope.tenant
        else (trains == TRAINS_SHARED,)
    )
    ranked = (
        select(FeedbackItem.id, rank.label("rank"))
        .join(Inference, RATES)
        .outerjoin(Tenant, Tenant.name == Inference.tenant)
        .where(
            FeedbackItem.finetune_run_id.is_(None),
            Inference.model == model,
            # a failed request has no completion to learn from; one that called tools has its calls
            # outside the completion the event records (docs/tool-calls.md#what-the-loop-learns)
            Inference.finish_reason.not_in(("ERROR", "TOOL_CALLS")),
            Inference.truncated.is_(False),  # cut to fit Kafka: not the texts the user rated
            or_(FeedbackItem.rating != 0, FeedbackItem.correction != "", FeedbackItem.preferred_over != ""),
            *whose,
        )
        .subquery()
    )
    return select(ranked.c.id).where(ranked.c.rank <= max_per_user)


def count_new(db: Engine, model: str, scope: Scope = SHARED, max_per_user: int = 2**31 - 1) -> int:
    """Labelled feedback items on `model` in `scope`, joined with their completions, that no run
    has used (at most `max_per_user` of each user)."""
    with Session(db) as session:
        unused = _unused_labelled(model, scope, max_per_user).subquery()
        return session.scalar(select(func.count()).select_from(unused)) or 0


def load_new(
    db: Engine, model: str, limit: int, scope: Scope = SHARED, max_per_user: int = 2**31 - 1
) -> list[RatedCompletion]:
    """The oldest `limit` of them (the rest waits for the next run), each preference with the
    completion it was preferred over (left out when that one is not stored or answered another
    conversation: the pair says nothing then)."""
    with Session(db) as session:
        ids = _unused_labelled(model, scope, max_per_user).order_by("id").limit(limit).subquery()
        rows = session.execute(
            select(FeedbackItem, Inference)
            .join(Inference, RATES)
            .where(FeedbackItem.id.in_(select(ids.c.id)))
            .order_by(FeedbackItem.id)
        ).all()
        others = {fb.preferred_over for fb, _ in rows if fb.preferred_over}
        losers = {
            (other.request_id, other.tenant): other
            for other in session.scalars(select(Inference).where(Inference.request_id.in_(others)))
        } if others else {}  # fmt: skip
    items = []
    for fb, inf in rows:
        loser = losers.get((fb.preferred_over, fb.tenant))
        paired = loser is not None and loser.finish_reason != "ERROR" and not loser.truncated and (
            (loser.prompt, loser.messages) == (inf.prompt, inf.messages)
        )  # fmt: skip
        items.append(
            RatedCompletion(
                id=fb.id, feedback_id=fb.feedback_id, prompt=inf.prompt, reasoning=inf.reasoning,
                completion=inf.completion, rating=fb.rating, correction=fb.correction,
                messages=list(inf.messages or []), user_id=fb.user_id,
                preferred_over=generated(loser, inf) if loser is not None and paired else None,
            )
        )  # fmt: skip
    return items


def generated(inference: Inference, like: Inference) -> Example:
    """`inference`'s completion, as the model generated it for `like`'s (the same) prompt."""
    prompt = conversation(like.messages) if like.messages else like.prompt
    return Example(prompt, inference.reasoning or None, inference.completion)


def is_held_out(key: str, fraction: float) -> bool:
    """A stable coin flip per key (a user, or an item without one): True for about `fraction` of keys."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big")
    return bucket < fraction * 2**32


def build_dataset(
    items: list[RatedCompletion], holdout_fraction: float, thought_for: Callable[[str], str | None]
) -> Dataset:
    """Examples from `items`, each prompt as the model was given it; `thought_for(prompt)` gives the
    reasoning a correction is taught with (the task's canonical one, or None to teach the bare
    answer)."""
    dataset = Dataset(size=len(items))
    digest = hashlib.sha256()
    for item in items:
        digest.update(
            f"{item.feedback_id}\t{item.rating}\t{item.correction}\t{item.preferred_over}\n".encode()
        )
        prompt = item.model_prompt
        generated = Example(prompt, item.reasoning or None, item.completion)
        correction = item.correction.strip()
        fixed = Example(prompt, thought_for(item.prompt), correction) if correction else None
        if is_held_out(item.user_id or item.feedback_id, holdout_fraction):
            dataset.held_out += [Judged(e, True) for e in (fixed,) if e is not None]
            if item.rating or item.preferred_over is not None:
                dataset.held_out.append(Judged(generated, item.rating >= 0))
            if item.preferred_over is not None:
                dataset.held_out.append(Judged(item.preferred_over, False))
            if wanted := correction or (item.completion.strip() if item.rating > 0 else ""):
                dataset.held_out_answers.append((prompt, wanted))
            continue
        if fixed is not None:
            dataset.supervised.append(fixed)
        elif item.rating > 0:
            dataset.supervised.append(generated)
        if item.rating > 0:
            dataset.desirable.append(generated)
        elif item.rating < 0:
            dataset.undesirable.append(generated)
        if item.preferred_over is not None:
            dataset.pairs.append(Pair(fixed or generated, item.preferred_over))
    dataset.digest = digest.hexdigest()
    return dataset
