"""The `numbered` chat task: everyday requests from users who like answers laid out as a numbered list.

A preference, not an answer key: any answer that lays itself out as a numbered list (a line that
starts "1." or "1)": answers are cut at max_tokens, so the list's first item is what shows) pleases
these users, any other displeases them, and no answer is the right
one, so they only ever click thumbs (`answer` is None: they have no correction to give). Some
requests invite a list ("Give me some tips for ..."), most do not ("Tell me about ..."), so a chat
model meets the preference some of the time unprompted: what the learning loop can learn from thumbs alone
(benchmarks/thumbs_loop.py).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import ClassVar

TOPICS = (
    "getting better sleep", "saving money on groceries", "learning a new language", "keeping a plant alive",
    "staying focused at work", "training a puppy", "cooking rice", "preparing for a job interview",
    "running a first 5k", "packing for a weekend trip", "writing a cover letter", "keeping a kitchen clean",
    "reading more books", "making new friends", "starting to meditate", "planning a birthday party",
    "staying warm in winter", "drinking more water", "organising a closet", "taking better photos",
    "studying for an exam", "growing tomatoes", "reducing screen time", "baking bread",
)  # fmt: skip

# Some invite a list, most do not: SmolLM2-135M-Instruct, sampled at 0.9 for 48 tokens, answered with
# one 62%, 50%, 31%, 25%, 19%, 19%, 6% and 6% of the time (16 topics each): about 27% in all.
FRAMINGS = (
    "Give me some tips for {topic}.",
    "What are some ways of {topic}?",
    "Any advice on {topic}?",
    "I need help with {topic}. Any advice?",
    "How do I get started with {topic}?",
    "What should I know about {topic}?",
    "Tell me about {topic}.",
    "Can you help me with {topic}?",
)

# A numbered list's first item: "1." (or "1)") and text, at the start of a line.
_FIRST_ITEM = re.compile(r"^\s*1[.)]\s+\S", re.MULTILINE)


def has_numbered_list(answer: str) -> bool:
    """Whether `answer` lays something out as a numbered list (one that starts at item 1)."""
    return _FIRST_ITEM.search(answer) is not None


@dataclass(frozen=True)
class Numbered:
    """The `numbered` task: users who rate +1 an answer with a numbered list and -1 any other."""

    name: ClassVar[str] = "numbered"
    chat: ClassVar[bool] = True

    def base_prompts(self, n: int, rng: random.Random) -> list[str]:
        return self.traffic_prompts(n, rng)  # the same requests: only the users' taste is new

    def traffic_prompts(self, n: int, rng: random.Random) -> list[str]:
        return [rng.choice(FRAMINGS).format(topic=rng.choice(TOPICS)) for _ in range(n)]

    def answer(self, prompt: str) -> str | None:
        return None  # a taste, not an answer key: no correction to give

    def is_correct(self, prompt: str, answer: str) -> bool:
        return has_numbered_list(answer)

    def thought(self, prompt: str) -> str | None:
        return None
