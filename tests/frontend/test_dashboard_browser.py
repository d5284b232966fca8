"""The dashboard in a real browser (headless Chromium driven by Selenium): it shows every replica and
both leaders, its kill button takes the catalog leader down and the page shows a new leader, its
start button brings the old one back and the page shows it caught up.

Skipped where Chromium is not installed; under ``PYGMY_NO_SKIP=1`` (``.ci/run`` sets it after
installing Chromium) the skip fails the run (tests/conftest.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Cluster, start_cluster

from pygmy.experiments.dashboard_shot import (
    browser,
    chromium_paths,
    enter_token,
    events,
    leader_on_page,
    press,
    replica,
    wait_for,
)

if chromium_paths() is None:
    pytest.skip("needs chromium and chromium-driver (Debian packages)", allow_module_level=True)

REPLICAS = [f"{t}-{k}" for t in ("catalog", "order") for k in (1, 2, 3)]


@pytest.fixture
def dash_cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, "--frontend-workers", "2")
    yield c
    c.stop()


def test_kill_the_catalog_leader_from_the_page_then_start_it_again(dash_cluster: Cluster) -> None:
    c = dash_cluster
    with browser() as d:
        d.get(c.url + "/dashboard")
        wait_for(d, "every replica up and both leaders",
                 lambda d: all(replica(d, n)["state"] == "up" for n in REPLICAS)
                 and leader_on_page(d, "catalog") and leader_on_page(d, "order"))
        old = leader_on_page(d, "catalog")
        assert old is not None
        assert leader_on_page(d, "order") == c.client().status()["order"]["leader"]
        assert len(d.find_elements("css selector", "#workers tbody tr")) == 2, "one row per frontend worker"

        # Without the admin token the button is refused, and nothing happens.
        press(d, old, "kill")
        wait_for(d, "the refusal", lambda d: "refused" in d.find_element("id", "fault-note").text)
        assert "admin token" in d.find_element("id", "fault-note").text
        assert replica(d, old)["state"] == "up"

        enter_token(d, c.admin_token())
        pressed = time.monotonic()
        press(d, old, "kill")
        wait_for(d, f"{old} down and a new catalog leader",
                 lambda d: replica(d, old)["state"] == "down" and leader_on_page(d, "catalog") not in (None, old))
        took = time.monotonic() - pressed
        new = leader_on_page(d, "catalog")
        log = events(d)
        assert any(f"killed {old}" in e for e in log), log
        assert any(f"{old} down" in e for e in log), log
        assert any(f"{new} leads catalog" in e for e in log), log
        # The page asked the launcher, which really killed it: the pid file is gone with the process.
        assert old not in c.process_groups()

        press(d, old, "start")
        wait_for(d, f"{old} caught up", lambda d: replica(d, old) == {
            "role": "follower", "state": "up", "lag": "0", "leader": False}, timeout=30)
        assert any(f"{old} caught up" in e for e in events(d)), events(d)
        assert old in c.process_groups()
        print(f"kill pressed -> page showed {old} down and {new} leading: {took:.1f} s")

        # The storefront panel uses the public API.
        d.find_element("id", "store-search").click()
        wait_for(d, "search results", lambda d: len(d.find_elements("css selector", "#store-results li")) >= 1)
        d.find_element("id", "store-buy").click()
        wait_for(d, "the order", lambda d: d.find_element("id", "store-out").text.startswith("order "))
        # No script error all along (refused requests are logged as network errors, not these).
        errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE" and e.get("source") != "network"]
        assert not errors, errors
