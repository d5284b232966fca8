"""Stand-in for the replication node until the Raft node is wired in: replica 1 is a fixed leader.

It offers the same interface as ``replication.node.ReplicaNode`` so the services do not change
when real replication arrives. Followers run but receive nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from replication.statemachine import StateMachine


class NotLeader(Exception):
    def __init__(self, leader: str | None, url: str | None) -> None:
        super().__init__(f"not the leader (leader: {leader})")
        self.leader_name, self.leader_url = leader, url


class ProposalTimeout(Exception):
    pass


class SoloNode:
    def __init__(self, name: str, peers: dict[str, str], state_machine: StateMachine, **_: Any) -> None:
        self.name, self.peers, self.sm = name, peers, state_machine
        self.leader_name = next(iter(peers))
        self._lock = threading.Lock()
        self._apply_listeners: list[Callable[[int, Any, Any], None]] = []
        self._leader_listeners: list[Callable[[bool, int], None]] = []
        self.blueprint = None

    def start(self) -> None:
        for cb in self._leader_listeners:
            cb(self.is_leader(), 1)

    def stop(self) -> None:
        pass

    def is_leader(self) -> bool:
        return self.name == self.leader_name

    def leader(self) -> tuple[str, str] | None:
        return self.leader_name, self.peers[self.leader_name]

    def term(self) -> int:
        return 1

    def can_serve_reads(self) -> bool:
        return self.is_leader()

    def propose(self, command: dict[str, Any], timeout: float) -> Any:
        if not self.is_leader():
            raise NotLeader(*self.leader())
        with self._lock:
            index = self.sm.applied_index() + 1
            result = self.sm.apply(index, command)
        for cb in self._apply_listeners:
            cb(index, command, result)
        return result

    def wait_applied(self, index: int, timeout: float) -> bool:
        return self.sm.applied_index() >= index

    def add_apply_listener(self, cb: Callable[[int, Any, Any], None]) -> None:
        self._apply_listeners.append(cb)

    def add_leader_listener(self, cb: Callable[[bool, int], None]) -> None:
        self._leader_listeners.append(cb)

    def status(self) -> dict[str, Any]:
        applied = self.sm.applied_index()
        return {
            "name": self.name, "url": self.peers[self.name], "role": "leader" if self.is_leader() else "follower",
            "term": 1, "leader": self.leader_name, "commit_index": applied, "applied_index": applied,
            "state_digest": self.sm.digest(),
        }
