"""What every replica of a replicated tier serves, whatever its business: health, status, leadership,
and the tier's membership (``/members``: list, add a learner, promote, remove; hand leadership to a voter).

Catalog and order build their Flask apps on ``ReplicaRuntime``; it owns the replication node and
turns its exceptions into HTTP answers (421 with the leader's name, 503 while not ready).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from flask import Flask, Response, jsonify, request, send_file

from pygmy.kit import tls
from pygmy.kit.config import ClusterConfig, parse_name
from pygmy.kit.logs import request_id_scope, valid_request_id
from pygmy.kit.metrics import FRAME_LATENCY
from pygmy.kit.web import (
    ApiError,
    access_log,
    create_base_app,
    error_body,
    fail,
    json_body,
    plain_int,
    request_deadline,
    require_secret,
)
from pygmy.replication.core import MembershipRefused
from pygmy.replication.metrics import ReplicaCollector
from pygmy.replication.node import (
    NotLeader,
    ProposalTimeout,
    ReadIndexUnavailable,
    ReplicaNode,
    ReplicationConfig,
)
from pygmy.replication.router import LEADER_HEADER
from pygmy.replication.statemachine import StateMachine
from pygmy.replication.transport import RAFT_PORT_OFFSET, after_reply

log = logging.getLogger(__name__)

#: Longest a read waits for its replica to apply an index the caller already saw.
READ_WAIT = 0.5
#: A request's time budget on a frame channel when the frame gives none (as ``X-Request-Timeout-Ms``).
FRAME_DEADLINE = 5.0

#: ``handle(body, deadline)``: the answer body of a request served as a frame (``ReplicaRuntime.serve_frames``).
FrameHandler = Callable[[dict[str, Any], float], dict[str, Any]]
#: Longest a membership change waits for its commit (the caller's ``X-Request-Timeout-Ms`` may be less).
MEMBER_CHANGE_WAIT = 5.0
#: Why a change was refused -> the status it is answered with (nothing changed in any case).
REFUSAL_STATUS = {"unknown": 404, "invalid": 400, "duplicate": 409, "not_learner": 409, "lagging": 409,
                  "last_voter": 409, "pending": 409, "transferring": 409, "not_leader": 421}


def check_member_url(url: Any) -> str:
    """A member's URL as the others will dial it: ``http://host:port`` (no path; ``https`` with
    TLS); 400 otherwise."""
    scheme = "https" if tls.active() else "http"
    if not isinstance(url, str) or len(url) > 200:
        fail(400, f"url must be a string like {scheme}://10.0.0.4:8104", kind="invalid")
    parts = urlsplit(url.rstrip("/"))
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != scheme or not parts.hostname or port is None or parts.path or parts.query:
        fail(400, f"url must be {scheme}://host:port, got {url[:80]!r}", kind="invalid")
    return url.rstrip("/")


class Periodic:
    """A replica's periodic duty (the catalog's restocking, the order leader's key expiry): ``work``
    every ``every`` seconds while ``due``, on a thread of its own that ``stop`` ends. Supervised: a
    failed round (no quorum, a full disk, a bug) is logged and the next one retries."""

    def __init__(self, name: str, every: float) -> None:
        self.name, self.every = name, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def due(self) -> bool:
        return True

    def work(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a round still under way after ``stop`` to end."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if not self.due():
                continue
            try:
                self.work()
            except Exception as exc:  # the next round tries again
                log.warning("%s: a round failed (retried in %.0f s): %s", self.name, self.every, exc)


class ReplicaRuntime:
    def __init__(self, tier: str, k: int, config: ClusterConfig, state_machine: StateMachine) -> None:
        self.tier, self.k, self.config = tier, k, config
        self.name = f"{tier}-{k}"
        self.secret = config.secret()
        self.sm = state_machine
        self.peers = config.peers(tier)
        # Where this replica dials each peer: the address its URL gives, now and after any change of
        # the tier (a name removed and added again elsewhere), unless ``peer_addresses`` routes the
        # link elsewhere (a proxy of its own, pygmy/verify/links.py): only those are pinned here.
        addresses = {p: a for p in self.peers if (a := config.peer_address(self.name, p)) is not None}
        self.node = ReplicaNode(
            name=self.name, peers=self.peers, state_machine=state_machine,
            data_dir=config.replica_dir(self.name), secret=self.secret, config=ReplicationConfig.from_env(),
            listen=(config.bind_address(self.name), config.listen_port(tier, k) + RAFT_PORT_OFFSET),
            addresses=addresses,
            learners=config.learners(tier),
        )
        self.guard = require_secret(self.secret)
        #: The operator's endpoints (``/members``, ``/backup``, ``/verify``): with TLS, for the
        #: ``admin`` certificate alone, as the tools hold (a frontend's reaches this port too).
        self.operator = self.only(*tls.OPERATOR)
        #: Frame requests being served (``serve_frames``), and whether new ones are refused (``drain``).
        self._frames = threading.Condition()
        self._frames_in_flight = 0
        self._draining = False

    def only(self, *roles: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The internal secret's guard, and with TLS a certificate of one of ``roles``."""
        return require_secret(self.secret, roles=frozenset(roles))

    def create_app(self) -> Flask:
        app = create_base_app(self.name, lambda: [ReplicaCollector(self.name, self.node)],
                              limits=self.config.limits(self.tier))

        @app.after_request
        def _name_the_leader(resp: Response) -> Response:
            leader = self.node.leader()
            if leader is not None:
                resp.headers[LEADER_HEADER] = leader[0]
            return resp

        @app.errorhandler(NotLeader)
        @app.errorhandler(ProposalTimeout)
        def _replication_error(exc: NotLeader | ProposalTimeout) -> Response:
            code, body = self._replication_error(exc)
            resp = jsonify(body)
            resp.status_code = code
            return resp

        @app.get("/health")
        def health() -> Response:
            """Fails while the node is faulted (e.g. its disk is full), so routers skip it."""
            if self.node.fault is not None:
                fail(503, f"{self.name}: {self.node.fault}")
            return jsonify({"name": self.name, "status": "ok"})

        @app.get("/livez")
        def livez() -> Response:
            """The process works (its replication loop takes turns); asks no other service, so a
            liveness probe built on it never restarts a replica because its tier fails over."""
            why = self.node.liveness()
            if why is not None:
                fail(503, why)
            return jsonify({"name": self.name, "status": "live"})

        @app.get("/readyz")
        def readyz() -> Response:
            """This replica can serve now: not recovering, not faulted, with a leader of its term
            (itself, holding its lease); what a readiness probe and the frontend's ``/readyz`` ask."""
            st = self.node.status()
            why = self.node.readiness(st)
            body = {"name": self.name, "role": st["role"], "leader": st["leader"], "term": st["term"]}
            if why is not None:
                fail(503, why, **body)
            return jsonify({**body, "status": "ready"})

        @app.get("/status")
        def status() -> Response:
            return jsonify({**self.node.status(), "admission": app.wsgi_app.snapshot()})  # type: ignore[attr-defined]

        @app.get("/verify")
        @self.operator
        def verify() -> Response:
            """The maintained digest against one recomputed from every row: O(data), from one read
            snapshot, without the apply lock (``pygmy verify`` asks every replica)."""
            applied, digest, recomputed = self.node.sm.full_digest()
            return jsonify({"name": self.name, "applied_index": applied, "state_digest": digest,
                            "recomputed": recomputed, "ok": digest == recomputed})

        @app.get("/backup")
        @self.operator
        def backup() -> Response:
            """This replica's state, whole, at an index at least the leader's commit index as of the
            request (a linearizable read, like every read here): pinned, copied page by page beside
            the snapshots (``snapshots/out``, emptied at start), sent, deleted. ``pygmy backup`` asks
            one replica of each tier, the order tier's first (docs/replication.md, "Backups")."""
            self.ensure_readable()
            path = self.node.snapshot_out / f"backup-{secrets.token_hex(6)}.db"
            pin = self.sm.pin()
            try:
                try:
                    pin.write(path)
                finally:
                    pin.close()
                digest = hashlib.sha256()
                with path.open("rb") as f:
                    while chunk := f.read(1 << 20):
                        digest.update(chunk)
            except BaseException:  # (a full disk) a copy nobody gets must not stay to fill it further
                path.unlink(missing_ok=True)
                raise
            resp = send_file(path, mimetype="application/vnd.sqlite3", max_age=0, conditional=False, etag=False)
            resp.headers.update({"X-Pygmy-Applied-Index": str(pin.index), "X-Pygmy-Sha256": digest.hexdigest()})
            resp.call_on_close(lambda: path.unlink(missing_ok=True))
            return resp

        self._member_routes(app)
        if self.node.blueprint is not None:
            app.register_blueprint(self.node.blueprint)
        return app

    # -- membership ---------------------------------------------------------------------------------
    def _member_routes(self, app: Flask) -> None:
        """``/members``: internal (the secret, as ``/verify``), answered by the leader (followers
        421 to it, as for writes). Each change is one configuration entry, and is answered once it
        is committed and applied here; a refused one changed nothing (4xx, ``kind`` says why)."""

        @app.errorhandler(MembershipRefused)
        def _refused(exc: MembershipRefused) -> Response:
            code = REFUSAL_STATUS.get(exc.kind, 409)
            extra: dict[str, Any] = {"kind": exc.kind}
            if code == 421:
                leader = self.node.leader()
                extra.update(leader=leader[0] if leader else None, leader_url=leader[1] if leader else None)
            resp = jsonify(error_body(code, str(exc), **extra))
            resp.status_code = code
            return resp

        @app.get("/members")
        @self.operator
        def members() -> Response:
            try:  # what ``pygmy member`` records in cluster.json: never a deposed leader's view
                return jsonify({"tier": self.tier, **self.node.members(leased=True)})
            except ReadIndexUnavailable as exc:
                fail(503, str(exc))

        @app.post("/members")
        @self.operator
        def add_member() -> Response:
            body = json_body(required=True)
            name = self._member_name(body.get("name"))
            url = check_member_url(body.get("url"))
            taken = [n for n, u in self.node.peers.items() if u == url and n in self._current_members()]
            if taken:
                fail(409, f"{url} is {taken[0]}'s URL already", kind="duplicate")
            return self._changed(self.node.add_learner(name, url, self._wait()))

        @app.post("/members/<name>/promote")
        @self.operator
        def promote_member(name: str) -> Response:
            return self._changed(self.node.promote(self._member_name(name), self._wait()))

        @app.delete("/members/<name>")
        @self.operator
        def remove_member(name: str) -> Response:
            name = self._member_name(name)
            if name == self.name and self.node.is_leader():
                # The leader hands over first (``RaftCore.handover_target``); the caller
                # follows the 421 and asks the new leader, which removes this one.
                if name not in self._current_members():
                    fail(404, f"{name!r} is not a member", kind="unknown")
                new = self.node.transfer_leadership(None, min(2.0, self._wait()))
                if new in (None, self.name):
                    fail(503, f"{self.name} is handing leadership over; ask again shortly", kind="transferring")
                raise NotLeader(new, self.node.peers.get(new, ""))
            return self._changed(self.node.remove(name, self._wait()))

        @app.post("/members/<name>/lead")
        @self.operator
        def lead_member(name: str) -> Response:
            """Leadership handed to voter ``name`` (before its machine is taken down, say): 200 once
            it leads; from another replica, 421 naming the leader, which the caller asks in turn.
            Only the leader judges ``name`` (a follower's log may be behind)."""
            name = self._member_name(name)
            if not self.node.is_leader():
                raise NotLeader(*(self.node.leader() or (None, None)))
            if name == self.name:
                if not self.node.can_serve_reads():  # cut off from its voters: another may lead
                    fail(503, f"{self.name} is not sure it still leads; ask again shortly")
                return jsonify({"tier": self.tier, "leader": self.name, "term": self.node.term()})
            if name not in self._current_members():
                fail(404, f"{name!r} is not a member", kind="unknown")
            new = self.node.transfer_leadership(name, min(MEMBER_CHANGE_WAIT, self._wait()))
            if new is None:
                fail(503, f"{self.name} is handing leadership over; ask again shortly", kind="transferring")
            if new == self.name:
                fail(409, f"the hand-over to {name} ended without it leading (it did not catch up within an "
                          f"election timeout, or left the voters); {self.name} leads on", kind="lagging")
            raise NotLeader(new, self.node.peers.get(new, ""))

    def _member_name(self, name: Any) -> str:
        """A replica name of this tier (``catalog-4``); 400 otherwise (another tier is not ours)."""
        try:
            tier, _ = parse_name(name) if isinstance(name, str) else ("", 0)
        except ValueError:
            tier = ""
        if tier != self.tier:
            fail(400, f"name must be a {self.tier} replica's, like {self.tier}-4; got {str(name)[:40]!r}",
                 kind="invalid")
        return str(name)

    def _current_members(self) -> Iterable[str]:
        membership = self.node.status()["membership"]
        return [*membership["voters"], *membership["learners"]]

    def _wait(self) -> float:
        return max(0.0, request_deadline(MEMBER_CHANGE_WAIT) - time.monotonic())

    def _changed(self, membership: dict[str, Any]) -> Response:
        log.info("%s: membership changed: %s", self.name, membership)
        return jsonify({"tier": self.tier, "leader": self.name, **membership})

    def serve_frames(self, channel: str, path: str, handle: FrameHandler) -> None:
        """Serve the HTTP route ``path``'s work on ``channel`` of the peer transport as well, for the
        services' own calls many times a second (a frontend worker's buys, an order leader's
        decrements): a frame on an open connection costs about a fifth of an HTTP request through
        urllib3, Gunicorn and Flask. The route and the channel call the same ``handle``.

        A request frame is ``{"body", "timeout_ms", "request_id"}``; the answer ``{"status", "body"}``,
        with the errors the route would give (421 with the leader's name, 503, 4xx). No admission
        cap here: a caller sends one request at a time per connection (``FrameClient.call``), so what
        is in flight is bounded by the callers' processes. Each request is timed in
        ``pygmy_frame_request_seconds`` and logged like an HTTP write, with its request id."""
        def on_frame(peer: str, frame: Any) -> dict[str, Any]:
            started = time.perf_counter()
            if not isinstance(frame, dict) or not isinstance(frame.get("body"), dict):
                return {"status": 400, "body": error_body(400, "a request frame is {body: {...}, timeout_ms}")}
            budget = frame.get("timeout_ms")
            own = time.monotonic() + FRAME_DEADLINE
            given = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0
            deadline = min(own, time.monotonic() + budget / 1000) if given else own
            with self._frames:
                if self._draining:  # 503 without "overloaded": routers try the next replica
                    return {"status": 503, "body": error_body(503, f"{self.name} is stopping")}
                self._frames_in_flight += 1
            try:
                rid = valid_request_id(frame.get("request_id"))
                with request_id_scope(rid):
                    status, body = self._answer(handle, frame["body"], deadline)
                elapsed = time.perf_counter() - started

                def record() -> None:
                    FRAME_LATENCY.labels(self.name, path).observe(elapsed)
                    with request_id_scope(rid):
                        access_log.info("%s %s %s", "FRAME", path, status, extra={
                            "method": "FRAME", "path": path, "status": status, "peer": peer,
                            "duration_ms": round(elapsed * 1000, 3)})

                after_reply(record)  # once the answer is on its way: the caller waits on it
            finally:
                with self._frames:
                    self._frames_in_flight -= 1
                    self._frames.notify_all()
            return {"status": status, "body": body}

        self.node.add_channel(channel, on_frame)

    def _answer(self, handle: FrameHandler, body: dict[str, Any], deadline: float) -> tuple[int, dict[str, Any]]:
        """``handle``'s answer, or its error as the HTTP app's error handlers would give it."""
        try:
            return 200, handle(body, deadline)
        except ApiError as exc:
            extra = {k: v for k, v in exc.extra.items() if k != "retry_after"}
            return exc.code, error_body(exc.code, exc.message, **extra)
        except (NotLeader, ProposalTimeout) as exc:
            return self._replication_error(exc)
        except Exception:
            log.exception("%s: a frame request failed", self.name)
            return 500, error_body(500, "internal error")

    def _replication_error(self, exc: NotLeader | ProposalTimeout) -> tuple[int, dict[str, Any]]:
        """421 naming the leader (routers go there), or 503 for a write whose commit was not seen."""
        if isinstance(exc, NotLeader):
            return 421, error_body(421, f"{self.name} is not the {self.tier} leader",
                                   leader=exc.leader_name, leader_url=exc.leader_url)
        return 503, error_body(503, f"{self.name}: write not committed in time (no majority?); "
                                    "its outcome is unknown: retry with the same idempotency key",
                               kind="outcome_unknown")

    def drain(self, timeout: float = 10.0) -> int:
        """Refuse new frame requests and wait, at most ``timeout`` seconds, for those being served to
        finish while the node still runs: what Gunicorn's graceful stop does for HTTP requests in
        flight (its worker exit hook calls this first). How many were still running at the end."""
        end = time.monotonic() + timeout
        with self._frames:
            self._draining = True
            while self._frames_in_flight and time.monotonic() < end:
                self._frames.wait(end - time.monotonic())
            return self._frames_in_flight

    def start(self) -> None:
        self.node.start()

    def stop(self) -> None:
        self.node.stop()

    # -- helpers for the service's handlers --------------------------------------------------------
    def propose(self, command: dict[str, Any], timeout: float = 5.0) -> Any:
        return self.node.propose(command, timeout)

    def ensure_readable(self) -> None:
        """Refuse reads (503, the router tries another replica) unless this replica's state is fresh
        enough for a linearizable read: applied up to the leader's commit index as of now.

        Every read, on the leader or a follower, waits for the read index (Raft's ReadIndex; the
        leader's own under its lease, a follower's asked of the leader in batches), so no read
        returns less than a read or a write that finished before it began. ``?min_index=N`` asks
        for at least N besides (a version the caller saw); ``?leader=1`` asks for the leader itself.
        """
        raw = request.args.get("min_index", "0")
        min_index = plain_int(raw) or 0
        if request.args.get("leader"):
            self.leader_only()
        if not self.node.is_leader() and not self.node.can_serve_reads():  # a leader may wait for its lease
            fail(503, f"{self.name} is not ready to serve reads")
        try:
            index = self.node.linearizable_index(READ_WAIT)
        except ReadIndexUnavailable as exc:
            fail(503, f"{self.name} cannot serve a linearizable read right now: {exc}")
        wanted = max(index, min_index)
        if not self.node.wait_applied(wanted, READ_WAIT):
            fail(503, f"{self.name} has not yet applied index {wanted}")

    def leader_only(self) -> None:
        if not self.node.is_leader():
            leader = self.node.leader()
            raise NotLeader(*(leader or (None, None)))
