"""Talking to a replicated tier from outside it: writes find the leader, reads any ready replica.

Used by the frontend (to catalog and order) and by the order service (to the catalog). The leader
view is only a hint kept per process: a wrong hint costs one redirect (421 with the leader's name)
or one failed connection, never a wrong answer, so it is safe with several Gunicorn workers.

The tier's replicas are learnt while the process runs (``Sightings``, ``MEMBERS_EVERY``): from the
configuration a replica's ``/status`` shows, the leader's first, so a replica added with ``pygmy
member`` is reached and a removed one left without a restart.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import urllib3

from pygmy.kit import codec, tls
from pygmy.kit.admission import timeout_header
from pygmy.kit.logs import HEADER as REQUEST_ID_HEADER
from pygmy.kit.logs import current_request_id
from pygmy.kit.retry import RetryBudget, backoff, says_overloaded
from pygmy.replication.transport import Abandoned, FrameClient, FrameError, raft_address

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 0.25
#: Reads and writes to a replica; a paused leader must not eat the whole buy deadline. The least an
#: attempt gets: a replica whose answers take longer (a slow link, a loaded tier) gets what its
#: answers showed it needs (``AttemptBudget``), up to MAX_ATTEMPT.
READ_TIMEOUT = 1.0
MAX_ATTEMPT = 5.0
#: The most a connection to a replica may take to open, once the link showed it needs more than
#: CONNECT_TIMEOUT (two round trips of the slowest link the Raft timers follow).
MAX_CONNECT = 2.0
STATUS_TIMEOUT = 0.5
#: A frame request whose reply has not begun for STALL_AFTER makes its router look whether another
#: replica leads now (a stopped leader keeps its connections open and answers nothing), and again
#: every STALL_CHECK while it waits; a look asks replicas' /status with LOOK_TIMEOUT, and is shared
#: by every caller of the router waiting meanwhile (at most one per STALL_CHECK).
STALL_AFTER = 0.25
STALL_CHECK = 0.1
LOOK_TIMEOUT = 0.1
#: How long a replica that did not answer a look is asked last by reads (``Sightings``).
SILENT_FOR = 1.0
#: Longest pause between sweeps of a tier's replicas while it has no leader (an election): short, so
#: a write goes through within a few tens of milliseconds of the new leader being ready. Cheap
#: because writes are batched: one sweep loop per waiting batch (``Combiner``), not per buy.
LEADER_WAIT_CAP = 0.05
#: Status codes that mean "try another replica": not leader, not ready, no quorum.
RETRY_ELSEWHERE = {421, 503}
#: How often a process's routers to a tier look at its members (one ``/status``, the leader's), and
#: the soonest they look again when asked to (a reply named a replica they do not know, or a
#: sweep of every replica found no leader). Membership changes are rare and an operator's doing:
#: a look every few seconds costs the replicas a request each, next to nothing.
MEMBERS_EVERY = 5.0
MEMBERS_SOON = 0.2


#: A request's body, or the function that builds it at each attempt.
Body = dict[str, Any] | Callable[[], dict[str, Any]]

class AttemptBudget:
    """How long one attempt on one replica may take: at least READ_TIMEOUT, or what its answers
    showed (a smoothed time plus four deviations, TCP's retransmission rule), doubled after an
    attempt ran out (the link or the tier may just be slower than anything seen so far), back to
    what answers show once one comes. The connect budget likewise doubles after a connect timed
    out. Updated from many threads without a lock: a lost update only moves a bound a little."""

    __slots__ = ("srtt", "rttvar", "stretch", "connect")

    def __init__(self) -> None:
        self.srtt = 0.0
        self.rttvar = 0.0
        self.stretch = 0.0
        self.connect = CONNECT_TIMEOUT

    def attempt(self) -> float:
        return min(MAX_ATTEMPT, max(READ_TIMEOUT, self.srtt + 4 * self.rttvar, self.stretch))

    def answered(self, took: float) -> None:
        if self.srtt == 0.0:
            self.srtt, self.rttvar = took, took / 2
        else:
            self.rttvar += (abs(self.srtt - took) - self.rttvar) / 4
            self.srtt += (took - self.srtt) / 8
        self.stretch = 0.0

    def slow(self) -> bool:
        """Its answers took a good part of READ_TIMEOUT: a timeout is more likely a slow link than
        a stopped replica."""
        return self.srtt + 4 * self.rttvar > READ_TIMEOUT / 4

    def timed_out(self, used: float) -> None:
        self.stretch = min(MAX_ATTEMPT, 2 * used)

    def connect_timed_out(self) -> None:
        self.connect = min(MAX_CONNECT, 2 * self.connect)


class Sightings:
    """What a process's routers to one tier have found out, shared so that what one finds the others
    use. Only ever hints about where to ask first:

    - replicas found not answering even ``/status`` (stopped, not dead: their connections stay open):
      one router's look spares the others a read timeout on it; any reply from it clears the mark;
    - the leader, as the latest answer found it: the frontend's catalog reads ask first the leader
      its lease renewals found, and after a failover its flushed cache's misses go to the new leader
      rather than wait out a read timeout on the stopped old one (measured: a second, for every
      client at once, in two of ten trials of the catalog leader SIGSTOPped).
    """

    def __init__(self, via: dict[str, str] | None = None,
                 configured: Callable[[], dict[str, str]] | None = None) -> None:
        #: The URLs this process reaches some replicas by instead of theirs (``router_urls``: a
        #: proxy per link): kept for the members a configuration names later.
        self.via = dict(via or {})
        #: The tier's replicas as the deployment's configuration names them now (``cluster.json``,
        #: which ``pygmy member`` keeps): asked when none of the members we know answers, as when
        #: every one of them was replaced while we were not looking.
        self.configured = configured or dict
        self._thread: threading.Thread | None = None
        self._until: dict[str, float] = {}
        self.leader: str | None = None
        self._lock = threading.Lock()
        #: The tier's replicas (``{name: url}``) as a replica's configuration last showed them, and
        #: a counter of changes the routers compare with theirs; empty until first seen.
        self.members: dict[str, str] = {}
        self.members_version = 0
        self._watching = 0  # the pid whose thread looks at the members (0: none yet)
        self._soon = threading.Event()
        self._stop = threading.Event()

    # -- members -----------------------------------------------------------------------------------
    def know(self, peers: dict[str, str]) -> None:
        """The members a router was started with, until a replica says otherwise."""
        with self._lock:
            if not self.members:
                self.members = dict(peers)

    def watch(self) -> None:
        """Look at the tier's members every ``MEMBERS_EVERY`` from now on, on a thread of this
        process (started on first use: a process forked after construction gets its own)."""
        if self._watching == os.getpid() or self._stop.is_set():
            return
        with self._lock:
            if self._watching == os.getpid():
                return
            self._watching = os.getpid()
        self._thread = threading.Thread(target=self._watch, name="tier-members", daemon=True)
        self._thread.start()

    def look_soon(self) -> None:
        self._soon.set()

    def close(self) -> None:
        """Stop looking, and wait for the look under way (at most a second or so): a thread still
        making connections while the interpreter exits races its finalizers."""
        self._stop.set()
        self._soon.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and self._watching == os.getpid():
            thread.join(timeout=5)

    def _watch(self) -> None:
        http = urllib3.PoolManager(num_pools=16, maxsize=1, block=False, retries=False, **tls.pool_options())
        try:
            while not self._stop.is_set():
                self._soon.wait(MEMBERS_EVERY)
                if self._stop.is_set():
                    return
                self._soon.clear()
                try:
                    self.look(http)
                except Exception:  # a hint: never worth the thread
                    log.exception("looking at the tier's members failed")
                self._stop.wait(MEMBERS_SOON)
        finally:
            http.clear()

    def look(self, http: urllib3.PoolManager) -> bool:
        """Ask the leader (as hinted), else every replica, for its ``/status``, and take the
        configuration of a leader within its lease (which ends the asking), else of the newest
        term's leader or replica furthest ahead that answers; if none of them gives one, ask the
        replicas the deployment's configuration names now (``configured``: every member we knew
        may have been replaced while we were not looking). True if the members changed."""
        members = dict(self.members)
        order = ([self.leader] if self.leader in members else []) + [n for n in members if n != self.leader]
        best = self._best(http, members, order)
        if best is None:
            try:
                configured = self.configured()
            except Exception:  # a hint: a missing or half-written file is no reason to fail
                configured = {}
            others = {n: self.via.get(n, u) for n, u in configured.items() if n not in members}
            best = self._best(http, others, list(others))
        if best is None or best == self.members:
            return False
        with self._lock:
            log.info("the tier's replicas are now %s (were %s)", sorted(best), sorted(self.members))
            self.members = best
            self.members_version += 1
        return True

    def _best(self, http: urllib3.PoolManager, members: dict[str, str], order: list[str]) -> dict[str, str] | None:
        """The newest configuration ``members``, asked in ``order``, give (None: none gave one)."""
        best: tuple[tuple[int, int, int], dict[str, str]] | None = None
        for name in order:
            try:
                r = http.request("GET", tls.fit(members[name]) + "/status", timeout=urllib3.Timeout(connect=0.25, read=0.5),
                                 redirect=False)
                st = codec.loads(r.data) if r.status == 200 else None
            except (urllib3.exceptions.HTTPError, ValueError):
                continue
            conf = st.get("membership") if isinstance(st, dict) else None
            if not isinstance(conf, dict) or not isinstance(conf.get("urls"), dict):
                continue
            names = {*conf.get("voters", ()), *conf.get("learners", ())}
            urls = {n: self.via.get(n, u) for n, u in conf["urls"].items() if n in names and isinstance(u, str)}
            # A leader within its lease first, then the newest term (a leader whose lease lapsed may
            # be a deposed one, behind a follower of its successor's term), then a leader over its
            # own term's followers, then the longest log.
            leads = st.get("role") == "leader"
            rank = (int(leads and bool(st.get("leader_lease"))), int(st.get("term", 0)), int(leads),
                    int(st.get("commit_index", 0)))
            if urls and (best is None or rank > best[0]):
                best = (rank, urls)
            if rank[0] and best is not None and best[1] is urls:
                # A leader within its lease: no newer term can have begun, so its configuration is
                # the newest any replica has. One whose lease lapsed may have been deposed without
                # knowing it (cut off, paused): the others are asked too, and the newest term wins.
                break
        return None if best is None else best[1]

    def forget_leader(self, name: str) -> None:
        """``name`` did not answer: no longer ask it first, unless another router has moved on."""
        with self._lock:
            if self.leader == name:
                self.leader = None

    def mark(self, name: str, seconds: float = SILENT_FOR) -> None:
        self._until[name] = time.monotonic() + seconds

    def clear(self, name: str) -> None:
        if self._until:
            self._until.pop(name, None)

    def silent(self, name: str) -> bool:
        return self._until.get(name, 0.0) > time.monotonic()


class Watchers:
    """The ``Sightings`` of one process's routers, stopped with its worker (``pygmy_sightings``)."""

    def __init__(self, *sightings: Sightings) -> None:
        self.sightings = sightings

    def stop(self) -> None:
        for s in self.sightings:
            s.close()


class TierUnavailable(Exception):
    """No replica of the tier gave an answer before the deadline."""

    def __init__(self, tier: str, last: str) -> None:
        super().__init__(f"{tier} unavailable: {last}")
        self.tier, self.last = tier, last


#: The leader as the answering replica knows it, on every replica's answer: a router that only
#: reads (a frontend's catalog reads) learns from it where reads are cheapest (``TierRouter.read``).
LEADER_HEADER = "X-Raft-Leader"


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    replica: str
    leader: str | None = None  # the answering replica's ``LEADER_HEADER``


class _LeaderSeeker:
    """The leader hint of one tier and the loop that finds the leader: shared by HTTP and frames."""

    def __init__(self, tier: str, peers: dict[str, str], sightings: Sightings | None = None) -> None:
        self.tier = tier
        self.sightings = sightings or Sightings()
        self.peers = dict(peers)
        self.names = list(peers)
        self.sightings.know(self.peers)
        # Look at the members from now on, not from the first request: a replica that sends the
        # tier nothing for a while (an order follower) must still follow its replacements, or it
        # leads one day knowing only replicas long gone.
        self.sightings.watch()
        self._members_version = 0
        #: Bounds the retries that could add to an overload (see ``_to_leader``).
        self.budget = RetryBudget()
        #: Per replica: how long an attempt may take (what its answers showed).
        self.attempts = {n: AttemptBudget() for n in peers}

    def follow_members(self) -> None:
        """Take the tier's members as the process last learnt them (``Sightings.look``): called
        before each request, a comparison of two counters unless they changed."""
        s = self.sightings
        s.watch()
        if s.members_version != self._members_version:
            self._members_version = s.members_version
            self._set_peers(dict(s.members))

    def _set_peers(self, peers: dict[str, str]) -> None:
        """Reach ``peers`` from now on (a subclass opens what it needs to reach new ones)."""
        self.peers = peers
        self.names = list(peers)

    def attempt_budget(self, name: str) -> AttemptBudget:
        """``name``'s attempt budget (a replica that joined since has one from its first call)."""
        budget = self.attempts.get(name)
        if budget is None:
            budget = self.attempts[name] = AttemptBudget()
        return budget

    @property
    def leader_hint(self) -> str | None:
        """Where to ask first: the leader as this process's routers to the tier last found it."""
        return self.sightings.leader

    @leader_hint.setter
    def leader_hint(self, name: str | None) -> None:
        self.sightings.leader = name

    def _note_leader(self, reply: Reply) -> str | None:
        leader = reply.body.get("error", {}).get("leader") if reply.status == 421 else None
        if leader in self.peers:
            self.leader_hint = leader
        elif reply.status == 421:
            self.sightings.forget_leader(reply.replica)
            if leader:
                self.sightings.look_soon()  # a leader we do not know of: the members changed
        return leader

    def leader_first(self) -> list[str]:
        """The replicas, the one last known to lead first."""
        hint = self.leader_hint
        rest = [n for n in self.names if n != hint]
        # (the hint is shared: another router may have found a member this one has not heard of yet)
        return ([hint] if hint in self.names else []) + rest

    def _to_leader(self, attempt: Callable[[str, float], Reply], deadline: float) -> Reply:
        """``attempt(replica, timeout)`` on the leader, following redirects and failing over on
        connection errors, until ``deadline`` (monotonic).

        A 503 that sheds load (``overloaded``) comes back to the caller at once: only the leader can
        take a write, and asking it again would add to its load. It says nothing was done, so it comes
        back as a plain 503 (outcome unknown) if an earlier attempt may have done it. A retry after a timeout (the
        replica may still be working on it) needs the retry budget; fast failures (refused
        connections, "not the leader", "not ready") cost the replicas almost nothing and are only
        spaced out, with jittered exponential backoff between sweeps.
        """
        last = "no replica tried"
        tries = 0
        unsure = False  # an earlier attempt may have reached a replica and done the work
        self.budget.request()
        self.follow_members()
        while True:
            for name in self.leader_first():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TierUnavailable(self.tier, last)
                budget = self.attempt_budget(name)
                timeout = min(budget.attempt(), remaining)
                started = time.monotonic()
                try:
                    reply = attempt(name, timeout)
                except Abandoned as exc:  # another replica leads now: go there (the key makes it safe)
                    last = f"{name}: {exc}"
                    self.leader_hint = exc.reason
                    unsure = True
                    break
                except OSError as exc:  # HopError and the transport's errors
                    last = f"{name}: {type(exc).__name__}"
                    unsure = unsure or _may_have_arrived(exc)
                    self.sightings.forget_leader(name)
                    if _timed_out(exc):
                        if timeout < remaining and not self.sightings.silent(name):
                            budget.timed_out(timeout)  # alive (it answers /status), only slow
                        if not self.budget.try_retry():
                            raise TierUnavailable(self.tier, f"{last} (retry budget spent)") from None
                    elif getattr(exc, "connect_timed_out", False):
                        budget.connect_timed_out()
                    continue
                if reply.status not in RETRY_ELSEWHERE:
                    budget.answered(time.monotonic() - started)
                if reply.status not in RETRY_ELSEWHERE or overloaded(reply):
                    if reply.status not in RETRY_ELSEWHERE:
                        self.leader_hint = name
                    if unsure and overloaded(reply):
                        # "Overloaded" promises nothing was done; an earlier attempt may have done it.
                        message = f"{last}, then shed by {name}: the outcome is unknown (retry with the same key)"
                        return Reply(503, {"error": {"code": 503, "message": message}}, name, reply.leader)
                    return reply
                last = f"{name}: {reply.status} {reply.body.get('error', {}).get('message', '')}"
                unsure = unsure or reply.status == 503  # it may say the outcome is not known yet
                leader = self._note_leader(reply)
                if leader and leader != name and leader in self.peers:
                    break  # go straight to the leader it named
            else:
                self.sightings.look_soon()  # none of those we know leads: have the members changed?
            tries += 1
            # Between sweeps (e.g. an election in progress) back off, bounded by the deadline.
            time.sleep(min(backoff(tries, cap=LEADER_WAIT_CAP), max(0.0, deadline - time.monotonic())))
            self.follow_members()


def overloaded(reply: Reply) -> bool:
    """A replica shed this request (``pygmy.kit.retry.says_overloaded``)."""
    return says_overloaded(reply.status, reply.body)


def _may_have_arrived(exc: OSError) -> bool:
    """Whether a failed call may have reached the replica (a timeout, a reset, an abandoned wait),
    rather than failed to connect at all."""
    if getattr(exc, "connect_timed_out", False):
        return False
    cause: BaseException | None = exc
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ConnectionRefusedError | urllib3.exceptions.NewConnectionError):
            return False
        cause = cause.__cause__ or getattr(cause, "reason", None)
    return True


def _timed_out(exc: OSError) -> bool:
    return isinstance(exc, TimeoutError) or getattr(exc, "timed_out", False)


class ChannelRouter(_LeaderSeeker):
    """Calls the leader of a tier on one channel of its peer transport (``pygmy.replication.transport``):
    for internal traffic many times a second, such as cache lease renewals, where an HTTP request
    through Flask would cost more than the work. The leader answers ``{"status", "body"}``."""

    def __init__(self, tier: str, peers: dict[str, str], secret: str, name: str, channel: str,
                 sightings: Sightings | None = None) -> None:
        super().__init__(tier, peers, sightings)
        self._clients = {n: FrameClient(raft_address(url), secret, name, channel, connect_timeout=CONNECT_TIMEOUT,
                                        server=n) for n, url in peers.items()}
        self._headers = {"Authorization": f"Bearer {secret}"}
        self._status_pools = {n: urllib3.connection_from_url(tls.fit(url), maxsize=1, block=False, retries=False,
                                                             **tls.pool_options())
                              for n, url in peers.items()}
        self._look_lock = threading.Lock()
        self._looked: tuple[float, str | None] = (float("-inf"), None)
        self._asked: dict[str, float] = {}  # replica -> when a look last asked it about itself
        self._secret, self._name, self._channel = secret, name, channel

    def _set_peers(self, peers: dict[str, str]) -> None:
        """A client and a status pool for each replica new to us, or at a new URL; those of
        replicas gone stay open, unused, until ``close`` (a caller may hold one right now)."""
        clients, pools = dict(self._clients), dict(self._status_pools)
        for n, url in peers.items():
            if n not in clients or self.peers.get(n) != url:
                clients[n] = FrameClient(raft_address(url), self._secret, self._name, self._channel,
                                         connect_timeout=CONNECT_TIMEOUT, server=n)
                pools[n] = urllib3.connection_from_url(tls.fit(url), maxsize=1, block=False, retries=False, **tls.pool_options())
        self._clients, self._status_pools = clients, pools
        super()._set_peers(peers)

    def call(self, payload: Body, deadline: float, carry_deadline: bool = False) -> Reply:
        """``payload`` to the leader, following redirects and failing over, until ``deadline``.
        ``carry_deadline``: send it as a request of ``ReplicaRuntime.serve_frames`` (``{"body",
        "timeout_ms", "request_id"}``), passing on what is left of the deadline at each attempt.
        A callable ``payload`` is asked for the body at each attempt (``batch_write``)."""
        rid = current_request_id()

        def attempt(name: str, timeout: float) -> Reply:
            body = payload() if callable(payload) else payload
            frame = body if not carry_deadline else {
                "body": body, "timeout_ms": max(0, int((deadline - time.monotonic()) * 1000)), "request_id": rid}
            answer = self._clients[name].call(frame, timeout, stalled=lambda: self._leader_elsewhere(name),
                                              first_check=STALL_AFTER, check_every=STALL_CHECK,
                                              connect_within=deadline - time.monotonic())
            self.sightings.clear(name)
            if not isinstance(answer, dict) or not isinstance(answer.get("body"), dict):
                raise FrameError(f"{name}: malformed answer")
            return Reply(int(answer.get("status", 500)), answer["body"], name)

        return self._to_leader(attempt, deadline)

    def write_batch(self, items: list[tuple[dict[str, Any], float]], cap: float, expired: Reply) -> list[Reply]:
        """``batch_write`` as one request frame to the leader on this router's channel."""
        return batch_write(lambda body, deadline: self.call(body, deadline, carry_deadline=True), items, cap, expired)

    def _status(self, name: str) -> dict[str, Any] | None:
        try:
            resp = self._status_pools[name].urlopen("GET", "/status", headers=self._headers, redirect=False,
                                                    timeout=urllib3.Timeout(connect=LOOK_TIMEOUT, read=LOOK_TIMEOUT))
            body = codec.loads(resp.data) if resp.status == 200 else None
        except (urllib3.exceptions.HTTPError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    def _leader_elsewhere(self, name: str) -> str | None:
        """The replica that leads instead of ``name``, which has not begun to answer: one that says
        it is leader, in a term newer than any ``name`` still answers /status with as leader (a
        stopped one answers nothing, and is marked silent). None: keep waiting, ``name`` may just
        be slow. One look per STALL_CHECK per router, shared by every caller waiting meanwhile.

        ``name`` itself is asked at most once per SILENT_FOR while nobody claims to lead (a leader
        that is merely busy gets one status request a second from a waiting router), and not
        again when a claim comes while it is marked silent: a stopped leader is found out while
        its successor's election is still on, so the look that finds the successor goes there at
        once instead of waiting out LOOK_TIMEOUT on ``name`` (about 100 ms of every failover of a
        stopped leader, docs/performance.md, "Failover windows")."""
        with self._look_lock:
            now = time.monotonic()
            at, found = self._looked
            if now - at < STALL_CHECK:
                return found if found != name else None
            found = None
            claims = [(int(st.get("term", 0)), other) for other in self.names if other != name
                      if (st := self._status(other)) and st.get("role") == "leader"]
            if claims:
                term, other = max(claims)
                mine = None if self.sightings.silent(name) else self._ask(name, now)
                if not (mine and mine.get("role") == "leader" and int(mine.get("term", 0)) >= term):
                    found = other
                    log.info("%s: %s is not answering and %s leads in term %d: asking it instead",
                             self.tier, name, other, term)
            elif not self.sightings.silent(name) and now - self._asked.get(name, float("-inf")) >= SILENT_FOR:
                self._ask(name, now)
            self._looked = (time.monotonic(), found)
            return found

    def _ask(self, name: str, now: float) -> dict[str, Any] | None:
        """``name``'s status during a look, marked silent if it gives none."""
        self._asked[name] = now
        st = self._status(name)
        if st is None:
            self.sightings.mark(name)
        return st

    def close(self) -> None:
        self.sightings.close()  # its look at the members stops with the routers that share it
        for client in self._clients.values():
            client.close()
        for pool in self._status_pools.values():
            pool.close()


def batch_write(write: Callable[[Body, float], Reply], items: list[tuple[dict[str, Any], float]],
                cap: float, expired: Reply) -> list[Reply]:
    """The writes of several callers (a ``Combiner`` batch of ``(body, deadline)``) as one request
    ``write({"items": [...]}, deadline)`` to the leader, each item with its own ``timeout_ms``, as
    left at each attempt (``write`` gets the function that builds the body: a retry after a failover
    must not give an item the time it had at the first); the
    leader answers ``{"results": [{"status", "body"}, ...]}`` in order, and each caller gets its own
    Reply, as if it had been sent alone. Items whose deadline has passed are not sent (``expired``);
    the request lasts until the latest deadline of the rest, at most ``cap`` seconds. If the batch
    itself fails (shed, 4xx, tier unavailable), every item hears it."""
    now = time.monotonic()
    out = [expired] * len(items)
    live = [i for i, (_, deadline) in enumerate(items) if deadline > now]
    if not live:
        return out
    def body() -> dict[str, Any]:
        at = time.monotonic()  # an item whose time ran out since goes with 0 ms: the leader refuses it (504)
        return {"items": [{**items[i][0], "timeout_ms": max(0, int((items[i][1] - at) * 1000))} for i in live]}

    reply = write(body, min(now + cap, max(items[i][1] for i in live)))
    results = reply.body.get("results") if reply.status == 200 else None
    if not isinstance(results, list) or len(results) != len(live):
        results = [None] * len(live)
    failed = reply if reply.status != 200 else Reply(
        502, {"error": {"code": 502, "message": f"malformed batch answer from {reply.replica}"}}, reply.replica)
    for i, r in zip(live, results, strict=True):
        ok = isinstance(r, dict) and isinstance(r.get("status"), int) and isinstance(r.get("body"), dict)
        out[i] = Reply(r["status"], r["body"], reply.replica) if ok else failed  # type: ignore[index]
    return out


class HopError(OSError):
    """A call to a replica got no answer (refused, reset, timed out): try another one."""

    def __init__(self, message: str, timed_out: bool = False, connect_timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.connect_timed_out = connect_timed_out


class TierRouter(_LeaderSeeker):
    """HTTP to the replicas of one tier, on urllib3 connection pools: Requests' session machinery
    (hooks, cookies, proxies, adapters) cost more CPU per internal call than the Flask handler that
    answered it (profiled under 32 buyers), and none of it is wanted between our own services."""

    def __init__(self, tier: str, peers: dict[str, str], secret: str, pool: int = 64,
                 sightings: Sightings | None = None) -> None:
        super().__init__(tier, peers, sightings)
        self.headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
        self._pools = {name: urllib3.connection_from_url(tls.fit(url), maxsize=pool, block=False, retries=False,
                                                         **tls.pool_options())
                       for name, url in self.peers.items()}
        self._rr = itertools.count()
        self._avoid: dict[str, float] = {}  # replica -> monotonic time until which reads skip it
        self._lock = threading.Lock()  # guards ``_avoid``
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(peers)), thread_name_prefix=f"{tier}-status")
        self._pool_size = pool

    def _set_peers(self, peers: dict[str, str]) -> None:
        pools = dict(self._pools)
        for n, url in peers.items():
            if n not in pools or self.peers.get(n) != url:
                pools[n] = urllib3.connection_from_url(tls.fit(url), maxsize=self._pool_size, block=False, retries=False,
                                                       **tls.pool_options())
        self._pools = pools
        super()._set_peers(peers)

    def close(self) -> None:
        self.sightings.close()  # its look at the members stops with the routers that share it
        self._pool.shutdown(wait=False, cancel_futures=True)
        for pool in self._pools.values():
            pool.close()

    # -- one call ---------------------------------------------------------------------------------
    def _call(self, name: str, method: str, path: str, timeout: float, *, json: Any = None,
              params: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
              deadline: float | None = None) -> Reply:
        """One request; raises HopError when there is no answer. Any answer, even an error, is a Reply.
        ``deadline`` travels with it: the replica gets what is left of it (``X-Request-Timeout-Ms``)."""
        all_headers = {**self.headers, **(headers or {})}
        if deadline is not None:
            all_headers.update(timeout_header(deadline))
        rid = current_request_id()  # carried on, so one request can be followed across the logs
        if rid:
            all_headers[REQUEST_ID_HEADER] = rid
        if params:
            path = f"{path}?{urlencode(params)}"
        budget = connect = self.attempt_budget(name).connect
        if deadline is not None:  # a connect the link needs longer for than is left would overrun it
            connect = min(connect, max(0.001, deadline - time.monotonic()))
        try:
            resp = self._pools[name].urlopen(
                method, path, body=None if json is None else codec.dumps(json), headers=all_headers,
                timeout=urllib3.Timeout(connect=connect, read=timeout), redirect=False)
        except urllib3.exceptions.HTTPError as exc:
            reason = getattr(exc, "reason", None)
            # A connect cut short by the deadline says nothing of the link: its budget learns nothing.
            raise HopError(f"{name}: {type(exc).__name__}",
                           timed_out=isinstance(exc, urllib3.exceptions.ReadTimeoutError),
                           connect_timed_out=connect >= budget and (
                               isinstance(exc, urllib3.exceptions.ConnectTimeoutError)
                               or isinstance(reason, urllib3.exceptions.ConnectTimeoutError))) from exc
        self.sightings.clear(name)
        try:
            body = codec.loads(resp.data)
        except ValueError:
            body = {"error": {"code": resp.status, "message": resp.data[:200].decode("utf-8", "replace")}}
        return Reply(resp.status, body if isinstance(body, dict) else {"value": body}, name,
                     resp.headers.get(LEADER_HEADER))

    def get(self, name: str, path: str, timeout: float) -> Reply:
        """One GET to one replica (health probes); raises HopError without an answer."""
        return self._call(name, "GET", path, timeout)

    # -- writes -----------------------------------------------------------------------------------
    def write(self, path: str, body: Body, deadline: float, headers: dict[str, str] | None = None) -> Reply:
        """POST to the leader, following redirects and failing over, until ``deadline`` (monotonic).
        A callable ``body`` is asked for it at each attempt (``batch_write``)."""
        return self._to_leader(
            lambda name, timeout: self._call(name, "POST", path, timeout, json=body() if callable(body) else body,
                                             headers=headers or {}, deadline=deadline), deadline)

    def write_batch(self, path: str, items: list[tuple[dict[str, Any], float]], cap: float,
                    expired: Reply) -> list[Reply]:
        """``batch_write`` as one POST of ``{"items": [...]}`` to the leader's ``path``."""
        return batch_write(lambda body, deadline: self.write(path, body, deadline), items, cap, expired)

    # -- reads ------------------------------------------------------------------------------------
    def read(self, path: str, deadline: float, params: dict[str, Any] | None = None,
             prefer_leader: bool = False) -> Reply:
        """GET from any ready replica (round robin), skipping ones that recently refused.

        Every replica read is linearizable (it waits for the leader's read index), so any replica
        answers correctly; ``prefer_leader`` asks the leader first, which takes its read index
        locally and so costs one request less than a follower, which must ask the leader for it.
        A router that only reads learns the leader from the answers (``LEADER_HEADER``): a
        frontend's catalog router never writes, so it asked every replica in turn, and two misses
        in three paid a follower's request to the leader (a miss took 5.9 ms at the frontend,
        3.4 ms once served by the leader: back to back on an idle cluster, 1,000 books).
        """
        last = "no replica tried"
        attempt = 0
        self.budget.request()
        self.follow_members()
        while True:
            for name in self._read_order(prefer_leader):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TierUnavailable(self.tier, last)
                budget = self.attempt_budget(name)
                timeout = min(budget.attempt(), remaining)
                started = time.monotonic()
                try:
                    reply = self._call(name, "GET", path, timeout, params=params, deadline=deadline)
                except HopError as exc:
                    last = str(exc)
                    self._avoid_for(name, 1.0)
                    if exc.timed_out:
                        if timeout < remaining and budget.slow():
                            budget.timed_out(timeout)  # it has been slow to answer, not silent
                        if not self.budget.try_retry():
                            raise TierUnavailable(self.tier, f"{last} (retry budget spent)") from None
                    elif exc.connect_timed_out:
                        budget.connect_timed_out()
                    continue
                if reply.status not in RETRY_ELSEWHERE:
                    budget.answered(time.monotonic() - started)
                if reply.status not in RETRY_ELSEWHERE:
                    # A replica that served a read had its read index from the leader it names (or
                    # is it): so the next read goes there first. One that could not serve may name a
                    # leader that stopped, and is not believed.
                    if reply.leader != self.leader_hint and reply.leader in self.peers:
                        self.leader_hint = reply.leader
                    elif reply.leader and reply.leader not in self.peers:
                        self.sightings.look_soon()  # a leader we do not know of: the members changed
                    return reply
                last = f"{name}: {reply.status}"
                self._avoid_for(name, 0.5)
                if overloaded(reply) and not self.budget.try_retry():
                    return reply  # shed, and no budget to ask another replica: the caller sheds too
            attempt += 1
            self.sightings.look_soon()  # none of those we know could serve: have the members changed?
            time.sleep(min(backoff(attempt, cap=0.2), max(0.0, deadline - time.monotonic())))
            self.follow_members()

    def _avoid_for(self, name: str, seconds: float) -> None:
        with self._lock:
            self._avoid[name] = time.monotonic() + seconds

    def _read_order(self, prefer_leader: bool = False) -> list[str]:
        now = time.monotonic()
        start = next(self._rr) % len(self.names)
        ring = self.names[start:] + self.names[:start]
        with self._lock:
            if prefer_leader and self.leader_hint in ring:
                ring.remove(self.leader_hint)
                ring.insert(0, self.leader_hint)
            good = [n for n in ring if self._avoid.get(n, 0) <= now and not self.sightings.silent(n)]
            bad = [n for n in ring if n not in good]
        return good + bad

    # -- cluster view -----------------------------------------------------------------------------
    def statuses(self) -> list[dict[str, Any]]:
        """Every replica's own ``/status`` (plus ``alive``), fetched in parallel with a short timeout:
        of the members as they were when it began (a replacement meanwhile replaces ``peers``
        whole, and a member it removed must not fail the look; frontend ``/status`` answered 500)."""
        self.follow_members()
        peers = self.peers

        def one(name: str) -> dict[str, Any]:
            try:
                reply = self._call(name, "GET", "/status", STATUS_TIMEOUT)
                if reply.status == 200:
                    return {**reply.body, "alive": True}
            except HopError:
                pass
            return {"name": name, "url": peers[name], "alive": False}

        return list(self._pool.map(one, list(peers)))
