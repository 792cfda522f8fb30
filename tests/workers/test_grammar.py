"""Structured outputs on the worker: what a grammar lets each row pick, over a real model's vocabulary
and the byte model's, with drafts and around a thought; compiled once per version."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest
import torch

from reflow import structured_output
from reflow.errors import InvalidArgument
from reflow.v1 import inference_pb2
from workers.grammar import Constraint, Grammars
from workers.models.builtin import TOKENIZER
from workers.models.hf_tokenizer import HFTokenizer
from workers.models.interface import Tokenizer
from workers.sequence import GenerationParams, Phase, Sequence

P = inference_pb2
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def allowed(
    constraint: Constraint, sequence: Sequence, vocab_size: int, draft: list[int] | None = None
) -> list[set[int]]:
    """The ids each row may pick: 1 + len(draft) rows."""
    logits = torch.zeros(1 + len(draft or []), vocab_size)
    constraint.restrict(logits, sequence, draft or [])
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


def picking(constraint: Constraint, sequence: Sequence, token: int) -> None:
    """`token` picked: into the constraint, then the sequence, as the runner does it."""
    constraint.accept(sequence, token)
    sequence.append(token)


def new_sequence(tokenizer: Tokenizer) -> Sequence:
    return Sequence(tokenizer.encode("Who?"), GenerationParams(max_tokens=200), tokenizer, 512)


def test_a_json_schema_admits_its_documents_token_by_token_on_smollm2(smollm2: Path) -> None:
    tokenizer = HFTokenizer.from_directory(smollm2)
    vocab_size = 49152
    schema = P.StructuredOutput(json_schema=json.dumps(PERSON))
    constraint = Grammars(tokenizer, vocab_size).constraint(structured_output.grammar(schema) or "")
    sequence = new_sequence(tokenizer)
    document = json.dumps({"name": "Ada Lovelace", "age": 36})  # the layout a schema's answers take
    for token in tokenizer.encode(document, bos=False):
        rows = allowed(constraint, sequence, vocab_size)
        assert token in rows[0], (tokenizer.decode([token]), sequence.output_ids)
        assert not any("\n" in tokenizer.decode([t]) for t in rows[0])  # one line; strings escape it
        picking(constraint, sequence, token)
    assert allowed(constraint, sequence, vocab_size) == [set(tokenizer.eos_ids)]  # the document is whole
    start = new_sequence(tokenizer)
    first = allowed(
        Grammars(tokenizer, vocab_size).constraint(structured_output.grammar(schema) or ""), start, vocab_size
    )
    assert {tokenizer.decode([t]) for t in first[0]} <= {"{", '{"'}  # no prose, no whitespace before it


def digits_constraint(grammars: Grammars) -> Constraint:
    return grammars.constraint(structured_output.grammar(P.StructuredOutput(regex="[0-9]{2,4}")) or "")


def test_drafted_rows_get_the_masks_of_the_steps_they_stand_for() -> None:
    vocab_size = 300  # the model's logits pad the byte vocabulary: never allowed
    grammars = Grammars(TOKENIZER, vocab_size)
    digit = [TOKENIZER.encode(str(d), bos=False)[0] for d in range(10)]
    sequence, constraint = new_sequence(TOKENIZER), digits_constraint(grammars)
    picking(constraint, sequence, digit[1])  # the answer has begun: drafts may follow
    assert sequence.phase is Phase.ANSWER
    letter = TOKENIZER.encode("x", bos=False)[0]
    assert constraint.usable_draft(sequence, [digit[2], digit[3], letter, digit[4]]) == [digit[2], digit[3]]
    end = TOKENIZER.eos_id  # a draft stops before an end, which llguidance cannot take back whole
    assert constraint.usable_draft(sequence, [digit[2], end, digit[3]]) == [digit[2]]
    rows = allowed(constraint, sequence, vocab_size, [digit[2], digit[3]])
    assert rows[0] == set(digit)  # after "1": a second digit at least
    assert rows[1] == rows[2] == {*digit, *TOKENIZER.eos_ids}  # after "12" and "123": one more, or the end
    step_by_step = []
    for token in (digit[2], digit[3]):  # the same steps one at a time: the draft left nothing behind
        step_by_step.append(allowed(constraint, sequence, vocab_size)[0])
        picking(constraint, sequence, token)
    assert step_by_step == rows[:2]
    assert allowed(constraint, sequence, vocab_size)[0] == rows[2]
    assert max(max(row) for row in rows) < TOKENIZER.vocab_size < vocab_size


def test_a_thought_runs_free_and_the_answer_after_it_is_held() -> None:
    vocab_size = TOKENIZER.vocab_size
    sequence, constraint = new_sequence(TOKENIZER), digits_constraint(Grammars(TOKENIZER, vocab_size))
    assert TOKENIZER.think_id in allowed(constraint, sequence, vocab_size)[0]  # before the answer starts
    picking(constraint, sequence, TOKENIZER.think_id)
    assert constraint.usable_draft(sequence, [65, 66]) == []  # never drafted while it thinks
    assert allowed(constraint, sequence, vocab_size) == [set(range(vocab_size))]
    for token in (*TOKENIZER.encode("hmm", bos=False), TOKENIZER.end_think_id):
        picking(constraint, sequence, token)
    assert sequence.phase is Phase.ANSWER
    seven = TOKENIZER.encode("7", bos=False)[0]
    assert seven in allowed(constraint, sequence, vocab_size)[0]
    assert TOKENIZER.think_id not in allowed(constraint, sequence, vocab_size)[0]
    picking(constraint, sequence, seven)
    with pytest.raises(RuntimeError, match="left its grammar"):  # a token the mask refused: a bug, told
        constraint.accept(sequence, TOKENIZER.encode("x", bos=False)[0])


def test_a_grammar_compiles_once_per_version_and_each_request_has_its_own_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiled, matcher = [], llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *args: compiled.append(args) or matcher(*args))
    grammars = Grammars(TOKENIZER, TOKENIZER.vocab_size)
    first, second = digits_constraint(grammars), digits_constraint(grammars)
    assert len(compiled) == 1
    sequence = new_sequence(TOKENIZER)
    picking(first, sequence, TOKENIZER.encode("4", bos=False)[0])
    assert (
        TOKENIZER.think_id in allowed(second, new_sequence(TOKENIZER), TOKENIZER.vocab_size)[0]
    )  # at its start


def test_a_grammar_that_does_not_compile_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="cannot be enforced on this model"):
        Grammars(TOKENIZER, TOKENIZER.vocab_size).constraint("start: undefined_rule")
