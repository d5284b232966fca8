"""The frontend cache's keys: the frontend files reads under them and the catalog leader names them in
its holds and releases, so both tiers take them from here rather than one tier from the other."""

from __future__ import annotations

import re


def topic_key(topic: str) -> str:
    """Normalise a topic so that ``Distributed-Systems`` and ``distributed systems`` are the same."""
    return re.sub(r"[\s_\-]+", " ", topic).strip().casefold()


def book_key(item: int) -> str:
    """The cache key of a lookup. Searches show only numbers and titles, which no command changes,
    so no write needs to touch their keys."""
    return f"book:{item}"


def search_key(topic: str, after: int = 0, limit: int = 0) -> str:
    """The cache key of a page of a search (books above item number ``after``, at most ``limit``),
    the same for every spelling of the topic."""
    return f"topic:{topic_key(topic)}" + (f"@{after}+{limit}" if after or limit else "")
