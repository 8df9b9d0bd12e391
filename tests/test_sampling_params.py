from __future__ import annotations

import pytest

from tokenloom.core.errors import ClientError
from tokenloom.core.sampling_params import (
    GREEDY_TEMPERATURE_EPS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TIMEOUT_S,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)


@pytest.mark.parametrize("data, param", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"min_p": 2}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": False}, "max_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-45}, "repetition_penalty"),  # issue 14: 0 in float32
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 0.0099}, "repetition_penalty"),
    ({"repetition_penalty": 10.01}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": -1.0}, "timeout_s"),
    ({"timeout_s": 86400.5}, "timeout_s"),
    ({"timeout_s": float("inf")}, "timeout_s"),
    ({"timeout_s": float("nan")}, "timeout_s"),
    ({"timeout_s": "5"}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"),
    ({"seed": 2**64}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"temprature": 0.5}, "temprature"),
])
def test_bad_values_name_the_parameter(data, param):
    with pytest.raises(ClientError) as info:
        SamplingParams.from_dict(data)
    assert info.value.param == param
    assert param in str(info.value)


def test_top_k_checked_against_vocab():
    with pytest.raises(ClientError) as info:
        SamplingParams(top_k=100).validate(vocab_size=50)
    assert info.value.param == "top_k"


def test_defaults_are_valid_and_greedy_flag():
    SamplingParams().validate(1000)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=5e-324).greedy and SamplingParams(temperature=1e-38).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE_EPS / 2).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE_EPS).greedy


def test_edges_of_the_accepted_ranges_are_valid():
    for data in ({"repetition_penalty": MIN_REPETITION_PENALTY}, {"repetition_penalty": MAX_REPETITION_PENALTY},
                 {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))}, {"timeout_s": MAX_TIMEOUT_S},
                 {"timeout_s": 30}, {"timeout_s": 1e-3}, {"timeout_s": None}, {"top_p": 5e-324},
                 {"temperature": 5e-324}, {"min_p": 5e-324}):
        SamplingParams.from_dict(data)
    assert SamplingParams().timeout_s is None
    assert SamplingParams.from_dict({"timeout_s": 2.5}).timeout_s == 2.5
