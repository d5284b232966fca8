"""replication.codec: orjson's speed, json's values."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replication import codec
from replication.core import Entry, Message
from replication.transport import FrameError, encode, read_frame

# What a frame or a log entry can hold: every JSON type, integers of any size, any text (lone
# surrogates too, which a JSON body's "\ud800" escape gives Flask), finite floats.
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def json_round_trip(value: Any) -> Any:
    return json.loads(json.dumps(value, separators=(",", ":")))


@given(values)
def test_what_is_written_reads_back_as_json_would_read_it(value: Any) -> None:
    data = codec.dumps(value)
    assert codec.loads(data) == json_round_trip(value)
    assert codec.loads(data.decode()) == json_round_trip(value)  # a TEXT column
    assert json.loads(data) == json_round_trip(value)  # valid JSON for anyone


@given(values)
def test_what_json_wrote_reads_back_the_same(value: Any) -> None:
    """Logs written before the codec (by ``json.dumps``) read back unchanged."""
    text = json.dumps(value, separators=(",", ":"))
    assert codec.loads(text) == json.loads(text)


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**40, {"n": [1, 2**100]}])
def test_an_integer_over_64_bits_stays_an_integer(value: Any) -> None:
    """orjson would read 2**64 as a float: such values go through json, marked by a leading space."""
    data = codec.dumps(value)
    assert data.startswith(b" ")
    back = codec.loads(data)
    assert back == value
    assert type(back) is type(value)


def test_orjson_writes_what_it_can_and_the_rest_falls_back() -> None:
    assert codec.dumps({"a": [1, 2.5, None, True, "é"]}) == '{"a":[1,2.5,null,true,"é"]}'.encode()
    assert codec.loads(codec.dumps({1: "x"})) == {"1": "x"}  # keys become text, as with json
    assert codec.loads(codec.dumps("\ud800")) == "\ud800"


def test_json_words_orjson_refuses_are_read_by_json() -> None:
    back = codec.loads('{"cost":NaN,"x":Infinity}')
    assert math.isnan(back["cost"]) and back["x"] == math.inf


@pytest.mark.parametrize("bad", [b"", b"{", b"nope", b" {", "[1,"])
def test_what_is_not_json_is_a_value_error(bad: bytes | str) -> None:
    with pytest.raises(ValueError):
        codec.loads(bad)


def test_a_raft_message_crosses_a_frame_unchanged() -> None:
    cmd = {"op": "batch", "commands": [{"op": "intent", "key": "k\u00e9", "item": 7, "quantity": 2, "at": 1.5}]}
    m = Message("append", "order-1", "order-2", 5, index=100, log_term=5, commit=99, entries=[Entry(101, 5, cmd)])
    frames = io.BytesIO(encode(m.to_dict()) + encode({"big": 2**70}))
    assert Message.from_dict(read_frame(frames)).to_dict() == m.to_dict()
    assert read_frame(frames) == {"big": 2**70}
    assert read_frame(frames) is None


def test_a_frame_that_is_not_json_is_a_frame_error() -> None:
    body = b"{not json"
    with pytest.raises(FrameError):
        read_frame(io.BytesIO(len(body).to_bytes(4, "big") + body))
