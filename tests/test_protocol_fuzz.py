"""Property test: the protocol decoder never raises, whatever arrives."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.protocols.websocket.messages import ClientMessage, Error, decode_client

VALID = [
    {"type": "generate", "id": "a", "prompt": "hi", "params": {"temperature": 0.5, "max_tokens": 8}},
    {"type": "generate", "id": "b", "messages": [{"role": "user", "content": "hi"}]},
    {"type": "generate", "id": "c", "prompt_token_ids": [1, 2, 3], "params": {"stop": ["x"], "seed": 3}},
    {"type": "cancel", "id": "a"},
    {"type": "ping", "data": "p"},
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


def _check(data) -> None:
    out = decode_client(data)
    assert isinstance(out, (Error, *ClientMessage.__args__))
    if isinstance(out, Error):
        assert out.code and out.message and "Traceback" not in out.message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes(data):
    _check(data)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_random_text(data):
    _check(data)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(VALID), st.lists(st.tuples(st.text(max_size=12), json_values), max_size=3),
       st.sampled_from(["set", "drop", "nest"]))
def test_mutated_valid_messages(base, edits, how):
    msg = json.loads(json.dumps(base))
    for key, value in edits:
        if how == "set":
            msg[key or "type"] = value
        elif how == "drop" and msg:
            msg.pop(next(iter(msg)))
        elif isinstance(msg.get("params"), dict):
            msg["params"][key or "temperature"] = value
    _check(json.dumps(msg))


def test_valid_messages_decode():
    for base in VALID:
        assert not isinstance(decode_client(json.dumps(base)), Error), base
