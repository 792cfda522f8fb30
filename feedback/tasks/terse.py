"""The `terse` chat task: a fact, a question about it, and users who want only the answer, not a sentence.

Each traffic prompt states one fact about a person ("Maya lives in Lisbon.") and asks about it
("Where does Maya live?"); the answer is in the prompt, so a chat model knows it, but users want just
that answer ("Lisbon", "7"), and SmolLM2-135M-Instruct answers in a sentence: a format preference the
learning loop can learn from their corrections. Measured greedily (chat template, 48 new tokens, 320
prompts): the base model gives 0% bare answers, and a rank-8 LoRA trained on 250 corrections (80 steps of
8, lr 1e-3) gives 100%. The base distribution is everyday chat (explain, list, write, define), replayed
with the champion's own answers so the model keeps its manners there: trained on corrections alone,
it answers those in one word too.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import ClassVar

NAMES = (
    "Maya", "Tom", "Anna", "Leo", "Sara", "Omar", "Lina", "Ben", "Nora", "Sam", "Ivy", "Max", "Zoe",
    "Adam", "Ella", "Hugo", "Mia", "Noah", "Ruth", "Eli", "Kate", "Luis", "Ada", "Finn", "Rosa", "Ian",
    "Jade", "Paul", "Yara", "Dan",
)  # fmt: skip

# Things a person has a count of; counts are small enough that the prompt's digits are the answer.
THINGS = ("cats", "books", "brothers", "sisters", "bikes", "plants", "cousins", "guitars", "coins", "hats")
COUNTS = tuple(str(n) for n in range(2, 20))


@dataclass(frozen=True)
class Attribute:
    """One kind of fact: its values, the sentences stating it and the questions asking it.

    Sentences and questions are templates over `{name}`, `{value}` and, for counts, `{things}`.
    """

    values: tuple[str, ...]
    facts: tuple[str, ...]
    questions: tuple[str, ...]


# Values are single words that need no article of their own ("a doctor" is in the template, and
# every job starts with a consonant), so the answer is exactly the value.
ATTRIBUTES = (
    Attribute(
        ("Paris", "London", "Madrid", "Berlin", "Rome", "Tokyo", "Cairo", "Lima", "Oslo", "Dublin",
         "Vienna", "Lisbon", "Prague", "Athens", "Nairobi", "Seoul", "Toronto", "Warsaw"),
        ("{name} lives in {value}.", "{name} moved to {value} last year and still lives there."),
        ("Where does {name} live?", "Which city does {name} live in?", "What city is {name}'s home?"),
    ),
    Attribute(
        ("red", "blue", "green", "yellow", "purple", "orange", "pink", "black", "white", "brown", "grey"),
        ("{name}'s favourite colour is {value}.", "{name} likes {value} more than any other colour."),
        ("What is {name}'s favourite colour?", "Which colour does {name} like best?"),
    ),
    Attribute(
        ("dog", "cat", "rabbit", "parrot", "hamster", "turtle", "goldfish", "snake", "horse", "pony"),
        ("{name} has a pet {value}.", "{name} takes care of a {value} at home."),
        ("What pet does {name} have?", "What kind of animal is {name}'s pet?"),
    ),
    Attribute(
        ("doctor", "teacher", "baker", "pilot", "nurse", "farmer", "lawyer", "chef", "painter",
         "plumber", "dentist", "tailor", "banker", "writer", "singer", "driver"),
        ("{name} works as a {value}.", "{name} is a {value} by profession."),
        ("What is {name}'s job?", "What does {name} do for a living?"),
    ),
    Attribute(
        ("tennis", "football", "golf", "hockey", "basketball", "volleyball", "cricket", "rugby",
         "baseball", "badminton"),
        ("{name} plays {value} every weekend.", "{name}'s favourite sport is {value}."),
        ("What sport does {name} play?", "Which sport does {name} like?"),
    ),
    Attribute(
        COUNTS,
        ("{name} has {value} {things}.", "{name} owns exactly {value} {things}."),
        ("How many {things} does {name} have?", "What is the number of {things} {name} has?"),
    ),
    Attribute(
        tuple(str(n) for n in range(21, 80)),
        ("{name} is {value} years old.", "{name} turned {value} this spring."),
        ("How old is {name}?", "What is {name}'s age?"),
    ),
)  # fmt: skip

# How a user puts the fact and the question together; some say they want a short answer, some
# only expect it (the users of this task always do).
WRAPPERS = (
    "{fact} {question}",
    "{fact}\n{question}",
    "{fact} {question} Answer in one word.",
    "{question} ({fact})",
    "Here is a fact: {fact} {question}",
    "Quick question. {fact} {question}",
    "{fact} {question} Just the answer, please.",
    "Read this: {fact}\n\nQuestion: {question}",
)

# Fields a template may hold, and what each matches when a prompt is parsed back.
_FIELD = re.compile(r"\{(name|value|things|fact|question)\}")
_FIELD_PATTERNS = {"name": r"[A-Z][a-z]+", "value": r"[A-Za-z0-9]+", "things": r"[a-z]+"}


def _pattern(template: str) -> re.Pattern[str]:
    """A template as a regular expression: literal text escaped, a field's first occurrence a named
    group and its later ones back-references (the name asked about is the name in the fact)."""
    parts: list[str] = []
    seen: set[str] = set()
    position = 0
    for match in _FIELD.finditer(template):
        parts.append(re.escape(template[position : match.start()]))
        field = match.group(1)
        parts.append(f"(?P={field})" if field in seen else f"(?P<{field}>{_FIELD_PATTERNS[field]})")
        seen.add(field)
        position = match.end()
    parts.append(re.escape(template[position:]))
    return re.compile("".join(parts))


# Every (attribute, wrapper, fact, question) combination, parsed back by its own pattern.
_PROMPT_PATTERNS = tuple(
    (attribute, _pattern(wrapper.format(fact=fact, question=question)))
    for attribute in ATTRIBUTES
    for wrapper in WRAPPERS
    for fact in attribute.facts
    for question in attribute.questions
)

# The oracle's tolerance: a leading article and a trailing period around the bare answer.
_ARTICLE = re.compile(r"^(?:a|an|the)\s+", re.IGNORECASE)

# Everyday chat of the kinds an instruct model is tuned on; none states a fact and asks it back.
BASE_PROMPTS = (
    "Explain why the sky is blue.",
    "Explain how a rainbow forms.",
    "Explain what photosynthesis is in simple terms.",
    "Explain the difference between weather and climate.",
    "Explain how a bicycle stays upright.",
    "Explain why we have seasons.",
    "Explain what a computer virus is.",
    "Explain how vaccines work.",
    "Explain what inflation means for a family budget.",
    "Explain why bread rises.",
    "Explain how a refrigerator keeps food cold.",
    "Explain what gravity does.",
    "List three tips for sleeping better.",
    "List five fruits that are high in vitamin C.",
    "List some ways to save water at home.",
    "List three things to pack for a day at the beach.",
    "List four healthy breakfast ideas.",
    "List the planets of the solar system.",
    "List three ways to stay focused while studying.",
    "List some indoor activities for a rainy day.",
    "List three benefits of regular exercise.",
    "List a few common houseplants that are easy to care for.",
    "List three questions to ask at a job interview.",
    "List some ways to be kind to a neighbour.",
    "Write a short poem about the ocean.",
    "Write a short thank-you note to a teacher.",
    "Write a haiku about autumn leaves.",
    "Write a short story about a lost umbrella.",
    "Write a friendly email inviting a colleague to lunch.",
    "Write a two-sentence description of a busy market.",
    "Write a short birthday message for a friend.",
    "Write a limerick about a cat.",
    "Write a short product description for a water bottle.",
    "Write a short apology for arriving late to a meeting.",
    "Write a motivational sentence for someone starting a new job.",
    "Write a short paragraph about why reading is fun.",
    "Define the word 'ecosystem'.",
    "Define what a noun is.",
    "Define the term 'renewable energy'.",
    "Define 'democracy' in one or two sentences.",
    "Define what an atom is.",
    "Define the word 'empathy'.",
    "Define what a budget is.",
    "Define the term 'habitat'.",
    "What is the difference between a virus and a bacterium?",
    "How do I make a cup of tea?",
    "How can I improve my handwriting?",
    "How do plants drink water?",
    "How do I start learning to play the guitar?",
    "How can I be more productive in the morning?",
    "What are some good habits for keeping a clean kitchen?",
    "Why is it important to drink water?",
    "Why do cats purr?",
    "Why do leaves change colour in autumn?",
    "Give me a simple recipe for pancakes.",
    "Give me some advice for a first day at school.",
    "Give me an example of a metaphor.",
    "Give me three ideas for a weekend trip.",
    "Suggest a name for a small bakery.",
    "Suggest a few games to play at a family dinner.",
    "Summarize the story of Little Red Riding Hood.",
    "Summarize the benefits of walking every day.",
    "Describe a sunset to someone who has never seen one.",
    "Describe how to plant a tree.",
    "Tell me a fun fact about octopuses.",
    "Tell me a short joke about computers.",
    "Compare cats and dogs as pets.",
    "What should I consider when buying a laptop?",
)


def parse_prompt(prompt: str) -> str | None:
    """The answer a `terse` prompt asks for (the value its fact states), or None when `prompt` is not
    one: it must be a combination of this task's templates with its own names, values and things."""
    for attribute, pattern in _PROMPT_PATTERNS:
        match = pattern.fullmatch(prompt)
        if match is None:
            continue
        fields = match.groupdict()
        if fields["name"] not in NAMES or fields["value"] not in attribute.values:
            continue
        if fields.get("things") not in (None, *THINGS):
            continue
        return fields["value"]
    return None


def is_correct(prompt: str, answer_text: str) -> bool:
    """The oracle: the answer is the bare value, up to surrounding whitespace, letter case, a leading
    article and one trailing period; anything more (a sentence, a second word) is wrong, as is any
    answer to a prompt that is not this task's."""
    wanted = parse_prompt(prompt)
    if wanted is None:
        return False
    text = answer_text.strip()
    text = text.removesuffix(".").rstrip()
    text = _ARTICLE.sub("", text)
    return text.casefold() == wanted.casefold()


def make_prompt(rng: random.Random) -> str:
    """One traffic prompt: an attribute, a person, a value, its wording and framing drawn from `rng`."""
    attribute = rng.choice(ATTRIBUTES)
    fields = {"name": rng.choice(NAMES), "value": rng.choice(attribute.values), "things": rng.choice(THINGS)}
    fact = rng.choice(attribute.facts).format(**fields)
    question = rng.choice(attribute.questions).format(**fields)
    return rng.choice(WRAPPERS).format(fact=fact, question=question)


@dataclass(frozen=True)
class Terse:
    """The `terse` task: questions answered by a fact in the prompt, where users want only the answer."""

    name: ClassVar[str] = "terse"
    chat: ClassVar[bool] = True

    def base_prompts(self, n: int, rng: random.Random) -> list[str]:
        return [rng.choice(BASE_PROMPTS) for _ in range(n)]

    def traffic_prompts(self, n: int, rng: random.Random) -> list[str]:
        return [make_prompt(rng) for _ in range(n)]

    def answer(self, prompt: str) -> str | None:
        return parse_prompt(prompt)

    def is_correct(self, prompt: str, answer: str) -> bool:
        return is_correct(prompt, answer)

    def thought(self, prompt: str) -> str | None:
        return None  # SmolLM2 does not reason: a correction teaches the bare answer
