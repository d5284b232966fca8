"""A replica's host replaced the way an operator does it: ``pygmy member`` and ``pygmy start``.

The nemesis' ``host-lost`` fault uses it (a host lost for good in a chaos run, replaced by a new
host at a new address, in a namespace of its own), and so does tests/system/test_membership.py (new
hosts at loopback addresses). The order of the steps is what keeps acknowledged writes safe:

1. ``pygmy member add TIER NEW URL``: the new replica joins as a learner, counted in no majority;
2. ``pygmy start NEW`` (which returns once it serves), then the leader's view (what ``pygmy member
   list`` shows) until it has NEW caught up;
3. ``pygmy member promote TIER NEW``: the tier has one voter more than it had;
4. ``pygmy member remove TIER OLD``: back to its size.

Promoting before removing means that every entry committed from then on is on a majority that
includes the new replica, and the tier never has fewer voters than it started with: removing a dead
replica first would leave a tier of 3 with 2 voters, every write then held by 2 disks only. Each step
checks the configuration it left (``replace`` raises ``OperatorError`` on anything else), so a run
in which a replacement went wrong fails even if the cluster happened to survive it.
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pygmy.cluster import local, members
from pygmy.cluster.local import pygmy
from pygmy.kit.config import ClusterConfig
from pygmy.replication.transport import RAFT_PORT_OFFSET


def free_address(host: str) -> str:
    """``http://host:P`` with P and its peer port (P + 50) free on ``host`` (a loopback address
    standing for a new machine), from this process's share of the ports (``PYGMY_PORT_SLICE``)."""
    low, high = local._port_slice()
    for _ in range(200):
        port = random.randrange(low, high - RAFT_PORT_OFFSET)
        ok = True
        for p in (port, port + RAFT_PORT_OFFSET):
            with socket.socket() as s:
                try:
                    s.bind((host, p))
                except OSError:
                    ok = False
                    break
        if ok:
            return f"http://{host}:{port}"
    raise RuntimeError(f"no free port pair on {host}")


class OperatorError(RuntimeError):
    """A ``pygmy member`` command failed, or left the tier other than the procedure expects."""


class Operator:
    """What an operator types for the cluster in ``data_dir``: ``pygmy member ...``, with ``env``
    (the cluster's) added to the environment; ``members`` asks what ``pygmy member list`` would, in
    this process."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.data_dir, self.env = data_dir, dict(env or {})

    def member(self, *args: str, ok: bool = True, timeout: float = 120) -> str:
        """``pygmy member ARGS``: its output; OperatorError unless it exits 0 (or, ``ok=False``, 1)."""
        r = pygmy("member", *args, "--data-dir", str(self.data_dir), env=self.env, timeout=timeout)
        if (r.returncode == 0) != ok:
            raise OperatorError(f"pygmy member {' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
        return r.stdout + r.stderr

    def json(self, *args: str) -> dict[str, Any]:
        """``pygmy member ARGS --json``: what it printed, parsed (stderr apart)."""
        r = pygmy("member", *args, "--json", "--data-dir", str(self.data_dir), env=self.env, timeout=120)
        if r.returncode != 0:
            raise OperatorError(f"pygmy member {' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
        return json.loads(r.stdout)

    def change(self, *args: str) -> dict[str, Any]:
        """A change (``add``, ``promote``, ``remove``): the configuration it left,
        ``{"voters": [...], "learners": [...], "urls": {...}}``."""
        return self.json(*args)

    def members(self, tier: str) -> dict[str, Any]:
        """What ``pygmy member list TIER --json`` prints: the leader's view, with each member's role
        and lag. Asked in this process, as the command asks it (``members.call``): the waits poll
        it every 0.3 s, and a command's interpreter each time cost more CPU than the answer."""
        if "PYGMY_SECRET" in self.env or any(k.endswith("_URLS") for k in self.env) or not (
                self.data_dir / "run" / "cluster.json").exists():
            return self.json("list", tier)  # settings only the command's environment holds
        try:
            config = ClusterConfig.load(str(self.data_dir))
            config.data_dir = str(self.data_dir)
            return members.call(config, tier, "GET", "/members")
        except (members.MemberError, RuntimeError, ValueError, OSError) as exc:
            raise OperatorError(f"pygmy member list {tier}: {exc}") from None

    def roles(self, tier: str) -> dict[str, str]:
        return {m["name"]: m["role"] for m in self.members(tier)["members"]}


def wait_until(what: str, predicate: Callable[[], object], timeout: float, every: float = 0.3) -> object:
    """``predicate()``'s first true value, asked every ``every`` s; OperatorError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise OperatorError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)
    return value


def _add(op: Operator, tier: str, new: str, url: str, timeout: float) -> dict[str, Any]:
    """``pygmy member add``, again while it fails (a leader lost with the host, its successor not yet
    elected or committed), unless the list shows the add went through anyway (its answer lost)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return op.change("add", tier, new, url)
        except OperatorError:
            try:
                view = op.members(tier)["members"]
            except OperatorError:
                view = []
            if any(m["name"] == new and m["role"] == "learner" for m in view):
                return {"voters": [m["name"] for m in view if m["role"] == "voter"], "learners": [
                    m["name"] for m in view if m["role"] == "learner"]}
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def replace(op: Operator, tier: str, old: str, new: str, url: str, start: Callable[[str], None],
            timeout: float = 60, steps: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Replace ``old`` (dead or alive) by ``new`` at ``url`` in ``tier``: add, ``start(new)``, wait
    until caught up, promote, remove. Appends each step with the configuration it left to ``steps``
    as it goes, and returns them; raises OperatorError if a step is refused or leaves other voters or
    learners than it should."""
    steps = [] if steps is None else steps

    def step(action: str, conf: dict[str, Any], voters: set[str], learners: set[str]) -> None:
        steps.append({"action": action, "voters": conf["voters"], "learners": conf["learners"],
                      "at": time.monotonic_ns()})
        if set(conf["voters"]) != voters or set(conf["learners"]) != learners:
            raise OperatorError(f"{action} {new} for {old} left voters {conf['voters']} and learners "
                                f"{conf['learners']}, expected {sorted(voters)} and {sorted(learners)}")

    added = _add(op, tier, new, url, timeout)
    voters = set(added["voters"])
    if old not in voters:
        raise OperatorError(f"{old} is not a voter of {tier}: {added['voters']}")
    step("add", added, voters, {new})
    start(new)
    steps.append({"action": "started", "at": time.monotonic_ns()})
    wait_until(f"{new} caught up as a learner", lambda: any(
        m["name"] == new and m["role"] == "learner" and m["caught_up"] for m in op.members(tier)["members"]), timeout)
    steps.append({"action": "caught-up", "at": time.monotonic_ns()})
    step("promote", op.change("promote", tier, new, "--wait", str(timeout)), voters | {new}, set())
    step("remove", op.change("remove", tier, old, "--wait", str(timeout)), voters - {old} | {new}, set())
    return steps
