"""JSON for what replicas and services write to each other and to their logs, through orjson.

Why: the standard library's ``json`` took 24 us to encode and 14 us to decode an append of two buys
on this machine, about a seventh of the cluster's CPU under the 40/40/20 mix (frames and log
entries are encoded and decoded on every replica of every commit); orjson takes 0.6 and 2.4 us.

Exactly what ``json`` read and wrote, or a clear error, never a silently different value:

- orjson cannot encode integers over 64 bits, non-string keys, subclasses it would encode its own
  way, or strings with lone surrogates, and it writes a float that is not finite as ``null``. Such
  values are encoded by ``json`` behind one leading space (still valid JSON, which ``json`` reads and
  orjson never writes).
- orjson would decode an integer over 64 bits as a float. Text that starts with a space, or holds a
  run of 19 digits (every integer outside orjson's range has one; so may a long number in a string,
  which then only costs ``json``'s speed), is decoded by ``json``; so is text orjson refuses to read
  (``NaN`` as ``json`` writes it). Logs and frames written by ``json.dumps`` read back the same.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import orjson

_OPTIONS = orjson.OPT_PASSTHROUGH_SUBCLASS  # a dict or str subclass is json's business, as before
_LONG_DIGITS = re.compile(rb"\d{19}")
_LONG_DIGITS_TEXT = re.compile(r"\d{19}")


def not_finite(obj: Any) -> bool:
    """Whether ``obj`` holds a float that is not finite (orjson would write it as ``null``)."""
    if isinstance(obj, float):
        return not math.isfinite(obj)
    if isinstance(obj, dict):
        return any(not_finite(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(not_finite(v) for v in obj)
    return False


def orjson_dumps(obj: Any, default: Callable[[Any], Any] | None = None, option: int = 0) -> bytes | None:
    """``obj`` as orjson writes it, or None where that is not what ``json`` would write (the caller
    then asks ``json``): big integers, non-string keys, lone surrogates and subclasses (orjson
    refuses them, as it does whatever ``default`` refuses), and floats that are not finite."""
    try:
        data = orjson.dumps(obj, default=default, option=option | _OPTIONS)
    except TypeError:  # orjson.JSONEncodeError
        return None
    if b"null" in data and not_finite(obj):  # looked for only where orjson may have written one
        return None
    return data


def dumps(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON that ``loads`` reads back as ``json`` would have."""
    data = orjson_dumps(obj)
    return b" " + json.dumps(obj, separators=(",", ":")).encode() if data is None else data


def dumps_text(obj: Any) -> str:
    """``dumps`` as text, for a TEXT column."""
    return dumps(obj).decode()


def loads(data: bytes | str) -> Any:
    """The value of JSON written by ``dumps`` or by ``json.dumps``; ``ValueError`` if it is not JSON."""
    if data[:1] in (b" ", " ") or (_LONG_DIGITS if isinstance(data, bytes | bytearray) else _LONG_DIGITS_TEXT).search(
            data):
        return json.loads(data)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
