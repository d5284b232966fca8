"""The replacement of a lost host (``pygmy.verify.hosts.replace``) against a fake tier: the steps an
operator takes, in the order that never leaves the tier with fewer voters than it had, and each
step's result checked. The real thing runs in tests/verify/test_chaos.py (``host-lost``) and
tests/system/test_membership.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pygmy.verify import hosts


class FakeTier(hosts.Operator):
    """A tier's leader as ``pygmy member ... --json`` shows it: voters, learners, and a learner that
    has caught up once it has been started and asked about ``lag_polls`` times."""

    def __init__(self, voters: list[str], lag_polls: int = 2, ignore: str = "") -> None:
        super().__init__(Path("/nonexistent"))
        self.voters, self.learners = list(voters), []
        self.started: set[str] = set()
        self.lag_polls, self.ignore = lag_polls, ignore
        self.calls: list[str] = []
        self.fewest_voters = len(voters)

    def json(self, *args: str) -> dict[str, Any]:
        action, tier, *rest = args
        self.calls.append(f"{action} {rest[0]}" if rest else action)
        if action == "list":
            self.lag_polls -= 1
            return {"members": [{"name": n, "role": "voter", "caught_up": True} for n in self.voters] +
                    [{"name": n, "role": "learner", "caught_up": n in self.started and self.lag_polls < 0}
                     for n in self.learners]}
        name = rest[0]
        if action != self.ignore:
            if action == "add":
                self.learners.append(name)
            elif action == "promote":
                self.learners.remove(name)
                self.voters.append(name)
            elif action == "remove":
                self.voters.remove(name)
        self.fewest_voters = min(self.fewest_voters, len(self.voters))
        return {"voters": sorted(self.voters), "learners": sorted(self.learners), "urls": {}}

    def members(self, tier: str) -> dict[str, Any]:
        return self.json("list", tier)  # (the real one asks the leader in-process)

    def start(self, name: str) -> None:
        self.calls.append(f"start {name}")
        self.started.add(name)


def test_a_lost_host_is_replaced_in_the_order_that_keeps_the_tier_whole() -> None:
    tier = FakeTier(["catalog-1", "catalog-2", "catalog-3"])
    steps = hosts.replace(tier, "catalog", "catalog-2", "catalog-4", "http://10.0.0.4:8102", tier.start)
    assert tier.calls == ["add catalog-4", "start catalog-4", "list", "list", "list", "promote catalog-4",
                          "remove catalog-2"]
    assert [s["action"] for s in steps] == ["add", "started", "caught-up", "promote", "remove"]
    assert sorted(tier.voters) == ["catalog-1", "catalog-3", "catalog-4"] and tier.learners == []
    assert tier.fewest_voters == 3, "the tier had fewer voters than it started with"


@pytest.mark.parametrize("ignored", ["add", "promote", "remove"])
def test_a_step_that_changes_nothing_stops_the_replacement(ignored: str) -> None:
    tier = FakeTier(["order-1", "order-2", "order-3"], lag_polls=0, ignore=ignored)
    with pytest.raises(hosts.OperatorError, match=ignored):
        hosts.replace(tier, "order", "order-1", "order-4", "http://10.0.0.5:8201", tier.start, timeout=0.5)


def test_a_new_host_that_never_catches_up_is_never_promoted() -> None:
    tier = FakeTier(["order-1", "order-2", "order-3"])
    with pytest.raises(hosts.OperatorError, match="caught up"):
        hosts.replace(tier, "order", "order-3", "order-4", "http://10.0.0.5:8203", lambda name: None, timeout=0.5)
    assert not any(c.startswith(("promote", "remove")) for c in tier.calls)
    assert sorted(tier.voters) == ["order-1", "order-2", "order-3"]


def test_the_old_replica_must_be_a_voter() -> None:
    tier = FakeTier(["order-1", "order-2", "order-3"])
    with pytest.raises(hosts.OperatorError, match="not a voter"):
        hosts.replace(tier, "order", "order-9", "order-4", "http://10.0.0.5:8203", tier.start)


def test_a_new_host_never_takes_a_name_used_before() -> None:
    """Losing the highest-numbered replica first must not give its name to the new host (its
    data and log entries would be taken for the old one's)."""
    from types import SimpleNamespace

    from pygmy.verify import nemesis

    names = ["catalog-1", "catalog-2", "catalog-3"]
    net = SimpleNamespace(replicas=lambda tier: [n for n in names if n.startswith(tier)])
    nem = nemesis.Nemesis(net, lambda tier: None, print, print, lambda name: None, Path)  # type: ignore[arg-type]
    seen = set(names)
    for old in ("catalog-3", "catalog-4", "catalog-1"):  # the lost host's name goes first
        names.remove(old)
        new = nem._new_name("catalog")
        names.append(new)
        assert new not in seen, new
        seen.add(new)
