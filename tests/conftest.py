from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Cluster, start_cluster  # noqa: E402


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One default cluster (3 replicas per tier, 2 frontend workers) shared by read-mostly tests."""
    c = start_cluster(tmp_path_factory.mktemp("shared"))
    yield c
    c.stop()


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of one's own, for tests that kill, restart or count stock exactly."""
    c = start_cluster(tmp_path)
    yield c
    c.stop()
