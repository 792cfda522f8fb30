"""The several choices of one request: each its own seed, and `best_of`'s ranking by mean log
probability per token."""

from __future__ import annotations

import math

from gateway.http.choices import SEEDS, best, seeded
from reflow.v1 import inference_pb2

P = inference_pb2


def test_each_choice_samples_with_the_next_seed_and_an_unseeded_request_stays_unseeded() -> None:
    request = P.GenerateRequest(prompt="hi", sampling=P.SamplingParams(seed=41, temperature=0.7))
    assert [seeded(request, i).sampling.seed for i in range(3)] == [41, 42, 43]
    assert seeded(request, 1).prompt == "hi" and request.sampling.seed == 41  # a copy
    last = P.GenerateRequest(sampling=P.SamplingParams(seed=SEEDS))  # 2**64 - 1, as -1 is taken
    assert [seeded(last, i).sampling.seed for i in range(3)] == [SEEDS, 1, 2]  # never 0, a fresh seed
    assert seeded(P.GenerateRequest(), 5).sampling.seed == 0


def scored(request_id: str, *logprobs: float) -> list[P.GenerateResponse]:
    """A choice's messages, a token each with these log probabilities."""
    return [P.GenerateResponse(request_id=request_id, logprobs=[P.TokenLogprob(logprob=v)]) for v in logprobs]


def test_best_of_keeps_the_highest_mean_logprob_per_token_best_first() -> None:
    short_sure = scored("a", -0.1)
    long_unsure = scored("b", -0.05, -1.0, -1.0)  # the highest sum of the three would be a's, too
    middling = scored("c", -0.2, -0.3)
    kept = best([long_unsure, middling, short_sure], 2, keep_logprobs=True)
    assert [m[0].request_id for m in kept] == ["a", "c"]
    assert math.isclose(kept[1][1].logprobs[0].logprob, -0.3, rel_tol=1e-6)
    plain = best([scored("a", -1.0), scored("b", -0.5)], 1, keep_logprobs=False)
    assert [m.request_id for m in plain[0]] == ["b"] and not plain[0][0].logprobs  # not asked for
    assert (
        best([[P.GenerateResponse(request_id="x")], scored("y", -9.0)], 1, keep_logprobs=True)[0][
            0
        ].request_id
        == "y"
    )
