"""``pygmy serve --id-from-hostname``: a Kubernetes StatefulSet runs one pod template for every
replica, so each pod must find its own Pygmy id; pod ``catalog-0`` is Pygmy's ``catalog-1``, the
first URL of ``PYGMY_CATALOG_URLS`` (deploy/kubernetes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pygmy.cluster import cli, serve

URLS = "http://catalog-0.catalog:8000,http://catalog-1.catalog:8000,http://catalog-2.catalog:8000"


@pytest.mark.parametrize("hostname, k", [("catalog-0", 1), ("order-2", 3), ("catalog-1.catalog.ns.svc.cluster.local", 2),
                                         ("my-catalog-10", 11)])
def test_the_id_is_the_ordinal_plus_one(hostname: str, k: int) -> None:
    assert cli.id_from_hostname(hostname) == k


@pytest.mark.parametrize("hostname", ["catalog", "frontend-7d9f8c-x2bqz", "catalog-", "catalog-٣"])
def test_a_host_name_without_an_ordinal_is_refused_by_name(hostname: str) -> None:
    with pytest.raises(SystemExit, match="does not end in -N"):
        cli.id_from_hostname(hostname)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, Any, int]]:
    """``pygmy serve`` up to Gunicorn: what it would serve, as (tier, config, k)."""
    calls: list[tuple[str, Any, int]] = []
    monkeypatch.setattr(serve, "serve", lambda tier, config, k: calls.append((tier, config, k)))
    for env, value in {"PYGMY_SECRET": "s" * 32, "PYGMY_DATA_DIR": str(tmp_path), "PYGMY_CATALOG_URLS": URLS}.items():
        monkeypatch.setenv(env, value)
    return calls


def test_serve_takes_its_id_and_url_from_the_pods_host_name(monkeypatch: pytest.MonkeyPatch,
                                                            served: list[tuple[str, Any, int]]) -> None:
    monkeypatch.setattr(cli.socket, "gethostname", lambda: "catalog-1")
    assert cli.main(["serve", "catalog", "--id-from-hostname"]) == 0
    [(tier, config, k)] = served
    assert (tier, k) == ("catalog", 2)
    assert config.peers("catalog")["catalog-2"] == "http://catalog-1.catalog:8000"  # the pod's own stable name


def test_a_pod_beyond_the_tiers_urls_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                served: list[tuple[str, Any, int]]) -> None:
    monkeypatch.setattr(cli.socket, "gethostname", lambda: "catalog-3")  # scaled to 4, URLs left at 3
    with pytest.raises(SystemExit, match="catalog-4 is not a catalog replica"):
        cli.main(["serve", "catalog", "--id-from-hostname"])
    assert served == []


def test_id_and_id_from_hostname_exclude_each_other(served: list[tuple[str, Any, int]]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "catalog", "--id", "2", "--id-from-hostname"])
    assert info.value.code == 2 and served == []
