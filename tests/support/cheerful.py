"""A taste the demo model can be taught by thumbs alone, for the learning loop's tests.

`Cheerful` is the arith task whose reference answers end with "!" half the time (a seeded coin per
answer), so a model trained on it, sampled, answers cheerfully about half the time; its users like
"!" and dislike the rest, whether the sum is right or not. The model sometimes does what they want
and nothing tells it why: what thumbs can teach. (The arith model alone cannot be taught its sums by
thumbs: its mistakes are the same at every temperature, so users never see it get one right.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from feedback.tasks.arith import Arith


@dataclass(frozen=True)
class Cheerful(Arith):
    """arith with a cheerful "!" on half of its reference answers, and users who like only those."""

    coin: random.Random = field(default_factory=lambda: random.Random(0), compare=False)

    def answer(self, prompt: str) -> str | None:
        plain = super().answer(prompt)
        return plain if plain is None or self.coin.random() < 0.5 else plain + "!"

    def is_correct(self, prompt: str, answer: str) -> bool:
        """The users' taste: an answer that ends with "!"."""
        return answer.strip().endswith("!")


@dataclass(frozen=True)
class Plain(Cheerful):
    """The opposite taste: users who like an answer without "!" and dislike the cheerful ones."""

    def is_correct(self, prompt: str, answer: str) -> bool:
        return not super().is_correct(prompt, answer)
