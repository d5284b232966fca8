"""Pygmy: a replicated online bookstore built to be studied, run and measured.

The one installed top-level package. Its layers, bottom up (tests/test_layers.py checks that no
import runs up): ``pygmy.kit`` (what every service stands on), ``pygmy.replication`` (the Raft log)
and ``pygmy.client``; the tiers ``pygmy.catalog``, ``pygmy.order``, ``pygmy.frontend``;
``pygmy.cluster`` (the launcher that composes them); ``pygmy.verify`` (the nemesis and the
linearizability checker); ``pygmy.experiments``.

In a checkout the tiers, the client and the experiments keep folders of their own at the top of the
repository (``frontend/``, ``catalog/``, ``order/``, ``client/``, ``experiments/``), so the repository
root joins this package's search path: ``pygmy.catalog`` is ``catalog/`` there, and the same module
inside the package once installed (``pyproject.toml`` maps the folders in).
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
# Where frontend/, catalog/, ... are: the package itself once installed, the repository root in a checkout.
ROOT = _HERE if (_HERE / "catalog").is_dir() else _HERE.parent
if ROOT != _HERE:
    __path__.append(str(ROOT))  # noqa: F821 (a package's own __path__)
