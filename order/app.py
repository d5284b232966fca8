"""The order service: runs the buy transaction and keeps the orders.

A buy is three steps, each safe to repeat: (1) record the intent in the order log (this fixes
the order number and the idempotency key), (2) ask the catalog leader to decrement the stock under
the same key (the catalog remembers keys, so a repeat returns the first result), (3) record the
outcome. (1) and (2) run at the same time for a request that arrives alone with new keys
(``BuyProcessor.buy_many``). Whoever leads the order tier finishes intents a dead leader left
half-done, and records buys whose decrement outlived their intent (``scan_orphans``), so the
catalog's decrements always equal the confirmed orders.

A successful buy is answered once (1) and (2) are committed: its outcome is decided then, and
recoverable from the key by anyone, so the confirm (3) follows off the buyer's path. Until it is applied, a
read of that order finishes it first (on the leader; a follower sends the reader there), so an
answered order is always found (docs/replication.md, "A buy answered before its confirm").
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent import futures
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import Any, NamedTuple

from flask import Flask, Response, jsonify

from pygmy.kit import metrics
from pygmy.kit.admission import MAX_TIMEOUT_MS
from pygmy.kit.config import ClusterConfig
from pygmy.kit.web import ApiError, fail, int_field, json_body, parse_item, query_int, request_deadline
from pygmy.order.state import CONFIRMED, FAILED, PENDING, OrderState, adoption, confirmed, failure
from pygmy.replication.batching import Combiner, CombinerTimeout
from pygmy.replication.node import NotLeader, ProposalTimeout
from pygmy.replication.router import ChannelRouter, Reply, Sightings, TierRouter, TierUnavailable, Watchers
from pygmy.replication.service import Periodic, ReplicaRuntime
from pygmy.replication.transport import BUYS_CHANNEL, DECREMENTS_CHANNEL, after_reply

log = logging.getLogger(__name__)

#: How long one buy may wait for the catalog (across a catalog failover) before answering 503.
CATALOG_DEADLINE = 4.0
#: How long the order leader waits for one of its own proposals to commit.
PROPOSE_TIMEOUT = 5.0
#: How long a confirm waits for the next intents entry to carry it before it is proposed alone: one
#: commit fewer per buy while buys keep coming, at the cost of a pending order a little longer (a read
#: of it meanwhile finishes it first, see ``settle``).
CONFIRM_LINGER = 0.02
#: The most confirms one log entry carries (the rest go in the next).
MAX_CONFIRMS = 256
#: A pending intent older than this with no buy in flight here is finished by the background sweep.
STALE_INTENT = 2.0
#: A decrement key with no order younger than this (by its time) may still see its intent commit:
#: the orphan scan leaves it for its next round. Longer than a buy's budget (5 s) is not needed: an
#: intent adopted early is found by the adoption, and the other way round.
ORPHAN_AGE = 2.0
#: Keys the orphan scan reads per request, and adopts per log entry at most.
SCAN_PAGE = 500
#: Seconds between two orphan scans of a leader (a new leader scans at once).
SCAN_EVERY = 5.0
#: What a buy hears when its time ran out before its decrement was sent.
EXPIRED = Reply(504, {"error": {"code": 504, "message": "the buy's time budget was spent"}}, "order")


#: Most buys one request may carry (a frontend worker sends the buys it has in flight).
MAX_BUYS = 256
#: The most orders one ``GET /orders`` page carries.
MAX_ORDERS_PAGE = 1000


class Buy(NamedTuple):
    item: int
    quantity: int
    key: str
    deadline: float  # monotonic


class ScanRefused(Exception):
    """The catalog did not list its keys (no leader, not ready): the orphan scan waits for the next sweep."""


class DeadlineSpent(Exception):
    """A buy's time budget ran out; the message says how far it got."""


def nothing_done() -> DeadlineSpent:
    """What a buy whose time ran out before anything of it was sent ends with (a new exception each
    time: one raised from many threads would gather their tracebacks)."""
    return DeadlineSpent("before its intent was proposed: nothing was done")


def _intent(buy: Buy, created: str) -> dict[str, Any]:
    return {"op": "intent", "key": buy.key, "item": buy.item, "quantity": buy.quantity, "created_at": created}


def _withdrawn(outcome: Any) -> bool:
    """An intent or a decrement that surely never left this process: withdrawn from its combiner's
    queue, left out of its batch once its time had run out (``EXPIRED``), or refused by the node
    before it was written (NotLeader). A 504 from the catalog is not that: the router may have had
    an earlier attempt of unknown outcome."""
    return (outcome is EXPIRED or isinstance(outcome, NotLeader)
            or (isinstance(outcome, CombinerTimeout) and not outcome.sent))


class BuyProcessor:
    """Runs buys on the order leader and finishes any intent left pending."""

    def __init__(self, rt: ReplicaRuntime, state: OrderState, catalog: ChannelRouter,
                 keys: TierRouter | None = None) -> None:
        """``catalog``: where decrements go; ``keys``: where the orphan scan reads the catalog's keys."""
        self.rt, self.state, self.catalog, self.keys = rt, state, catalog, keys
        self._in_flight: set[str] = set()
        self._buying = 0  # calls of buy_many under way
        self._scan_due = 0.0  # monotonic: when the next orphan scan is due
        self._scanned_term = -1  # the term of the last orphan scan that finished (together_ok)
        #: The last orphan scan stopped early (before a key too young to call an orphan, with a full
        #: entry of adoptions, or refused): the next comes at the next sweep, not SCAN_EVERY later.
        self.scan_soon = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._leader_since = float("inf")
        self._thread = threading.Thread(target=self._sweep_loop, name="intent-sweeper", daemon=True)
        #: Confirms wait here, off the buyers' path, each with when it came: the next intents entry
        #: carries them, or, for one that waited CONFIRM_LINGER, the confirmer proposes it alone. A
        #: lost one is redone by the sweep.
        self._confirms: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()
        self._confirms_lock = threading.Lock()
        self._confirm_due = threading.Event()
        self._confirmer = threading.Thread(target=self._confirm_loop, name="confirmer", daemon=True)
        #: The intents of concurrent buys, and the confirms waiting, in one log entry.
        self._intents: Combiner[dict[str, Any], dict[str, Any]] = Combiner(self._propose_intents)
        #: The decrements of concurrent buys go to the catalog together: one request, one log entry.
        self._decrements: Combiner[dict[str, Any], Reply] = Combiner(self._send_decrements)
        #: Intent-first buys run one batch at a time, intents then decrements (``_one_batch_at_a_time``).
        self._batches: Combiner[tuple[Buy, str], dict[str, Any] | BaseException] = Combiner(self._run_batch)

    def start(self) -> None:
        self.rt.node.add_leader_listener(self._on_leader_change)
        self._thread.start()
        self._confirmer.start()

    def _on_leader_change(self, is_leader: bool, term: int) -> None:
        if is_leader:
            # Intents older than our leadership cannot be in flight here: finish them at once.
            self._leader_since = time.time()
            self._scan_due = 0.0
            self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._confirm_due.set()
        self._confirmer.join(timeout=5)
        self._intents.stop()  # its helper thread, which commits the intents sent with their decrements

    def buy(self, item: int, quantity: int, key: str, deadline: float) -> dict[str, Any]:
        """One buy (``buy_many`` of one); raises what it would hold as its outcome."""
        (outcome,) = self.buy_many([Buy(item, quantity, key, deadline)])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def buy_many(self, buys: list[Buy]) -> list[dict[str, Any] | BaseException]:
        """Run buys, each by its own deadline (monotonic), their intents together in one log entry
        (with any other buys in flight here), their decrements in one catalog request. Each gets its
        order or the exception that ended it. No intent is proposed once its deadline has passed;
        an intent proposed in time is finished whatever happens after (here, by a read, or by the sweep).

        A buy whose key has no order here yet sends its decrement while its intent is being
        committed, not after it: one majority commit's time off its path. Its decrement may then be
        committed while its intent is lost (this leader dies or is deposed first); the orphan scan
        (``scan_orphans``) records such a buy from the catalog's key. A key with an order here
        already (a retry) goes intent first: that order may be finished and its catalog key
        forgotten (the catalog forgets first), so a decrement sent blind could take stock twice.
        Only a leader whose state holds every committed entry can tell a new key from an old one.

        And only buys that arrive with no other buy in flight here go together. Under load the
        intents' commit is what gathers the buys of several requests into one catalog request
        (one hold round, one catalog entry): sent at once they went in more, smaller batches, and
        32 closed-loop buyers got 0.945x the throughput at 1.095x the CPU per buy."""
        with self._lock:
            alone = self._buying == 0
            self._buying += 1
        try:
            return self._buy_many(buys, alone)
        finally:
            with self._lock:
                self._buying -= 1

    def _buy_many(self, buys: list[Buy], alone: bool) -> list[dict[str, Any] | BaseException]:
        now = time.monotonic()
        out: list[dict[str, Any] | BaseException] = [nothing_done() for _ in buys]
        todo = [i for i, b in enumerate(buys) if b.deadline > now]
        created = datetime.now(UTC).isoformat(timespec="milliseconds")
        known = ({buys[i].key for i in todo} if not (alone and self.together_ok())
                 else self.state.has_keys([buys[i].key for i in todo]))
        together = [i for i in todo if buys[i].key not in known]
        if together:
            self._together(buys, together, created, out)
        first = [i for i in todo if buys[i].key in known]
        if first:
            self._one_batch_at_a_time(buys, first, created, out)
        return out

    def _one_batch_at_a_time(self, buys: list[Buy], todo: list[int], created: str,
                             out: list[dict[str, Any] | BaseException]) -> None:
        """``_intent_first`` for ``todo``, in one batch with the intent-first buys of other requests,
        while no other such batch is under way: buys that arrive meanwhile wait and go together in
        the next one. Letting the next batch's intents commit while this one's decrements were out
        made smaller batches, and a batch costs several ms of CPU over the seven processes
        whatever it carries (docs/performance.md). One at a time, 32 closed-loop buyers got more
        buys per second for less CPU each (``python -m pygmy.experiments.ab --load buy``).

        A buy still queued at its deadline is withdrawn (nothing done). Once in a batch, its deadline
        is kept there (``_intent_first``: no intent or decrement is sent after it), and its outcome
        is waited for ``PROPOSE_TIMEOUT`` and a second past it (a refusal's entry may take that).
        A batch runs until every buy in it has its outcome, so one whose deadline is much earlier
        than another's in its batch may be told "outcome unknown" (a retry with its key is safe)."""
        now = time.monotonic()
        results = self._batches.call_many([(buys[i], created) for i in todo],
                                          [max(0.0, buys[i].deadline - now) for i in todo], grace=PROPOSE_TIMEOUT + 1)
        for i, r in zip(todo, results, strict=True):
            if isinstance(r, CombinerTimeout):
                r = nothing_done() if not r.sent else ProposalTimeout("the buy's batch had no outcome in time; outcome unknown")
            out[i] = r

    def _run_batch(self, items: list[tuple[Buy, str]]) -> list[dict[str, Any] | BaseException]:
        """One batch of ``_one_batch_at_a_time``: each buy's outcome, in order."""
        buys = [b for b, _ in items]  # each still in time: the combiner leaves out one whose wait ran out
        out: list[dict[str, Any] | BaseException] = [nothing_done() for _ in buys]
        self._intent_first(buys, list(range(len(buys))), [c for _, c in items], out)
        return out

    def together_ok(self) -> bool:
        """Whether this leader may send a new key's decrement with its intent: its state holds every
        committed entry (so "no order for this key" is true of the whole log), and it has finished
        an orphan scan in its term (so the catalog keeps and lists the keys the scan needs)."""
        return self._scanned_term == self.rt.node.term() and self.rt.node.can_serve_reads()

    def _together(self, buys: list[Buy], todo: list[int], created: str,
                  out: list[dict[str, Any] | BaseException]) -> None:
        """The intents of ``todo`` committed on the intents combiner's helper thread while their
        decrements go out on this one; each buy's outcome into ``out``."""
        now = time.monotonic()
        waits = [min(2 * PROPOSE_TIMEOUT + 1, buys[i].deadline - now) for i in todo]
        told: list[Future[Any]] = [Future() for _ in todo]
        for i, wait, future in zip(todo, waits, told, strict=True):
            self._intents.submit(_intent(buys[i], created), wait, future.set_result)
        orders = [{"item_number": buys[i].item, "quantity": buys[i].quantity, "key": buys[i].key,
                   "status": PENDING} for i in todo]
        sent, replies = self._decrement_all(orders, [buys[i].deadline for i in todo])
        # The combiner tells each outcome, at the latest when its batch in flight ends (a stopped
        # one may not): one still untold by then is unknown.
        futures.wait(told, max(waits) + PROPOSE_TIMEOUT + 1)
        intents = [f.result() if f.done() else CombinerTimeout("no outcome told in time", sent=True) for f in told]
        ready: list[tuple[int, dict[str, Any], tuple[int, int], Reply | BaseException]] = []
        for i, intent, reply in zip(todo, intents, replies, strict=True):
            if not isinstance(intent, BaseException):
                if intent["status"] == PENDING:
                    # The decrement went out as this buy (its intent may have found another's order)
                    ready.append((i, intent, (buys[i].item, buys[i].quantity), reply))
                else:
                    out[i] = intent  # finished meanwhile (another request's intent came first)
            elif _withdrawn(intent) and _withdrawn(reply):
                out[i] = nothing_done()  # neither half left this process
            else:
                # The decrement may be committed without its intent: the orphan scan records the
                # buy. Never "nothing done", nor NotLeader (routers take a 421 for that).
                out[i] = ProposalTimeout(f"the intent was not committed ({type(intent).__name__}) and its "
                                         "decrement was sent: outcome unknown")
        self._outcomes(out, ready, sent)

    def _intent_first(self, buys: list[Buy], todo: list[int], created: list[str],
                      out: list[dict[str, Any] | BaseException]) -> None:
        """The intents of ``todo`` committed, then the decrements of those still pending; into ``out``
        (``created``: each buy's time of arrival)."""
        now = time.monotonic()
        waits = [min(2 * PROPOSE_TIMEOUT + 1, buys[i].deadline - now) for i in todo]
        recorded = self._intents.call_many([_intent(buys[i], created[i]) for i in todo], waits)
        pending: list[int] = []
        for i, r in zip(todo, recorded, strict=True):
            if isinstance(r, CombinerTimeout):
                out[i] = ProposalTimeout("the intent was not proposed in time; outcome unknown") if r.sent else nothing_done()
            else:
                out[i] = r
                if not isinstance(r, BaseException):
                    pending.append(i)
        finished = self.finish_many([out[i] for i in pending], [buys[i].deadline for i in pending])  # type: ignore[misc]
        for i, r in zip(pending, finished, strict=True):
            out[i] = r

    def _propose_all(self, commands: list[dict[str, Any]], what: str, count: int | None = None) -> list[Any]:
        """Commands of concurrent requests as one log entry, each applied as alone, in order
        (``count``: how many of them are ``what``, for the batch-size histogram)."""
        metrics.BUY_BATCH.labels(self.rt.name, what).observe(len(commands) if count is None else count)
        return self.rt.propose({"op": "batch", "commands": commands}, PROPOSE_TIMEOUT)

    def finish(self, order: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        """Drive one intent to its outcome (``finish_many`` of one); raises what ended it."""
        (outcome,) = self.finish_many([order], [deadline])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def finish_many(self, orders: list[dict[str, Any]], deadlines: list[float | None]
                    ) -> list[dict[str, Any] | BaseException]:
        """Drive intents to their outcomes; the catalog's key makes a repeated decrement harmless.
        A decrement is not sent once its ``deadline`` has passed: the intent stays pending, and the
        sweep (or a read of the order) finishes it later, off the overloaded path."""
        out: list[dict[str, Any] | BaseException] = list(orders)
        pending = [i for i, o in enumerate(orders) if o["status"] == PENDING]
        if pending:
            sent, replies = self._decrement_all([orders[i] for i in pending], [deadlines[i] for i in pending])
            self._outcomes(out, [(i, orders[i], (orders[i]["item_number"], orders[i]["quantity"]), r)
                                 for i, r in zip(pending, replies, strict=True)], sent)
        return out

    def _decrement_all(self, orders: list[dict[str, Any]], deadlines: list[float | None]
                       ) -> tuple[float, list[Reply | BaseException]]:
        """The catalog's answers to the orders' decrements (sent together, each by its deadline),
        and the keys' time: when they were sent. The catalog keeps the first time it got; the
        outcome records this one, never earlier, so the order forgets the key no sooner (KeyExpirer)."""
        now = time.monotonic()
        ends = [d if d is not None else now + 2 * CATALOG_DEADLINE + 1 for d in deadlines]
        keys = [o["key"] for o in orders]
        sent = time.time()
        with self._lock:
            self._in_flight.update(keys)
        try:
            return sent, self._decrements.call_many(
                [({"item": o["item_number"], "quantity": o["quantity"], "key": o["key"], "at": sent}, end)
                 for o, end in zip(orders, ends, strict=True)],
                [min(2 * CATALOG_DEADLINE + 1, max(0.0, end - now)) for end in ends])
        finally:
            with self._lock:
                self._in_flight.difference_update(keys)

    def _outcomes(self, out: list[dict[str, Any] | BaseException],
                  replies: list[tuple[int, dict[str, Any], tuple[int, int], Reply | BaseException]],
                  sent: float) -> None:
        """Each pending order's outcome from its decrement's reply, into ``out`` at its place; the
        decrement was sent as the buy of ``(item, quantity)``."""
        refused: list[tuple[int, dict[str, Any]]] = []
        confirms = False
        for i, order, sent_as, reply in replies:
            key = order["key"]
            if isinstance(reply, CombinerTimeout):
                out[i] = TierUnavailable("catalog", "the decrement was not sent in time")
            elif isinstance(reply, BaseException):
                out[i] = reply
            elif reply.status == 200 and sent_as != (order["item_number"], order["quantity"]):
                # The decrement took stock for this buy while the key's pending order is another
                # request's (it reused the key, and its intent came first): the key's order becomes
                # the buy whose stock was taken.
                refused.append((i, adoption(key, *sent_as, reply.body, sent)))
            elif reply.status == 200:
                # Decided: the catalog's decrement under this key is committed. Answer now.
                title, cost = reply.body["title"], reply.body["cost"]
                self._confirm(key, title, cost, sent)
                confirms = True
                out[i] = confirmed(order, title, cost)
            elif reply.status in (404, 409) or (reply.status == 422 and "buy" in reply.body):
                err, other = reply.body["error"], reply.body.get("buy")
                if other is not None and other["result"].get("ok"):
                    # The catalog took stock under this key for another buy (one whose intent was
                    # lost, or a concurrent request reusing the key): that buy is the key's order.
                    refused.append((i, adoption(key, other["item"], other["quantity"], other["result"]["book"],
                                                other["at"])))
                elif other is not None:
                    # ... and refused it: the key's order is that buy, failed with its own answer.
                    first = other["result"]["error"]
                    refused.append((i, failure(key, first["code"], first["message"], other["at"] or None,
                                               other["item"], other["quantity"])))
                else:
                    refused.append((i, failure(key, reply.status, err["message"], sent)))
            elif reply.status == 504:
                out[i] = DeadlineSpent("after its intent was recorded; its decrement is sent later")
            else:
                message = reply.body.get("error", {}).get("message", "")
                out[i] = ApiError(502, f"catalog answered {reply.status}: {message}")
        if confirms:  # recorded soon: with the next intents, or by the confirmer once the answer is out
            after_reply(self._confirm_due.set)
        if refused:  # the stock said no (or the key is another buy's): recorded together, as the intents were
            try:
                failed = self._propose_all([c for _, c in refused], "fails")
                for (i, _), order in zip(refused, failed, strict=True):
                    # None: finished meanwhile and its key already forgotten (a buy older than
                    # the key window); its outcome is whatever finished it.
                    out[i] = order if order is not None else ApiError(
                        503, "the buy was finished elsewhere and its key has expired")
            except Exception as exc:  # left pending: a read or the sweep records it later
                if isinstance(exc, NotLeader):  # the intent and the decrement were both done: not a 421
                    exc = ProposalTimeout("the buy's outcome was not recorded before this leader lost "
                                          "its leadership; outcome unknown")
                for i, _ in refused:
                    out[i] = exc

    def _send_decrements(self, items: list[tuple[dict[str, Any], float]]) -> list[Reply]:
        """One catalog request for the decrements of every buy waiting (``Combiner``): the catalog
        holds their books once, proposes them as one entry and answers each as a lone decrement would.
        Retried across a catalog failover with the same keys, so each still happens once. Buys whose
        deadline has passed are left out (504): their intents wait for the sweep."""
        metrics.BUY_BATCH.labels(self.rt.name, "decrements").observe(sum(1 for _, d in items if d > time.monotonic()))
        return self.catalog.write_batch(items, CATALOG_DEADLINE, EXPIRED)

    def _confirm(self, key: str, title: str, cost: float, at: float) -> None:
        """Record a decided outcome, soon: with the next intents, or by the confirmer thread, which
        the caller wakes once for all its confirms (``_confirm_due``, after the buys' answer)."""
        confirm = {"op": "confirm", "key": key, "title": title, "cost": cost, "at": at}
        with self._confirms_lock:  # stamped under the lock: the deque stays in order of coming
            self._confirms.append((time.monotonic(), confirm))

    def _waiting_confirms(self, came_by: float = float("inf")) -> list[dict[str, Any]]:
        """The confirms waiting (MAX_CONFIRMS at most), oldest first; only those that came by
        ``came_by`` (monotonic), if given."""
        batch: list[dict[str, Any]] = []
        with self._confirms_lock:
            while self._confirms and len(batch) < MAX_CONFIRMS and self._confirms[0][0] <= came_by:
                batch.append(self._confirms.popleft()[1])
        return batch

    def _oldest_confirm(self) -> float | None:
        """When the oldest confirm waiting came (None: none waits)."""
        with self._confirms_lock:
            return self._confirms[0][0] if self._confirms else None

    def _propose_intents(self, intents: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Intents of concurrent buys as one log entry, with the confirms waiting in front: one
        majority commit where there were two (each command is still applied as alone, in order). If
        the entry fails, its confirms are lost like the confirmer's: reads and the sweep redo them."""
        confirms = self._waiting_confirms()
        if confirms:
            metrics.BUY_BATCH.labels(self.rt.name, "confirms").observe(len(confirms))
        return self._propose_all(confirms + intents, "intents", len(intents))[len(confirms):]

    def _confirm_loop(self) -> None:
        """Confirms no intents entry took within CONFIRM_LINGER of their coming, as one log entry:
        one that came a moment ago waits for the next buy's entry, not for an entry of its own
        (drained with older ones, such confirms cost a sequential buyer's order tier extra entries:
        docs/replication.md). Those that came within half a linger of the due one go with it, so that
        a burst (the last buys of a load, the sweep's) is one entry, not one per wake-up. If that
        fails (no longer leader, no quorum), the orders stay pending until a read or the sweep
        finishes them again: the catalog's key gives the same answer. Supervised: an error costs
        that batch, not the thread."""
        stopping = False
        while not stopping or self._oldest_confirm() is not None:  # on stop, until none is left
            if not stopping:
                self._confirm_due.wait()
            self._confirm_due.clear()  # before looking: a confirm queued after this sets it again
            while (oldest := self._oldest_confirm()) is not None:
                left = oldest + CONFIRM_LINGER - time.monotonic()
                if left <= 0 or self._stop.wait(left):
                    break
            stopping = self._stop.is_set()  # on stop, record what is waiting once more, young or not
            batch = self._waiting_confirms(float("inf") if stopping else time.monotonic() - CONFIRM_LINGER / 2)
            if self._oldest_confirm() is not None:  # more wait (younger, or past MAX_CONFIRMS): their turn
                self._confirm_due.set()
            if not batch:
                continue
            try:
                self._propose_all(batch, "confirms")
            except Exception as exc:
                log.info("%d confirms not recorded yet (%s); the sweep will redo them", len(batch), exc)

    def settle(self, order: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        """A read found ``order`` pending: on the leader finish it (the same answer its buyer got, or
        will get), within the read's ``deadline``; elsewhere send the reader to the leader."""
        self.rt.leader_only()
        return self.finish(order, deadline)

    def _sweep_loop(self) -> None:
        """Supervised: an error in one sweep (a full disk, a bug) is logged; the next sweep retries."""
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self._stop.is_set() or not self.rt.node.is_leader():
                continue
            try:
                self._sweep()
                if self.keys is not None and self.rt.node.can_serve_reads() and time.monotonic() >= self._scan_due:
                    # Orphans come only from a leader's death or deposition: a new leader scans
                    # at once, then every SCAN_EVERY (every sweep while a young key is waited for).
                    self._scan_due = time.monotonic() + SCAN_EVERY
                    try:
                        self.scan_orphans()
                    except (TierUnavailable, NotLeader, ProposalTimeout, ScanRefused) as exc:
                        log.warning("orphan scan not done yet (%s); retrying on the next sweep", exc)
                        self.scan_soon = True
                    if self.scan_soon:
                        self._scan_due = 0.0
            except Exception:
                log.exception("intent sweep failed; retrying on the next one")

    def _sweep(self) -> None:
        for order in self.state.pending():
            with self._lock:
                busy = order["key"] in self._in_flight
            if busy or self._stop.is_set():
                continue
            created = datetime.fromisoformat(order["created_at"]).timestamp()
            if created > self._leader_since and time.time() - created < STALE_INTENT:
                continue
            try:
                self.finish(order)
            except Exception as exc:  # retried on the next sweep
                log.warning("could not finish order %s yet: %s", order["order_number"], exc)


    def scan_orphans(self) -> int:
        """Record every buy whose decrement the catalog committed while its intent was lost; how many.

        Reads the catalog's decrement keys in (log index, key) order from where the last scan
        stopped (the replicated ``scanned`` index: every key at or below it is settled). A key with
        a finished order here, or whose decrement took no stock, is settled. One with no order is
        an orphan, unless it is younger than ORPHAN_AGE (its intent may still be on its way): the
        scan stops before it, and ``scanned`` stays below its index, so nothing at or after it is
        skipped. One whose order is still pending is not settled either: its decrement may be older
        than its intent (the buyer's retry of an orphan, before a scan adopted it), and the catalog
        must keep that key until the order is finished (``KeyExpirer``); ``scanned`` stays below it
        (until a scan after the order is finished), and the scan goes on past it. The orphans are adopted, confirmed from their decrement's
        answer, in one entry with the new ``scanned``. Adopting a key whose intent commits after all
        is harmless: whichever comes first makes the order, the other finds it. Called on a leader
        whose state holds every committed entry, so "no order here" is true of the whole log."""
        assert self.keys is not None
        term = self.rt.node.term()
        start = after = self.state.scanned()
        after_key = None
        done = after  # every key at an index up to this one is settled
        adopt: list[dict[str, Any]] = []
        young = time.time() - ORPHAN_AGE
        stopped = full = False  # before a key too young to call an orphan yet; with a full entry of adoptions
        held = False  # past a key whose order is pending: ``scanned`` stays below it
        while not self._stop.is_set():
            reply = self.keys.read("/keys", time.monotonic() + CATALOG_DEADLINE,
                                   {"after": after, "limit": SCAN_PAGE} | ({"after_key": after_key} if after_key else {}))
            if reply.status != 200:
                raise ScanRefused(f"the catalog did not list its keys: {reply.status} {reply.body}")
            found = reply.body["keys"]
            ordered = self.state.statuses([k["key"] for k in found])
            for k in found:
                if not held:  # keys come in (index, key) order: the earlier are seen
                    done = max(done, k["idx"] - 1)
                held = held or (k["ok"] and ordered.get(k["key"]) == PENDING)
                if k["ok"] and k["key"] not in ordered:
                    # (a time far ahead is a skewed clock's, not a buy in flight: not waited for)
                    stopped = young < k["at"] <= young + 2 * ORPHAN_AGE
                    full = len(adopt) >= SCAN_PAGE
                    if stopped or full:
                        break
                    adopt.append(adoption(k["key"], k["item"], k["quantity"], k, k["at"]))
                after, after_key = k["idx"], k["key"]
            else:
                if not reply.body["more"]:
                    if not held:
                        done = max(done, after)  # every key listed was seen
                    break
                continue
            break
        if done > start or adopt:
            if adopt:
                log.warning("recording %d buys whose decrement outlived their intent: %s", len(adopt),
                            ", ".join(a["key"] for a in adopt[:5]))
            self._propose_all([*adopt, {"op": "scanned", "upto": done}], "adopts", len(adopt))
        self.scan_soon = stopped or full  # (a pending key waits for the next scan: the catalog keeps it)
        if not self._stop.is_set():
            self._scanned_term = term  # counts only while we still lead in it (``together_ok``)
        return len(adopt)


def unix(created_at: str) -> float:
    """An order's ``created_at`` (ISO 8601, UTC, milliseconds) in Unix seconds."""
    return datetime.fromisoformat(created_at).timestamp()


class KeyExpirer(Periodic):
    """Forgets idempotency keys older than the key window, on both tiers, from the order leader.

    A key's time is when the order leader sent its decrement: the catalog keeps the first time it
    got, and the order's confirm or fail records the one that decided it, so never an earlier one.
    The order leader picks a time ``T``: the window's start, or the creation of its oldest unfinished
    buy if that is older. The catalog forgets the keys whose time is before ``T``; only once it has,
    the order tier forgets the keys of finished orders whose time is before ``T``. So:

    * an unfinished buy keeps its keys on both tiers (``T`` is not after its creation, and its
      decrement was sent after that; a decrement sent after this round began is newer than ``T``;
      a decrement sent before it, by a leader that lost the buy's intent, is above ``scanned``,
      which the orphan scan keeps below every key whose order is pending, and the catalog keeps
      every key above ``scanned``);
    * an order never forgets a key the catalog still remembers (a retry would then make a new order
      whose decrement gets the old one's answer): its time is not before the catalog's, and the
      catalog went first with the same ``T``.

    Both removals are log commands carrying ``T``: every replica forgets the same rows. Assumes the
    order replicas' clocks differ by much less than the window.
    """

    def __init__(self, rt: ReplicaRuntime, state: OrderState, catalog: TierRouter, window: float) -> None:
        # Often enough that a key outlives its window by a small fraction of it.
        super().__init__("key-expirer", min(60.0, max(1.0, window / 10)))
        self.rt, self.state, self.catalog, self.window = rt, state, catalog, window

    def due(self) -> bool:
        # A leader whose state holds every committed entry: its pending orders are all there are.
        return self.rt.node.is_leader() and self.rt.node.can_serve_reads()

    def work(self) -> None:
        self.expire()

    def expire(self) -> dict[str, int]:
        """One round; how many keys each tier forgot."""
        cutoff = time.time() - self.window
        oldest = self.state.oldest_pending()
        if oldest is not None:
            cutoff = min(cutoff, unix(oldest))
        # Keys of decrements the orphan scan has not read yet stay (a buy may have nothing else
        # left); the catalog tells the oldest time it kept so, and this tier keeps its own from it.
        reply = self.catalog.write("/keys/expire", {"before": cutoff, "scanned": self.state.scanned()},
                                   time.monotonic() + PROPOSE_TIMEOUT)
        if reply.status != 200:
            raise RuntimeError(f"the catalog did not forget its keys: {reply.status} {reply.body}")
        kept = reply.body.get("kept_before")
        if kept is not None:
            cutoff = min(cutoff, float(kept))
        mine = self.rt.propose({"op": "expire", "before": cutoff}, PROPOSE_TIMEOUT)
        return {"catalog": int(reply.body["forgotten"]), "order": int(mine["forgotten"])}


def public_order(order: dict[str, Any]) -> dict[str, Any]:
    return {k: order[k] for k in ("order_number", "item_number", "title", "quantity", "cost", "total", "created_at")}


def answer(buy: Buy, outcome: dict[str, Any] | BaseException) -> tuple[int, dict[str, Any]]:
    """What the buyer hears: the order, or why not and whether a retry with the same key is safe."""
    def error(code: int, message: str, **extra: Any) -> tuple[int, dict[str, Any]]:
        return code, {"error": {"code": code, "message": message, **extra}}

    if isinstance(outcome, DeadlineSpent):
        return error(504, f"the buy's time budget was spent {outcome} (retry with the same key)")
    if isinstance(outcome, TierUnavailable):
        return error(503, f"catalog unavailable, buy not finished yet (retry with the same key): {outcome.last}")
    if isinstance(outcome, ProposalTimeout | NotLeader):
        return error(503, f"the buy's outcome is not known yet ({type(outcome).__name__}): retry with the same key")
    if isinstance(outcome, ApiError):
        return error(outcome.code, outcome.message, **outcome.extra)
    if isinstance(outcome, BaseException):  # a bug or a storage fault: this buy's answer, not its batch's
        log.error("buy %s failed: %r", buy.key, outcome, exc_info=outcome)
        return error(500, f"the buy failed unexpectedly ({type(outcome).__name__}); its outcome is unknown: "
                          "retry with the same key")
    if outcome["item_number"] != buy.item or outcome["quantity"] != buy.quantity:
        return error(422, "this idempotency key was already used for a different buy")
    if outcome["status"] == FAILED:
        return error(outcome["error"]["code"], outcome["error"]["message"])
    assert outcome["status"] == CONFIRMED
    return 200, public_order(outcome)


def parse_buy(body: Any, deadline: float) -> Buy:
    """One buy from a request body, by ``deadline`` or the item's own ``timeout_ms`` if sooner."""
    if not isinstance(body, dict):
        fail(400, "each buy must be an object {item, quantity, key}")
    item = int_field(body, "item", 1, 2**62)
    quantity = int_field(body, "quantity", 1, 1000)
    key = body.get("key")
    if not isinstance(key, str) or not 0 < len(key) <= 256:
        fail(400, "key must be a non-empty string")
    if "timeout_ms" in body:  # 0: its time ran out on the way (``router.batch_write``): 504, nothing done
        deadline = min(deadline, time.monotonic() + int_field(body, "timeout_ms", 0, MAX_TIMEOUT_MS) / 1000)
    return Buy(item, quantity, key, deadline)


def create_app(config: ClusterConfig, k: int) -> Flask:
    state = OrderState(config.replica_dir(f"order-{k}") / "state.db")
    rt = ReplicaRuntime("order", k, config, state)
    # What either router found: stopped replicas, the leader, the members.
    seen = Sightings(via=config.router_urls.get(rt.name, {}), configured=lambda: config.peers_now(rt.name, "catalog"))
    catalog = TierRouter("catalog", config.peers_for(rt.name, "catalog"), rt.secret, sightings=seen)
    # The decrements as frames on the catalog's peer transport (``/books/decrements``'s work).
    decrements = ChannelRouter("catalog", config.peers_for(rt.name, "catalog"), rt.secret, rt.name, DECREMENTS_CHANNEL,
                               sightings=seen)
    buys = BuyProcessor(rt, state, decrements, catalog)
    app = rt.create_app()
    app.extensions["pygmy_runtime"] = rt
    app.extensions["pygmy_sightings"] = Watchers(seen)  # stopped with the worker (pygmy/cluster/serve.py)

    def run(batch: list[Buy]) -> list[tuple[int, dict[str, Any]]]:
        rt.leader_only()
        outcomes = buys.buy_many(batch)
        if all(isinstance(o, NotLeader) for o in outcomes):
            raise outcomes[0]  # type: ignore[misc]  # deposed before anything was done: 421, routers follow
        return [answer(b, o) for b, o in zip(batch, outcomes, strict=True)]

    @app.post("/buy")
    @rt.only("frontend")
    def buy() -> Response:
        ((code, body),) = run([parse_buy(json_body(required=True), request_deadline(config.buy_deadline))])
        resp = jsonify(body)
        resp.status_code = code
        return resp

    def run_batch(body: dict[str, Any], deadline: float) -> dict[str, Any]:
        """The buys a frontend worker has in flight, in one request: ``{"items": [{item, quantity,
        key, timeout_ms}, ...]}``, answered ``{"results": [{"status", "body"}, ...]}`` in order, each
        as ``/buy`` would answer it alone (``router.batch_write``). A malformed item refuses the
        whole batch (400)."""
        raw = body.get("items")
        if not isinstance(raw, list) or not 0 < len(raw) <= MAX_BUYS:
            fail(400, f"items must be a list of 1 to {MAX_BUYS} buys")
        results = run([parse_buy(b, deadline) for b in raw])
        return {"results": [{"status": code, "body": body} for code, body in results]}

    @app.post("/buys")
    @rt.only("frontend")
    def buy_batch() -> Response:
        """``run_batch`` over HTTP; the frontend sends its batches as frames (``BUYS_CHANNEL``)."""
        return jsonify(run_batch(json_body(required=True), request_deadline(config.buy_deadline)))

    rt.serve_frames(BUYS_CHANNEL, "/buys", lambda body, deadline: run_batch(
        body, min(deadline, time.monotonic() + config.buy_deadline)))

    @app.get("/orders")
    @rt.only("frontend", "admin")
    def list_orders() -> Response:
        """A page of this replica's orders numbered above ``after``: the confirmed ones as ``GET
        /orders/<n>`` gives them with their idempotency keys, and the numbers of those still pending (not settled here: the
        order leader's sweeper settles them within seconds; ask again). For the checkers that read
        every order of every replica (``pygmy.verify.chaos.read_orders``): a page, not a request each."""
        after = query_int("after", 0, 10**18 - 1, 0)
        limit = query_int("limit", 1, MAX_ORDERS_PAGE, 100)
        rt.ensure_readable()
        rows = state.orders_after(after, limit)
        return jsonify({
            # With its key (``k:`` and the buyer's Idempotency-Key, or a generated ``g:`` one): a
            # checker tells each keyed buy's order from any other by it.
            "orders": [{**public_order(o), "key": o["key"]} for o in rows if o["status"] == CONFIRMED],
            "pending": [o["order_number"] for o in rows if o["status"] == PENDING],
            "next": rows[-1]["order_number"] if len(rows) == limit else None})

    @app.get("/orders/<number>")
    @rt.only("frontend", "admin")
    def get_order(number: str) -> Response:
        n = parse_item(number, "order number")
        rt.ensure_readable()
        order = state.order(n)
        if order is not None and order["status"] == PENDING:
            try:
                order = buys.settle(order, request_deadline(config.buy_deadline))
            except TierUnavailable as exc:
                fail(503, f"order {n} is not settled yet and the catalog is unavailable: {exc.last}")
            except DeadlineSpent as exc:
                fail(504, f"order {n} is not settled yet, and the read's time budget was spent {exc}")
        if order is None or order["status"] != CONFIRMED:
            fail(404, f"no order with number {n}")
        return jsonify(public_order(order))

    rt.start()
    buys.start()
    app.extensions["pygmy_buys"] = buys
    expirer = KeyExpirer(rt, state, catalog, config.key_window)
    expirer.start()
    app.extensions["pygmy_key_expirer"] = expirer
    return app
