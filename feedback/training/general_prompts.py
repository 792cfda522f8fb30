"""General prompts, in two disjoint sets: the fine-tune job replays the champion's answers to one
against forgetting, and the gate measures how far a candidate moves from the champion on the other
(so a candidate is never judged on what it was held to in training).

The defaults are everyday chat. A model whose users' world is not (a code model, the demo's
arithmetic model) gets its own from REFLOW_GENERAL_PROMPTS_FILE: one prompt per line, every other
line replayed and the rest judging drift. Only the champion's own answers to them are used, never
an answer key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MIN_PROMPTS = 4  # two a side

# Everyday requests of many kinds (none of them a task's prompt, nor one of a task's base prompts), so
# that a candidate which learned its task by forgetting how to chat moves far from the champion here.
REGRESSION_PROMPTS: tuple[str, ...] = (
    "Explain how the moon causes tides.",
    "Explain what a credit score is.",
    "Explain why ice floats on water.",
    "Explain how a library organizes its books.",
    "Explain what the internet is to a child.",
    "Explain why it is important to wash your hands.",
    "List three ways to reduce stress after work.",
    "List some vegetables that grow well in pots.",
    "List four things to check before a long car trip.",
    "List three good habits for saving money.",
    "List a few ideas for a child's birthday party.",
    "Write a short poem about the rain.",
    "Write a short welcome message for a new club member.",
    "Write a haiku about a mountain.",
    "Write a short note asking a neighbour to water my plants.",
    "Write two sentences describing a quiet forest.",
    "Define the word 'curiosity'.",
    "Define what a verb is.",
    "Define the term 'recycling'.",
    "Define what a volcano is.",
    "How do I boil an egg?",
    "How can I learn new words in a foreign language?",
    "How do birds know where to fly in winter?",
    "Why do we dream?",
    "Why is exercise good for the heart?",
    "Give me a simple recipe for a fruit salad.",
    "Give me some tips for a good night's sleep before an exam.",
    "Suggest a title for a story about a brave mouse.",
    "Summarize the story of Cinderella.",
    "Describe the smell of fresh bread.",
    "Tell me a fun fact about the ocean.",
    "What are the benefits of learning to cook?",
)

# The same kinds of requests, none of them above: what a run replays (the champion's own greedy
# answers to them, computed once per run), whatever its users ask.
REPLAY_PROMPTS: tuple[str, ...] = (
    "Explain how a rainbow forms.",
    "Explain what a budget is.",
    "Explain why leaves change colour in autumn.",
    "Explain how a bicycle stays upright.",
    "Explain what a museum is for.",
    "Explain why we need sleep.",
    "List three ways to make new friends in a new city.",
    "List some fruits that are rich in vitamin C.",
    "List four things to pack for a day at the beach.",
    "List three tips for writing a clear email.",
    "List a few games to play on a rainy day.",
    "Write a short poem about the sea.",
    "Write a short thank-you note to a teacher.",
    "Write a haiku about autumn leaves.",
    "Write a short invitation to a picnic.",
    "Write two sentences describing a busy market.",
    "Define the word 'kindness'.",
    "Define what a noun is.",
    "Define the term 'climate'.",
    "Define what a desert is.",
    "How do I make a cup of tea?",
    "How can I remember names better?",
    "How do bees make honey?",
    "Why is the sky blue?",
    "Why do cats purr?",
    "Give me a simple recipe for pancakes.",
    "Give me some tips for staying focused while studying.",
    "Suggest a name for a friendly robot.",
    "Summarize the story of Little Red Riding Hood.",
    "Describe the sound of a thunderstorm.",
    "Tell me a fun fact about elephants.",
    "What are the benefits of reading every day?",
    "Explain how plants drink water.",
    "List three ways to save water at home.",
    "Write a short message wishing a friend good luck.",
    "How do I plant a tree?",
    "Why do we have seasons?",
    "Give me some ideas for a healthy breakfast.",
    "Describe a sunset over the mountains.",
    "Tell me a fun fact about the moon.",
)


@dataclass(frozen=True)
class GeneralPrompts:
    """What a run replays, and what the gate measures drift on."""

    replay: tuple[str, ...] = REPLAY_PROMPTS
    regression: tuple[str, ...] = REGRESSION_PROMPTS

    @classmethod
    def from_file(cls, path: str | Path) -> GeneralPrompts:
        """The file's non-blank lines, every other one replayed; ValueError when it has too few."""
        lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        if len(lines) < MIN_PROMPTS:
            raise ValueError(
                f"{path} holds {len(lines)} prompts; general prompts need {MIN_PROMPTS} at least"
            )
        return cls(tuple(lines[0::2]), tuple(lines[1::2]))


DEFAULT_GENERAL_PROMPTS = GeneralPrompts()
