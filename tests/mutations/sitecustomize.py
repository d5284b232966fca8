"""Test-only faults and mutations, loaded into every Pygmy process whose PYTHONPATH names this folder.

Nothing here is part of Pygmy: the tests that need it put this folder on PYTHONPATH for the cluster
they start (``cluster_env`` in tests/harness.py), so every service process
imports it at start-up (Python's ``sitecustomize`` hook) and Gunicorn's workers inherit it.
Without the variables below it does nothing.

- ``PYGMY_MUTATION``: break one rule on purpose, to show that the history checker catches it:
  ``invalidate-after-apply`` (a write's hold is pushed after it is applied, as before #18),
  ``no-read-index`` (replicas serve reads at whatever they have applied, with the caller's floor only),
  ``stale-leader`` (a leader serves reads without checking its leader lease, and does not step
  down when it stops hearing a majority: an isolated leader answers from its old state for as long
  as it is cut off; caught by the nemesis run, tests/verify/test_chaos.py),
  ``ignore-lost-pushes`` (a hold that a worker never acknowledged counts as delivered: no revocation,
  no lease wait; and grants list no pending holds, the second line of defence, which alone already
  hides lost pushes whenever a write takes longer than a renewal period),
  ``no-lease-wait`` (a new catalog leader trusts its voters' quiet without bound, so it writes at
  once instead of waiting out the cache leases its predecessor may have granted: a frontend still
  under the old leader's lease serves values the new leader has already changed).
  Two frontend mutations break "only 503s while failing over" (docs/api.md), for the fault tests
  (tests/system/test_faults.py) to catch: ``crash-mid-buy`` (every frontend worker SIGKILLs itself
  after it has its 20th buy's outcome and before it answers) and ``hang-failover-buys`` (a buy that
  waited over 0.3 s for its batch, as one does across an order leader's failover, is answered
  only 11 s later, past the tests' 10 s client timeout). ``shed-after-buy`` breaks "503 with
  ``overloaded`` means nothing was done": every third book a frontend worker bought is answered so,
  for the history checker to catch (tests/system/test_linearizability.py).
  ``decrements-not-held`` (the catalog applies a batch of buys' decrements without holding their
  books in the frontends' caches: a cached lookup may show the stock from before an acknowledged
  buy until the book's next update; caught by tests/frontend/test_stale_reads.py's history check,
  not by the check it replaced, which compared reads with acknowledged updates only).
- ``PYGMY_TEST_PUSH_DELAY=<seconds>``: every frontend worker takes that long to handle a push, as
  over a slow link. A correct build only writes more slowly; a build that lets a write become
  readable before its hold arrives shows old values for that long, so a short run catches it.
- ``PYGMY_TEST_PUSH_FAULT=<file>`` with ``PYGMY_TEST_PUSH_FAULT_SERVICE=frontend-1``: while the file
  exists, that frontend's workers swallow every push from the catalog (no answer: the catalog's push
  times out, as if the packets were dropped one way), while their renewals and reads go on.
- ``PYGMY_TEST_RENEW_FAULT=<file>`` with ``PYGMY_TEST_RENEW_FAULT_SERVICE=frontend-1``: while the file
  exists, that frontend's workers renew no lease (as if they could reach no catalog replica): each
  keeps the lease it has until it runs out, and serves its cache meanwhile.
- ``PYGMY_TEST_CACHE_LEASE=<seconds>``: the catalog grants cache leases that long instead of 0.4 s
  (a new catalog leader waits out that much less its voters' quiet), so a test can make the window
  a lease covers longer than a failover takes.
- ``PYGMY_TEST_CRASH_UNPERSISTED=<file>``: when the file names a tier (``catalog``/``order``), the
  next leader of that tier to send appends of entries it has not yet written (``Ready.send_first``)
  deletes the file and SIGKILLs its own process group right there, between the send and its write.
- ``PYGMY_TEST_CRASH_MID_BATCH=<file>``: when the file names a tier, the first leader of that tier
  to commit a batch of two or more buys' commands (the catalog's decrements, the order tier's
  intents or confirms) deletes the file and SIGKILLs its own process group before anyone hears of
  it: the batch is in the log, its answers never leave.
- ``PYGMY_TEST_CRASH_LINGERING=<file>``: when the file says ``frontend``, the first frontend worker
  whose batch of buys waited for company (``Combiner``'s linger) deletes the file and SIGKILLs its
  process group right after the wait, before the batch is sent: buys taken, none sent.
- ``PYGMY_TEST_CRASH_MID_SNAPSHOT=<file>``: snapshots stream in 4 KiB chunks; when the file says
  ``<tier> sender`` (or ``<tier> receiver``), the first replica of that tier to have sent (received)
  three chunks of a snapshot stream deletes the file and SIGKILLs its own process group right
  there: a stream cut short at either end, a partial file left on the receiver.
- ``PYGMY_TEST_SLOW_INSTALL=<file>``: when the file says ``<tier> <seconds>``, the first replica of
  that tier to restore its state from a snapshot deletes the file and waits that long in its turn
  before the copy (as a large state's copy would take), then creates ``<file>.restored``.
- ``PYGMY_TEST_CRASH_INSTALL=<file>``: when the file names a tier, the first replica of that tier to
  restore its state from a snapshot it was sent deletes the file and SIGKILLs its own process group
  right after the restore, before its log store records the install: at start it must finish it.
- ``PYGMY_TEST_CRASH_APPLIED_UNANNOUNCED=<file>``: when the file names a tier, the next leader of
  that tier to apply committed entries in a turn with no new entries (apply first, then send: the
  new commit index, or nothing while it waits for the next entry to carry it) deletes the file and
  SIGKILLs its own process group between the apply and the send: its proposers may have been
  answered, no follower knows the entries are committed.
- ``PYGMY_TEST_CRASH_AT=<file>``: the real node's persist, send and apply (``Ready.steps``), a kill
  at each, on followers as well as leaders. When the file says ``<tier> <role> <point>`` (role
  ``leader``, ``follower`` or ``candidate``), the first replica of that tier in that role to reach the point deletes
  the file and SIGKILLs its own process group right there. The points, in a turn that handles new
  log entries (or, for ``applied``, committed ones) holding a command: ``persisted`` (just after
  they are written: a follower has not acknowledged them yet, a leader has sent them), ``sent``
  (just after its messages left: a follower's acknowledgement, a leader's appends; they are sent on
  the spot, under the lock, so they have surely left before the kill) and ``applied`` (just after
  they are applied, before the turn's next step: a follower's end of the turn, a leader's news of
  the commit not yet sent when the Ready had no new entries). And, for a leader, ``answered``: just
  after it wrote a frame's reply that left work for after it (``transport.after_reply``: the
  catalog's release pushes for the decrements it answered, the order confirmer's wake-up). A
  leadership hand-over (``pygmy member lead``) has two: for a leader, ``handing``, just after it
  told its successor to campaign (``timeout_now``, sent on the spot); for a ``candidate``,
  ``transfer``, just after the successor asked for votes on that word (its raised term written,
  the requests sent on the spot). And, for an order leader, ``decremented``: just after the catalog answered a batch of decrements sent
  together with their buys' intents, which wait meanwhile (while the file names the point) so that
  they are never proposed: the decrements outlive their intents, and the orphan scan must record
  them. Buys sent intent first (another buy in flight, no orphan scan finished yet) pass.
- ``PYGMY_MUTATION=ack-before-persist``: a follower sends its acknowledgement of appended entries
  before writing them (``Ready.steps`` gives send, persist, apply for its Ready): a follower killed
  right after acknowledging loses entries its leader counted towards a commit.
- ``PYGMY_TEST_TURN_FAULT=<tier>``: every replica of that tier raises an error in every fiftieth
  turn of its event loop (a bug its supervisor survives: it reloads from
  disk and goes on, so clients see at most a slow answer). The tests' teardown check must catch it
  (``tests/system/test_hidden_faults.py``).
- ``PYGMY_TEST_DROP_CONFIRMS=<file>``: while the file exists, an order leader answers buys but never
  records their confirm (as if it died right after answering): the crash instant between a buy's
  answer and its confirm, held open for as long as a test needs.
- ``PYGMY_TEST_HOLD_DECREMENTS=<file>``: while the file exists, an order leader holds every batch
  of decrements before sending it to the catalog: buys stay in flight (their intents recorded,
  the stock not yet taken), so a test can fill the write path, or let a buy's time run out after
  its intent was proposed.
- ``PYGMY_TEST_BACKUP_GATE=<dir>``: ``pygmy backup`` makes ``<dir>/before-<n>-<tier>`` before each
  of its copies and waits until the file is gone, so a test can kill a leader between copies.
"""

from __future__ import annotations

import os
import time


def _mutate(name: str) -> None:
    from contextlib import contextmanager

    import pygmy.catalog.invalidation as inv
    from pygmy.replication.node import ReplicaNode

    if name == "invalidate-after-apply":
        @contextmanager
        def holding(self, keys):  # type: ignore[no-untyped-def]
            write = inv.Write()
            yield write  # proposed and applied first: readable before the caches drop the old value
            self.release(self.hold(keys), write.index or 0)

        inv.Invalidator.holding = holding
    elif name == "no-read-index":
        ReplicaNode.linearizable_index = lambda self, timeout: 0
    elif name == "ignore-lost-pushes":
        subscribe = inv.Invalidator.subscribe
        inv.Invalidator._revoke = lambda self, failed, targets: 0.0
        inv.Invalidator.subscribe = lambda self, sid, url, rtt=0.0: {**subscribe(self, sid, url, rtt), "holds": []}
    elif name == "no-lease-wait":
        ReplicaNode.vote_quiet_s = lambda self: 3600.0
    elif name == "ack-before-persist":
        _ack_before_persist()
    elif name == "stale-leader":
        os.environ["PYGMY_RAFT_CHECK_QUORUM"] = "0"  # a leader cut off from its peers never steps down

        def can_serve_reads(self):  # type: ignore[no-untyped-def]
            view = self._view  # as the real one, minus "and time.monotonic() < self._lease_until"
            if self.fault is not None:
                return False
            if view.get("role") == "leader":
                return self._applied >= view["term_start"]
            return view.get("role") == "follower" and view.get("leader") is not None

        ReplicaNode.can_serve_reads = can_serve_reads
    elif name in FRONTEND_MUTATIONS:
        _frontend_mutation(name)
    elif name == "decrements-not-held":
        _decrements_not_held()
    else:
        raise SystemExit(f"unknown PYGMY_MUTATION {name!r}")


#: ``PYGMY_MUTATION`` names of broken frontends (what a client may see during a failover).
FRONTEND_MUTATIONS = ("crash-mid-buy", "hang-failover-buys", "shed-after-buy")


def _frontend_mutation(name: str) -> None:
    """Break how a frontend worker answers its buys, through the Combiner that carries them
    (as ``_hold_decrements``: importing pygmy.frontend.app here would import prometheus_client too early)."""
    import signal
    import threading

    from pygmy.replication.batching import Combiner

    init = Combiner.__init__
    outcomes = [0]

    def misbehave(started: float) -> None:
        """Called with a buy's outcome in hand, before it is answered."""
        if name == "crash-mid-buy":
            outcomes[0] += 1
            if outcomes[0] == 20:
                os.kill(os.getpid(), signal.SIGKILL)  # this worker, mid-request: Gunicorn starts another
        elif time.monotonic() - started > 0.3:
            time.sleep(11.0)

    def shed_some(replies):  # type: ignore[no-untyped-def]
        """Every third bought book answered as a buy refused at once (503, "overloaded"), done all the same."""
        from pygmy.replication.router import Reply

        out = []
        for reply in replies:
            if isinstance(reply, Reply) and reply.status == 200:
                outcomes[0] += 1
                if outcomes[0] % 3 == 0:
                    reply = Reply(503, {"error": {"code": 503, "message": "shed (a mutation: it was bought)",
                                                  "overloaded": True}}, reply.replica)
            out.append(reply)
        return out

    def broken_init(self, send, *args, **kw):  # type: ignore[no-untyped-def]
        init(self, send, *args, **kw)
        if getattr(send, "__name__", "") != "send_buys":  # the frontend's buys only
            return
        if name == "shed-after-buy":
            self._send = lambda items: shed_some(send(items))
            return
        call, submit = self.call, self.submit

        def broken_call(item, wait):  # type: ignore[no-untyped-def]  # the Flask route
            started = time.monotonic()
            try:
                return call(item, wait)
            finally:
                misbehave(started)

        def broken_submit(item, wait, callback):  # type: ignore[no-untyped-def]  # the event loop
            started = time.monotonic()

            def told(result):  # type: ignore[no-untyped-def]
                threading.Thread(target=lambda: (misbehave(started), callback(result)), daemon=True).start()

            submit(item, wait, told)

        self.call, self.submit = broken_call, broken_submit

    Combiner.__init__ = broken_init


def _decrements_not_held() -> None:
    import sys
    from contextlib import nullcontext

    import pygmy.catalog.invalidation as inv

    holding = inv.Invalidator.holding

    def maybe_holding(self, keys):  # type: ignore[no-untyped-def]
        if sys._getframe(1).f_code.co_name == "run_decrements":  # pygmy.catalog.app: the buys' decrements
            return nullcontext(inv.Write())  # applied with no hold and no release: caches keep the old stock
        return holding(self, keys)

    inv.Invalidator.holding = maybe_holding


def _push_fault(flag: str | None, service: str, delay: float) -> None:
    from pygmy.frontend.subscription import Subscription

    apply_push = Subscription.apply_push

    def faulty(self, body):  # type: ignore[no-untyped-def]
        if flag and self.id.startswith(service + "/") and os.path.exists(flag):
            time.sleep(1.0)  # past the catalog's push timeout: it never hears back
            raise ConnectionAbortedError("test fault: push swallowed")
        if delay:
            time.sleep(delay)
        apply_push(self, body)

    Subscription.apply_push = faulty


def _renew_fault(flag: str, service: str) -> None:
    from pygmy.frontend.subscription import Subscription

    renew = Subscription.renew

    def faulty(self):  # type: ignore[no-untyped-def]
        if self.id.startswith(service + "/") and os.path.exists(flag):
            return False
        return renew(self)

    Subscription.renew = faulty


def _cache_lease(seconds: float) -> None:
    import pygmy.catalog.invalidation as inv

    init = inv.Invalidator.__init__

    def with_lease(self, node, secret, lease=seconds):  # type: ignore[no-untyped-def]
        init(self, node, secret, lease)

    inv.Invalidator.__init__ = with_lease


def _turn_fault(tier: str) -> None:
    from pygmy.replication.node import ReplicaNode

    process = ReplicaNode._process_ready
    turns = [0]

    def faulty(self, tick_wall):  # type: ignore[no-untyped-def]
        if self.name.startswith(tier + "-"):
            turns[0] += 1
            if turns[0] % 50 == 0:
                raise RuntimeError("test fault: a bug in a turn")
        process(self, tick_wall)

    ReplicaNode._process_ready = faulty


def _drop_confirms(flag: str) -> None:
    import pygmy.order.app as order_app

    confirm = order_app.BuyProcessor._confirm

    def dropped(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not os.path.exists(flag):
            confirm(self, *args, **kwargs)

    order_app.BuyProcessor._confirm = dropped


def _hold_decrements(flag: str) -> None:
    # Through the Combiner, not by importing pygmy.order.app here: that would import prometheus_client
    # before `pygmy serve` sets its multiprocess directory, and /metrics would come out empty.
    from pygmy.replication.batching import Combiner

    init = Combiner.__init__

    def holding_init(self, send, *args, **kw):  # type: ignore[no-untyped-def]
        if getattr(send, "__name__", "") == "_send_decrements":
            real = send

            def send(items):  # type: ignore[no-untyped-def]
                while os.path.exists(flag):
                    time.sleep(0.02)
                return real(items)

        init(self, send, *args, **kw)

    Combiner.__init__ = holding_init


def _backup_gate(folder: str) -> None:
    """``pygmy backup`` (the process with this variable) stops before each of its copies: it makes
    ``<folder>/before-<n>-<tier>`` and waits (30 s at most) until the test has removed it, so that a
    fault lands between two copies, however fast they are."""
    import itertools

    from pygmy.cluster import backup

    fetch, steps = backup.fetch_copy, itertools.count(1)

    def gated(config, tier, dest, say, *more):  # type: ignore[no-untyped-def]
        flag = os.path.join(folder, f"before-{next(steps)}-{tier}")
        open(flag, "w").close()  # noqa: SIM115
        deadline = time.monotonic() + 30
        while os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.02)
        return fetch(config, tier, dest, say, *more)

    backup.fetch_copy = gated


def _die_if_named(flag: str, service: str, role: str = "") -> None:
    """If ``flag`` names ``service``'s tier (and ``role``, when it names one): delete it and SIGKILL
    our own process group, here."""
    import signal

    try:
        tier, _, wanted = open(flag).read().strip().partition(" ")  # noqa: SIM115
    except OSError:
        return
    if tier and service.startswith(tier + "-") and wanted == role:
        os.unlink(flag)
        os.killpg(os.getpgid(0), signal.SIGKILL)


def _crash_mid_snapshot(flag: str) -> None:
    from pygmy.replication import node, snapshots

    snapshots.CHUNK_BYTES = 4096
    between = node._Sender._between_chunks
    chunk = snapshots.Incoming.chunk
    sent: dict[str, int] = {}

    def sending(self):  # type: ignore[no-untyped-def]
        sent[self.peer] = sent.get(self.peer, 0) + 1  # called before each frame of a stream
        if sent[self.peer] > 3:
            _die_if_named(flag, self.node.name, "sender")
        between(self)

    def receiving(self, peer, body):  # type: ignore[no-untyped-def]
        chunk(self, peer, body)
        if isinstance(body, dict) and body.get("offset", 0) >= 2 * snapshots.CHUNK_BYTES:
            _die_if_named(flag, self.directory.parent.parent.name, "receiver")  # <data>/<name>/snapshots/in

    node._Sender._between_chunks = sending
    snapshots.Incoming.chunk = receiving


def _crash_install(flag: str) -> None:
    from pygmy.replication.statemachine import SQLiteStateMachine

    restore = SQLiteStateMachine.restore

    def crashing(self, index, path):  # type: ignore[no-untyped-def]
        restore(self, index, path)
        _die_if_named(flag, os.path.basename(os.path.dirname(self.path)))  # <data>/<name>/state.db

    SQLiteStateMachine.restore = crashing


def _slow_install(flag: str) -> None:
    import time

    from pygmy.replication.statemachine import SQLiteStateMachine

    restore = SQLiteStateMachine.restore

    def slow(self, index, path):  # type: ignore[no-untyped-def]
        try:
            tier, _, seconds = open(flag).read().strip().partition(" ")  # noqa: SIM115
        except OSError:
            tier, seconds = "", "0"
        mine = tier and os.path.basename(os.path.dirname(self.path)).startswith(tier + "-")  # <data>/<name>/state.db
        if mine:
            os.unlink(flag)
            time.sleep(float(seconds))
        restore(self, index, path)
        if mine:
            open(flag + ".restored", "w").close()  # noqa: SIM115

    SQLiteStateMachine.restore = slow


def _crash_unpersisted(flag: str) -> None:
    from pygmy.replication.node import ReplicaNode

    persist = ReplicaNode._persist

    def crashing(self, rd):  # type: ignore[no-untyped-def]
        if rd.send_first and rd.entries:
            _die_if_named(flag, self.name)  # sent, not written: die right here
        persist(self, rd)

    ReplicaNode._persist = crashing


def _crash_applied_unannounced(flag: str) -> None:
    from pygmy.replication.core import Ready
    from pygmy.replication.node import ReplicaNode

    apply, send, steps = ReplicaNode._apply, ReplicaNode._send, Ready.steps
    turn = {"entries": False}  # whether the Ready being handled has new entries (then it sends first)

    def stepping(rd):  # type: ignore[no-untyped-def]
        turn["entries"] = bool(rd.entries)
        return steps(rd)

    def applying(self, entries):  # type: ignore[no-untyped-def]
        apply(self, entries)
        self._test_applied = bool(entries) and self.core.is_leader() and not turn["entries"]

    def sending(self, messages):  # type: ignore[no-untyped-def]
        # Sent after the apply (a Ready with no new entries), with nothing (the commit waits for the
        # next entry: ``commit_delay_ticks``) or only the commit and heartbeats to send.
        if getattr(self, "_test_applied", False) and not any(m.entries for m in messages):
            _die_if_named(flag, self.name)  # applied (and answered), the commit not yet told
        self._test_applied = False
        send(self, messages)

    ReplicaNode._apply, ReplicaNode._send, Ready.steps = applying, sending, stepping


def _ack_before_persist() -> None:
    from pygmy.replication.core import APPEND_RESP, APPLY, PERSIST, SEND, Ready

    steps = Ready.steps

    def acking_first(rd):  # type: ignore[no-untyped-def]
        if rd.entries and not rd.send_first and any(m.type == APPEND_RESP for m in rd.messages):
            return (SEND, PERSIST, APPLY)  # a follower's acknowledgement of entries not yet written
        return steps(rd)

    Ready.steps = acking_first


def _crash_at(flag: str) -> None:
    """``PYGMY_TEST_CRASH_AT``: die at ``persisted``, ``sent`` or ``applied`` of a leader or a follower."""
    import contextlib
    import signal

    from pygmy.replication.core import APPEND_RESP, SNAPSHOT, TIMEOUT_NOW, VOTE, RaftCore
    from pygmy.replication.node import ReplicaNode

    ready, persist, send, apply = RaftCore.ready, ReplicaNode._persist, ReplicaNode._send, ReplicaNode._apply

    def readying(self):  # type: ignore[no-untyped-def]
        self._test_ready = rd = ready(self)  # the Ready the node's turn is handling
        return rd

    def claimed(node, point):  # type: ignore[no-untyped-def]
        """True if the flag names ``node``'s tier, its role and ``point``, and this replica is the one
        that deleted it (two followers reach a point at once: one dies, the other goes on)."""
        try:
            tier, _, wanted = open(flag).read().strip().partition(" ")  # noqa: SIM115
            role = "leader" if node.core.is_leader() else node.core.role
            if not (tier and node.name.startswith(tier + "-") and wanted == f"{role} {point}"):
                return False
            os.unlink(flag)
        except OSError:
            return False
        return True

    def die():  # type: ignore[no-untyped-def]
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def writes(entries):  # type: ignore[no-untyped-def]
        return any(e.command is not None for e in entries)

    def persisting(self, rd):  # type: ignore[no-untyped-def]
        persist(self, rd)
        if writes(rd.entries) and claimed(self, "persisted"):
            die()

    def sending(self, messages):  # type: ignore[no-untyped-def]
        if any(m.type == TIMEOUT_NOW for m in messages) and claimed(self, "handing"):
            send_and_die(self, messages)  # a leader that just told its successor to campaign
        if any(m.type == VOTE and m.transfer for m in messages) and claimed(self, "transfer"):
            send_and_die(self, messages)  # a successor campaigning on its leader's word, votes asked
        rd = getattr(self.core, "_test_ready", None)
        if rd is None or messages is not rd.messages or not writes(rd.entries) or not any(
                m.entries or (m.type == APPEND_RESP and m.success) for m in messages) or not claimed(self, "sent"):
            send(self, messages)
            return
        send_and_die(self, messages)

    def send_and_die(self, messages):  # type: ignore[no-untyped-def]
        send(self, [m for m in messages if m.type == SNAPSHOT])
        frames: dict[str, list] = {}
        for m in messages:
            if m.type != SNAPSHOT:
                frames.setdefault(m.dst, []).append(m.to_dict())
        for dst, frame in frames.items():  # on the spot: surely on the wire before the kill
            sender = self._senders.get(dst)
            if sender is not None:
                with contextlib.suppress(OSError):
                    sender.client.send({"messages": frame}, 1.0)
        die()  # the flag is gone already: whoever hears of the messages' consequences finds it so

    def applying(self, entries):  # type: ignore[no-untyped-def]
        apply(self, entries)
        rd = getattr(self.core, "_test_ready", None)
        if rd is not None and entries is rd.committed_entries and writes(entries) and claimed(self, "applied"):
            die()

    RaftCore.ready = readying
    ReplicaNode._persist, ReplicaNode._send, ReplicaNode._apply = persisting, sending, applying

    from pygmy.replication import transport

    nodes: list = []  # this worker's replica node (the point ``answered`` is not in a turn)
    init, after = ReplicaNode.__init__, transport._AfterReply.run

    def initing(self, *args, **kw):  # type: ignore[no-untyped-def]
        init(self, *args, **kw)
        nodes.append(self)

    def after_reply(self):  # type: ignore[no-untyped-def]
        # Besides the frame's log line, work was left for after the reply just written: the
        # catalog's release pushes, the order confirmer's wake-up.
        if len(self.fns) >= 2 and nodes and claimed(nodes[-1], "answered"):
            die()
        after(self)

    ReplicaNode.__init__, transport._AfterReply.run = initing, after_reply

    from pygmy.replication.batching import Combiner

    combiner_init = Combiner.__init__

    def wanted(point):  # type: ignore[no-untyped-def]
        try:
            return open(flag).read().split()[1:] == ["leader", point]  # noqa: SIM115
        except (OSError, IndexError):
            return False

    held = [0]  # intents held back right now

    def combining(self, send, *args, **kw):  # type: ignore[no-untyped-def]
        # ``decremented``: an order leader whose buys' decrements the catalog has just answered, their
        # intents not yet proposed (held back while the point is wanted): the decrements outlive them.
        name, real = getattr(send, "__name__", ""), send
        if name == "_send_decrements":
            def send(items):  # type: ignore[no-untyped-def]
                replies = real(items)
                if (held[0] and any(getattr(r, "status", None) == 200 for r in replies) and nodes
                        and claimed(nodes[-1], "decremented")):
                    die()
                return replies
        elif name == "_propose_intents":
            import threading

            def send(items):  # type: ignore[no-untyped-def]
                # Only intents sent with their decrements (by the combiner's helper thread); those
                # sent first, by their buyer's thread, go on, and so does the load.
                if not (threading.current_thread().name.startswith("combiner") and wanted("decremented")):
                    return real(items)
                held[0] += 1
                try:
                    until = time.monotonic() + 3
                    while wanted("decremented") and time.monotonic() < until:
                        time.sleep(0.002)
                finally:
                    held[0] -= 1
                return real(items)
        combiner_init(self, send, *args, **kw)

    Combiner.__init__ = combining


def _crash_mid_batch(flag: str) -> None:
    from pygmy.replication.node import ReplicaNode

    propose = ReplicaNode.propose

    def crashing(self, command, timeout):  # type: ignore[no-untyped-def]
        result = propose(self, command, timeout)
        many = len(command.get("items") or command.get("commands") or ()) >= 2
        if command.get("op") in ("decrements", "batch") and many:
            _die_if_named(flag, self.name)  # committed and applied, never answered
        return result

    ReplicaNode.propose = crashing


def _crash_lingering(flag: str) -> None:
    import time

    from pygmy.replication import batching

    linger = batching.Combiner._linger

    def lingering(self):  # type: ignore[no-untyped-def]
        waits = (self.linger > 0 and self._last_size >= batching.LINGER_SIBLINGS
                 and time.monotonic() - self._last_end <= batching.LINGER_RECENT)
        linger(self)
        if waits and self._queue:
            _die_if_named(flag, "frontend-1")  # a frontend's buys: waited, queued, never sent

    batching.Combiner._linger = lingering


if os.environ.get("PYGMY_TEST_CRASH_LINGERING"):
    _crash_lingering(os.environ["PYGMY_TEST_CRASH_LINGERING"])
if os.environ.get("PYGMY_TEST_CRASH_MID_BATCH"):
    _crash_mid_batch(os.environ["PYGMY_TEST_CRASH_MID_BATCH"])
if os.environ.get("PYGMY_TEST_CRASH_MID_SNAPSHOT"):
    _crash_mid_snapshot(os.environ["PYGMY_TEST_CRASH_MID_SNAPSHOT"])
if os.environ.get("PYGMY_TEST_SLOW_INSTALL"):
    _slow_install(os.environ["PYGMY_TEST_SLOW_INSTALL"])
if os.environ.get("PYGMY_TEST_CRASH_INSTALL"):
    _crash_install(os.environ["PYGMY_TEST_CRASH_INSTALL"])
if os.environ.get("PYGMY_TEST_CRASH_APPLIED_UNANNOUNCED"):
    _crash_applied_unannounced(os.environ["PYGMY_TEST_CRASH_APPLIED_UNANNOUNCED"])
if os.environ.get("PYGMY_TEST_CRASH_UNPERSISTED"):
    _crash_unpersisted(os.environ["PYGMY_TEST_CRASH_UNPERSISTED"])
if os.environ.get("PYGMY_TEST_CRASH_AT"):
    _crash_at(os.environ["PYGMY_TEST_CRASH_AT"])
if os.environ.get("PYGMY_TEST_BACKUP_GATE"):
    _backup_gate(os.environ["PYGMY_TEST_BACKUP_GATE"])
if os.environ.get("PYGMY_TEST_RENEW_FAULT"):
    _renew_fault(os.environ["PYGMY_TEST_RENEW_FAULT"], os.environ.get("PYGMY_TEST_RENEW_FAULT_SERVICE", "frontend-1"))
if os.environ.get("PYGMY_TEST_CACHE_LEASE"):
    _cache_lease(float(os.environ["PYGMY_TEST_CACHE_LEASE"]))
if os.environ.get("PYGMY_TEST_TURN_FAULT"):
    _turn_fault(os.environ["PYGMY_TEST_TURN_FAULT"])
if os.environ.get("PYGMY_TEST_DROP_CONFIRMS"):
    _drop_confirms(os.environ["PYGMY_TEST_DROP_CONFIRMS"])
if os.environ.get("PYGMY_TEST_HOLD_DECREMENTS"):
    _hold_decrements(os.environ["PYGMY_TEST_HOLD_DECREMENTS"])
if os.environ.get("PYGMY_MUTATION"):
    _mutate(os.environ["PYGMY_MUTATION"])
if os.environ.get("PYGMY_TEST_PUSH_FAULT") or os.environ.get("PYGMY_TEST_PUSH_DELAY"):
    _push_fault(os.environ.get("PYGMY_TEST_PUSH_FAULT"), os.environ.get("PYGMY_TEST_PUSH_FAULT_SERVICE", "frontend-1"),
                float(os.environ.get("PYGMY_TEST_PUSH_DELAY") or 0))
