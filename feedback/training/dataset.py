"""The fine-tuning dataset: labelled feedback joined with the completions it rates, as examples.

A correction, or a completion rated +1, becomes a supervised example; every rated completion is
also a KTO example (+1 desirable, -1 undesirable). Items are split into train and held-out by a
hash of their feedback_id, so the same item always lands on the same side. Each item is used by
one fine-tune run at most: the run marks the items it takes (`feedback.finetune_run_id`), so
feedback that is joined late (its inference event came after it) is still used by a later run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Engine, Select, func, or_, select
from sqlalchemy.orm import Session

from feedback.tasks.task import Example
from reflow.store.tables import RATES, FeedbackItem, Inference
from workers.models.prompts import Prompt, conversation


@dataclass(frozen=True)
class RatedCompletion:
    """One labelled feedback item with the completion it rates."""

    id: int  # feedback.id: grows with arrival
    feedback_id: str
    prompt: str
    reasoning: str
    completion: str
    rating: int
    correction: str
    messages: list[dict[str, str]] = field(default_factory=list)  # a chat completion's conversation

    @property
    def model_prompt(self) -> Prompt:
        """What the model was given: the conversation of a chat completion, else the prompt text."""
        return conversation(self.messages) if self.messages else self.prompt


@dataclass
class Dataset:
    """Train examples by kind, and held-out prompts with the answer the users wanted."""

    supervised: list[Example] = field(default_factory=list)
    desirable: list[Example] = field(default_factory=list)
    undesirable: list[Example] = field(default_factory=list)
    held_out: list[tuple[Prompt, str]] = field(default_factory=list)  # (prompt, expected answer)
    size: int = 0  # labelled items it was built from
    digest: str = ""  # sha256 of the items, to recognise the same data

    @property
    def rated(self) -> int:
        return len(self.desirable) + len(self.undesirable)


def _unused_labelled(model: str) -> Select[FeedbackItem, Inference]:
    """Feedback on completions of `model` that says something (a rating or a correction) and that
    no fine-tune run has used yet."""
    joined = select(FeedbackItem, Inference).join(Inference, RATES)
    return joined.where(
        FeedbackItem.finetune_run_id.is_(None),
        Inference.model == model,
        Inference.finish_reason != "ERROR",  # a failed request has no completion to learn from
        or_(FeedbackItem.rating != 0, FeedbackItem.correction != ""),
    )


def count_new(engine: Engine, model: str) -> int:
    """Labelled feedback items on `model`, joined with their completions, that no run has used."""
    with Session(engine) as session:
        return session.scalar(select(func.count()).select_from(_unused_labelled(model).subquery())) or 0


def load_new(engine: Engine, model: str, limit: int) -> list[RatedCompletion]:
    """The oldest `limit` of them (the rest waits for the next run)."""
    with Session(engine) as session:
        rows = session.execute(_unused_labelled(model).order_by(FeedbackItem.id).limit(limit)).all()
    return [
        RatedCompletion(
            fb.id,
            fb.feedback_id,
            inf.prompt,
            inf.reasoning,
            inf.completion,
            fb.rating,
            fb.correction,
            list(inf.messages or []),
        )
        for fb, inf in rows
    ]


def is_held_out(feedback_id: str, fraction: float) -> bool:
    """A stable coin flip per item: True for about `fraction` of all feedback ids."""
    bucket = int.from_bytes(hashlib.sha256(feedback_id.encode()).digest()[:4], "big")
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
        digest.update(f"{item.feedback_id}\t{item.rating}\t{item.correction}\n".encode())
        prompt = item.model_prompt
        generated = Example(prompt, item.reasoning or None, item.completion)
        wanted = item.correction.strip() or (item.completion.strip() if item.rating > 0 else "")
        if is_held_out(item.feedback_id, holdout_fraction):
            if wanted:
                dataset.held_out.append((prompt, wanted))
            continue
        if item.correction.strip():
            dataset.supervised.append(Example(prompt, thought_for(item.prompt), item.correction.strip()))
        elif item.rating > 0:
            dataset.supervised.append(generated)
        if item.rating > 0:
            dataset.desirable.append(generated)
        elif item.rating < 0:
            dataset.undesirable.append(generated)
    dataset.digest = digest.hexdigest()
    return dataset
