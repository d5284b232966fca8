"""pygmy.kit.codec: orjson's speed, json's values."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pygmy.kit import codec
from pygmy.replication.core import Entry, Message
from pygmy.replication.transport import FrameError, encode, read_frame

# What a frame or a log entry can hold: every JSON type, integers of any size, any text (lone
# surrogates too, which a JSON body's "\ud800" escape gives Flask), any float (NaN and infinities as
# json writes them). Compared by repr: 2**64 == float(2**64), and NaN is not equal to itself.
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def json_round_trip(value: Any) -> Any:
    return json.loads(json.dumps(value, separators=(",", ":")))


@given(values)
def test_what_is_written_reads_back_as_json_would_read_it(value: Any) -> None:
    data = codec.dumps(value)
    assert repr(codec.loads(data)) == repr(json_round_trip(value))
    assert repr(codec.loads(data.decode())) == repr(json_round_trip(value))  # a TEXT column
    assert repr(json.loads(data)) == repr(json_round_trip(value))  # JSON json reads the same way


@given(values)
def test_what_json_wrote_reads_back_the_same(value: Any) -> None:
    """Logs written before the codec (by ``json.dumps``) read back unchanged."""
    for text in (json.dumps(value, separators=(",", ":")), json.dumps(value)):
        assert repr(codec.loads(text)) == repr(json.loads(text))
        assert repr(codec.loads(text.encode())) == repr(json.loads(text))


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


@pytest.mark.parametrize("text", ['{"n":18446744073709551617}', '[-9223372036854775809]', '\n[18446744073709551616]'])
def test_an_integer_over_64_bits_that_json_wrote_stays_an_integer(text: str) -> None:
    """Old logs and frames were written by json.dumps, with no mark: orjson would read a float."""
    assert repr(codec.loads(text)) == repr(json.loads(text))
    assert repr(codec.loads(text.encode())) == repr(json.loads(text))


@pytest.mark.parametrize("value", [math.nan, math.inf, {"cost": -math.inf}, [1.5, None, math.nan]])
def test_a_float_that_is_not_finite_is_not_written_as_null(value: Any) -> None:
    """orjson writes NaN and the infinities as null: those go through json, as before."""
    assert repr(codec.loads(codec.dumps(value))) == repr(json_round_trip(value))


def test_a_subclass_is_encoded_as_json_encodes_it() -> None:
    class Pairs(dict):  # like a multidict whose items() differ from its dict storage
        def items(self):  # type: ignore[override]
            return [("a", "first")]

    value = Pairs(a="stored")
    assert codec.loads(codec.dumps(value)) == json.loads(json.dumps(value))
