from __future__ import annotations

import pytest

from tokenloom.core.errors import ClientError
from tokenloom.core.sampling_params import SamplingParams


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
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
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
