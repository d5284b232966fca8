"""Raft timers that follow the network: from the round trips a leader measures to its followers, the
heartbeat interval, election window and lost-append timeout it should use (``core.Timing``).

Pure, like the core: the node (``ReplicaNode``) times its heartbeats and feeds the samples in with
its own clock readings; nothing here reads a clock. etcd's tuning guide is the anchor: a heartbeat
about one round trip, an election timeout ten round trips or more. On loopback (a round trip well
under a millisecond) every derived value is below the configured one, and the core keeps the
configured one (it never goes below), so a LAN cluster runs exactly as configured.

The median round trip sets the pace (a heartbeat of one, a window of ten); the tail sets a floor
under the window: over TCP a loss does not lose a heartbeat, it delays it (a retransmission after
a timeout of at least 200 ms), and a window must absorb that. A CPU-bound machine's scheduling
hiccups land in the tail too, so the tail's weight is small: a busy LAN keeps its configured window.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from pygmy.replication.core import Timing

#: Samples kept per peer, and how old one may be.
SAMPLES = 64
SAMPLE_AGE = 60.0
#: The tail of a peer's round trips: this percentile.
TAIL = 0.99
#: Median round trips per heartbeat, per election window and per lost-append timeout (plus a
#: heartbeat); tail round trips per election window.
HEARTBEAT_RTTS = 1.0
ELECTION_RTTS = 10.0
PROBE_RTTS = 2.0
ELECTION_TAILS = 2.0
#: A lower timing is taken only once it has been asked for this long: raising is at once.
HOLD = 30.0


def ticks_due(behind: float, tick_s: float, until_timer: int, slack: int) -> int:
    """How many ticks a driver counts when its next tick fell due ``behind`` seconds ago and the
    core's next timer is ``until_timer`` ticks away: every tick that passed, except after a stall,
    when it counts the ticks up to that timer and only ``slack`` beyond it (the rest dropped rather
    than stormed: fewer ticks than time passed only make timers later, never earlier).

    Up to the timer, not ``slack`` alone: an idle follower sleeps until its election timer, which
    the timers stretch to seconds on a slow network (or after a slow learner was promoted). Capped
    at ``slack`` per wake, a follower with a 7 s timeout counted 1.2 s per sleep and slept again
    for the rest: it campaigned after some 24 s, a tier whose leader died went that long without
    one (found by the nemesis' ``host-lost``)."""
    return min(int(behind / tick_s) + 1, max(1, until_timer) + slack)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def derive(rtts: dict[str, tuple[float, float]], needed: int, tick_ms: float) -> Timing:
    """The timing for round trips ``rtts`` (seconds, per follower: median and tail) when ``needed``
    followers must answer for a majority: the ``needed``-th nearest follower sets the pace (a far
    minority can neither commit nor keep a leader, and must not slow the rest). No samples: no
    demand."""
    if needed <= 0 or len(rtts) < needed:
        return Timing()
    median, tail = sorted(rtts.values())[needed - 1]
    per_tick = 1000.0 / tick_ms
    heartbeat = math.ceil(HEARTBEAT_RTTS * median * per_tick)
    election = math.ceil(max(ELECTION_RTTS * median, ELECTION_TAILS * tail) * per_tick)
    return Timing(heartbeat_ticks=heartbeat, election_ticks=election,
                  probe_ticks=math.ceil(PROBE_RTTS * median * per_tick) + heartbeat)


def implied(election_ticks: int) -> Timing:
    """The timing a window of ``election_ticks`` stands for (as ``derive`` would give it from the
    median alone): what a new leader keeps before it has measured anything."""
    per_rtt = election_ticks / ELECTION_RTTS
    heartbeat = math.ceil(HEARTBEAT_RTTS * per_rtt)
    return Timing(heartbeat_ticks=heartbeat, election_ticks=election_ticks,
                  probe_ticks=math.ceil(PROBE_RTTS * per_rtt) + heartbeat)


@dataclass
class RttMeter:
    """Round trips to each peer, from heartbeats sent and their answers (the node's clock readings)."""

    samples: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    #: (peer, the heartbeat's ctx) -> when it was sent.
    _sent: dict[tuple[str, int], float] = field(default_factory=dict)
    #: Peers seen caught up with the leader at least once: only their heartbeats are timed.
    _timed: set[str] = field(default_factory=set)

    def sent(self, peer: str, ctx: int, now: float, caught_up: bool = True) -> None:
        """A heartbeat to ``peer`` left at ``now``. Not timed until ``peer`` has once been
        ``caught_up``: a replica that is still starting, or writing the log or snapshot it missed,
        answers late because it is busy, not because the link is slow (a joining replica's first
        seconds stretched a LAN tier's window to seconds, for the hold's 30 s). Once it was, it is
        timed however far behind it falls: on a slow link a loaded follower lags, and that link's
        round trips must count."""
        if caught_up:
            self._timed.add(peer)
        if peer not in self._timed:
            return
        self._sent[(peer, ctx)] = now
        if len(self._sent) > 16 * SAMPLES:  # answers that never came (a peer down, a lost frame)
            for key in [k for k, t in self._sent.items() if now - t > SAMPLE_AGE]:
                del self._sent[key]

    def answered(self, peer: str, ctx: int, now: float) -> None:
        at = self._sent.pop((peer, ctx), None)
        if at is not None:
            self.samples.setdefault(peer, deque(maxlen=SAMPLES)).append((now, now - at))

    def forget(self, peer: str) -> None:
        """``peer`` left the configuration: a replica added later under its name is another, on
        another link, and is timed only once it has caught up (``sent``)."""
        self.samples.pop(peer, None)
        self._timed.discard(peer)
        for key in [k for k in self._sent if k[0] == peer]:
            del self._sent[key]

    def forget_pending(self) -> None:
        """Drop the heartbeats still unanswered: their answers would time a stall of our own."""
        self._sent.clear()

    def rtts(self, now: float) -> dict[str, tuple[float, float]]:
        """Each peer's median and ``TAIL`` round trip over its recent samples (seconds)."""
        out = {}
        for peer, window in self.samples.items():
            recent = [rtt for at, rtt in window if now - at <= SAMPLE_AGE]
            if recent:
                out[peer] = (percentile(recent, 0.5), percentile(recent, TAIL))
        return out


@dataclass
class Hold:
    """Takes a higher timing at once and a lower one only once it has been asked for ``hold``
    seconds, so one quiet minute after a slow one does not shrink the windows back and forth."""

    hold: float = HOLD
    _asked: deque[tuple[float, Timing]] = field(default_factory=deque)

    def update(self, now: float, timing: Timing) -> Timing:
        self._asked.append((now, timing))
        while self._asked and now - self._asked[0][0] > self.hold:
            self._asked.popleft()
        asked = [t for _, t in self._asked]
        return Timing(heartbeat_ticks=max(t.heartbeat_ticks for t in asked),
                      election_ticks=max(t.election_ticks for t in asked),
                      probe_ticks=max(t.probe_ticks for t in asked))
