"""What the gateway accepts of a GenerateRequest before a worker sees it (the refusals through a
running gateway are in test_generate.py)."""

from __future__ import annotations

import pytest

from gateway.validation import MAX_TEMPERATURE, MIN_TEMPERATURE, RequestLimits, check_request
from reflow.errors import InvalidArgument
from reflow.v1 import inference_pb2

P = inference_pb2
LIMITS = RequestLimits(max_prompt_chars=512, default_max_tokens=16, max_stop_strings=8)


def sampled(temperature: float) -> P.GenerateRequest:
    return P.GenerateRequest(prompt="1+1=", sampling=P.SamplingParams(temperature=temperature))


@pytest.mark.parametrize("temperature", [0.0, MIN_TEMPERATURE, 1.0, MAX_TEMPERATURE])
def test_the_documented_temperatures_pass_as_float32_carries_them(temperature: float) -> None:
    check_request(sampled(temperature), LIMITS)  # 0.01 arrives as 0.009999999776...: found by fuzzing


@pytest.mark.parametrize("temperature", [0.0099, -0.01, 100.01, float("nan"), float("inf")])
def test_temperatures_out_of_range_are_refused(temperature: float) -> None:
    with pytest.raises(InvalidArgument, match=r"sampling\.temperature must be 0"):
        check_request(sampled(temperature), LIMITS)


@pytest.mark.parametrize(
    ("sampling", "refused"),
    [
        ({"presence_penalty": 2.01}, r"sampling\.presence_penalty must be in \[-2\.0, 2\.0\]"),
        ({"frequency_penalty": float("nan")}, r"sampling\.frequency_penalty must be in"),
        ({"repetition_penalty": -0.5}, r"sampling\.repetition_penalty must be in \(0, 10\.0\]"),
        ({"repetition_penalty": 10.5}, r"sampling\.repetition_penalty"),
        ({"logit_bias": {7: 100.5}}, r"sampling\.logit_bias\[7\] must be in \[-100\.0, 100\.0\]"),
        ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, r"sampling\.logit_bias has 1025 entries"),
    ],
)
def test_penalties_and_logit_biases_out_of_range_are_refused(
    sampling: dict[str, object], refused: str
) -> None:
    with pytest.raises(InvalidArgument, match=refused):
        check_request(P.GenerateRequest(prompt="1+1=", sampling=P.SamplingParams(**sampling)), LIMITS)


def test_penalties_and_logit_biases_at_their_bounds_pass() -> None:
    bounds = P.SamplingParams(
        presence_penalty=-2, frequency_penalty=2, repetition_penalty=10, logit_bias={0: -100, 5: 100}
    )
    check_request(P.GenerateRequest(prompt="1+1=", sampling=bounds), LIMITS)
