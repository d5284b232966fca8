"""Where a catalogue comes from: the seven Pygmy books, a JSON file, or a synthetic one for benchmarks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_STOCK = 1000

DEFAULT_BOOKS: list[dict[str, Any]] = [
    {"item_number": 1, "title": "How to get a good grade in 677 in 20 minutes a day",
     "topic": "distributed systems", "stock": DEFAULT_STOCK, "cost": 20.0},
    {"item_number": 2, "title": "RPCs for Dummies", "topic": "distributed systems",
     "stock": DEFAULT_STOCK, "cost": 15.0},
    {"item_number": 3, "title": "Xen and the Forgotten Art of Virtualization", "topic": "graduate school",
     "stock": DEFAULT_STOCK, "cost": 30.0},
    {"item_number": 4, "title": "Cooking for the Impatient Graduate Student", "topic": "graduate school",
     "stock": DEFAULT_STOCK, "cost": 12.5},
    {"item_number": 5, "title": "How to finish Project 3 on time", "topic": "graduate school",
     "stock": DEFAULT_STOCK, "cost": 25.0},
    {"item_number": 6, "title": "Why theory classes are so hard", "topic": "graduate school",
     "stock": DEFAULT_STOCK, "cost": 18.0},
    {"item_number": 7, "title": "Spring in the Pioneer Valley", "topic": "graduate school",
     "stock": DEFAULT_STOCK, "cost": 10.0},
]


def validate(books: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check a catalogue's shape early, so a bad file fails at start-up with a clear message."""
    seen: set[int] = set()
    out = []
    for i, b in enumerate(books):
        try:
            n = b["item_number"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n in seen:
                raise ValueError("item_number must be a unique positive integer")
            if not isinstance(b["title"], str) or not isinstance(b["topic"], str):
                raise ValueError("title and topic must be strings")
            stock, cost = b.get("stock", DEFAULT_STOCK), b.get("cost", 10.0)
            if not isinstance(stock, int) or stock < 0 or not isinstance(cost, int | float) or cost < 0:
                raise ValueError("stock must be a non-negative integer and cost a non-negative number")
        except (KeyError, TypeError, ValueError) as exc:
            number = b.get("item_number") if isinstance(b, dict) else None
            which = f"book #{i + 1} (item_number {number!r})" if number is not None else f"book #{i + 1}"
            what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"{which}: {what}") from None
        seen.add(n)
        out.append({"item_number": n, "title": b["title"], "topic": b["topic"], "stock": stock, "cost": float(cost)})
    return out


def load(path: str | None) -> list[dict[str, Any]]:
    """The catalogue a new replica starts with: the JSON list in ``path``, else the seven Pygmy books."""
    if not path:
        return [dict(b) for b in DEFAULT_BOOKS]
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("books", [])
    if not isinstance(data, list):
        raise ValueError("expected a JSON list of books (or {\"books\": [...]})")
    return validate(data)


def synthetic(count: int, topics: int = 50, stock: int = DEFAULT_STOCK) -> list[dict[str, Any]]:
    """A large deterministic catalogue for benchmarks (e.g. 100,000 books over 50 topics)."""
    return [
        {"item_number": n, "title": f"Synthetic book {n}", "topic": f"topic {n % topics}",
         "stock": stock, "cost": float(5 + n % 45)}
        for n in range(1, count + 1)
    ]
