"""Examples as the model is taught them: ids and a loss mask on exactly the completion."""

from __future__ import annotations

from feedback.training.examples import training_example
from workers.models.builtin import TOKENIZER


def test_training_example_masks_exactly_the_completion() -> None:
    ids, mask = training_example(TOKENIZER, "47+38=", "85", "7+8=15, 4+3+1=8")
    prompt = [TOKENIZER.bos_id, *b"47+38="]
    completion = [TOKENIZER.think_id, *b"7+8=15, 4+3+1=8", TOKENIZER.end_think_id, *b"85"]
    assert ids == prompt + completion + [TOKENIZER.eos_id]
    assert mask == [0] * len(prompt) + [1] * (len(completion) + 1)


def test_training_example_without_thought_has_no_think_tags() -> None:
    ids, mask = training_example(TOKENIZER, "1+2=", "3", None)
    assert ids == [TOKENIZER.bos_id, *b"1+2=", *b"3", TOKENIZER.eos_id]
    assert mask == [0, 0, 0, 0, 0, 1, 1]
