"""A cluster of the hardening tests' own: schemathesis gets the admin token and may change any
book, so it must not share state with the read-mostly session cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Cluster, start_cluster, stop_checked


@pytest.fixture(scope="package")
def hard_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(Path(tmp_path_factory.mktemp("hardening")))
    yield c
    stop_checked(c)
