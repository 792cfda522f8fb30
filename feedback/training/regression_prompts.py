"""A fixed set of general chat prompts: the gate measures how far a candidate's answers move from the
champion's on them."""

from __future__ import annotations

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
