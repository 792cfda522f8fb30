"""The `arith` demo task: prompts `"A+B="`, canonical reasoning, the oracle, its two distributions.

The base model learns operands 0-49; live traffic asks over 0-99, where the base model is mostly
wrong: the material for the learning loop.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import ClassVar

# Canonical operands only ("7+38=", not "07+38=" or " 7+38="), so format and parse are inverses.
_PROMPT = re.compile(r"(0|[1-9][0-9]*)\+(0|[1-9][0-9]*)=")


def format_prompt(a: int, b: int) -> str:
    """The prompt "A+B=" for non-negative integers a and b."""
    if a < 0 or b < 0:
        raise ValueError(f"arith operands must be non-negative, got {a} and {b}")
    return f"{a}+{b}="


def parse_prompt(prompt: str) -> tuple[int, int] | None:
    """The operands of an `arith` prompt, or None when `prompt` is not one."""
    match = _PROMPT.fullmatch(prompt)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def reasoning(a: int, b: int) -> str:
    """The canonical thought: column sums from the ones digit up, with carries.

    47+38 gives "7+8=15, 4+3+1=8"; the answer is the last sum followed by the
    ones digits of the earlier sums, last to first ("85"). The shorter operand
    is padded with zeros: 5+38 gives "5+8=13, 0+3+1=4".
    """
    digits_a = [int(d) for d in reversed(str(a))]
    digits_b = [int(d) for d in reversed(str(b))]
    steps = []
    carry = 0
    for i in range(max(len(digits_a), len(digits_b))):
        x = digits_a[i] if i < len(digits_a) else 0
        y = digits_b[i] if i < len(digits_b) else 0
        total = x + y + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
        carry = total // 10
    return ", ".join(steps)


def is_correct(prompt: str, answer_text: str) -> bool:
    """The oracle: the stripped answer is exactly the sum; False for non-arith prompts."""
    operands = parse_prompt(prompt)
    if operands is None:
        return False
    return answer_text.strip() == str(sum(operands))


def sample_operands(n: int, lo: int, hi: int, rng: random.Random) -> list[tuple[int, int]]:
    """`n` operand pairs drawn uniformly and independently from lo..hi (inclusive)."""
    if not 0 <= lo <= hi:
        raise ValueError(f"need 0 <= lo <= hi, got lo={lo} hi={hi}")
    return [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]


@dataclass(frozen=True)
class Arith:
    """The `arith` task, with the operand ranges of the base model's training and of live traffic."""

    base: tuple[int, int] = (0, 49)
    traffic: tuple[int, int] = (0, 99)
    name: ClassVar[str] = "arith"
    chat: ClassVar[bool] = False  # the byte-level demo model reads "A+B=" as it is

    def base_prompts(self, n: int, rng: random.Random) -> list[str]:
        return [format_prompt(a, b) for a, b in sample_operands(n, *self.base, rng)]

    def traffic_prompts(self, n: int, rng: random.Random) -> list[str]:
        return [format_prompt(a, b) for a, b in sample_operands(n, *self.traffic, rng)]

    def answer(self, prompt: str) -> str | None:
        operands = parse_prompt(prompt)
        return None if operands is None else str(sum(operands))

    def is_correct(self, prompt: str, answer: str) -> bool:
        return is_correct(prompt, answer)

    def thought(self, prompt: str) -> str | None:
        operands = parse_prompt(prompt)
        return None if operands is None else reasoning(*operands)
