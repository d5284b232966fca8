"""``pygmy member list|add|promote|remove|lead TIER NAME [URL]``: a tier's replicas, one change at a
time, and which of them leads.

Each change is a call to the tier's leader (``/members`` on every replica: docs/api.md, "Membership
of a tier"), with the internal secret, as ``pygmy verify`` does: the leader is found by asking the
replicas ``cluster.json`` names and following their 421s, which name the leader and its URL (a
leader added since is found that way too). After a change, ``cluster.json`` records the members
it left, so that ``pygmy start`` starts an added replica and ``pygmy up`` leaves a removed one out.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import requests
import urllib3

from pygmy.kit.config import ClusterConfig, parse_name

#: Statuses after which another replica, or the same one again shortly, may do: not the leader,
#: not ready.
_ELSEWHERE = (421, 503)
#: Refusals that settle by themselves within moments, asked again until the command's time is up:
#: a change not yet committed, a leader just elected that has not committed an entry of its term,
#: a hand-over under way.
_TRANSIENT = ("pending", "transferring")


#: The refusal each change gets when it is made already: after an attempt whose outcome is unknown
#: (no answer, or 503), it may be that attempt's doing (``_made_already``).
_MADE_ALREADY = {"add": "duplicate", "promote": "not_learner", "remove": "unknown"}


class MemberError(RuntimeError):
    """The change was refused, or no leader answered: ``pygmy member`` says why and exits 1.
    ``kind``: the refusal's; ``uncertain``: an attempt before it may have been made (no answer)."""

    def __init__(self, message: str, kind: str | None = None, uncertain: bool = False) -> None:
        super().__init__(message)
        self.kind, self.uncertain = kind, uncertain


def call(config: ClusterConfig, tier: str, method: str, path: str, body: dict[str, Any] | None = None,
         timeout: float = 10.0, retry_kinds: tuple[str, ...] = ()) -> dict[str, Any]:
    """``method path`` on the leader of ``tier``, until ``timeout``: the answer's body, or
    ``MemberError`` with the refusal. 409s whose ``kind`` is transient, or in ``retry_kinds``, are
    asked again."""
    retry_kinds = (*_TRANSIENT, *retry_kinds)
    auth = {"Authorization": f"Bearer {config.secret()}"}
    deadline = time.monotonic() + timeout
    urls = list(config.peers(tier).values())
    last = "no replica answered"
    uncertain = False  # a request may have reached the leader without our hearing its outcome
    with requests.Session() as s:
        while True:
            queue = list(urls)
            while queue:
                url = queue.pop(0)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MemberError(f"{tier}: {last}", uncertain=uncertain)
                try:
                    r = s.request(method, url + path, json=body, headers={**auth, "X-Request-Timeout-Ms": str(
                        int(min(left, 6.0) * 1000))}, timeout=(0.5, min(left, 6.0) + 1), **config.tool_tls())
                    answer = r.json()
                except (requests.RequestException, ValueError) as exc:
                    last = f"{url}: {type(exc).__name__}"
                    uncertain = uncertain or (method != "GET" and _may_have_arrived(exc))
                    continue
                error = answer.get("error", {}) if isinstance(answer, dict) else {}
                if r.status_code == 200:
                    return answer
                last = f"{r.status_code}: {error.get('message', r.text[:200])}"
                uncertain = uncertain or (method != "GET" and error.get("kind") == "outcome_unknown")
                if r.status_code == 421 and error.get("leader_url"):
                    queue.insert(0, error["leader_url"])  # the leader, if it is one we do not know
                    if error["leader_url"] not in urls:
                        urls.append(error["leader_url"])
                elif r.status_code not in _ELSEWHERE and not (r.status_code == 409 and error.get("kind") in retry_kinds):
                    raise MemberError(last, error.get("kind"), uncertain)
            time.sleep(0.2)


def _may_have_arrived(exc: BaseException) -> bool:
    """Whether a request that failed so may have reached the replica (a read timed out, a connection
    dropped before the answer): not if no connection was made, nor if the answer was not JSON."""
    if isinstance(exc, ValueError | requests.ConnectTimeout):
        return False
    if isinstance(exc, requests.ConnectionError):
        cause = exc.args[0] if exc.args else None
        cause = getattr(cause, "reason", cause)  # (urllib3's MaxRetryError wraps what happened)
        return not isinstance(cause, urllib3.exceptions.NewConnectionError | urllib3.exceptions.ConnectTimeoutError)
    return True


def record(config: ClusterConfig, tier: str, membership: dict[str, Any]) -> None:
    """``cluster.json`` records the members a change left (their URLs, and which are learners)."""
    names = [*membership["voters"], *membership["learners"]]
    config.members = {**config.members, tier: {n: membership["urls"][n] for n in names if n in membership["urls"]}}
    config.tier_learners = {**config.tier_learners, tier: list(membership["learners"])}
    config.save()


def _made_already(config: ClusterConfig, tier: str, action: str, name: str, url: str | None,
                  refused: MemberError) -> dict[str, Any]:
    """After an attempt whose outcome is unknown, a refusal saying the change is made already
    (added, a voter, not a member) means that attempt made it: the configuration the leader has
    now, once it is committed. Otherwise ``refused`` is raised: a change made by someone else, or
    with another URL, is still refused."""
    if not refused.uncertain or refused.kind != _MADE_ALREADY[action]:
        raise refused
    deadline = time.monotonic() + 10
    while True:
        try:
            view = call(config, tier, "GET", "/members", timeout=max(1.0, deadline - time.monotonic()))
        except MemberError:
            raise refused from None  # not known to be made: the refusal stands
        members = {m["name"]: m for m in view["members"]}
        if action == "add":
            made = name in members and members[name]["url"] == (url or "").rstrip("/")
        elif action == "promote":
            made = members.get(name, {}).get("role") == "voter"
        else:
            made = name not in members
        if not made:
            raise refused
        if not view["pending"]:
            return {"voters": sorted(n for n, m in members.items() if m["role"] == "voter"),
                    "learners": sorted(n for n, m in members.items() if m["role"] != "voter"),
                    "urls": {n: m["url"] for n, m in members.items()}}
        if time.monotonic() > deadline:
            raise MemberError(f"{tier}: {action} {name} was made, but has not committed yet") from None
        time.sleep(0.2)


def _check(tier: str, name: str | None) -> None:
    if tier not in ("catalog", "order"):
        raise MemberError(f"unknown tier {tier!r}: catalog or order")
    if name is not None:
        try:
            named_tier, _ = parse_name(name)
        except ValueError as exc:
            raise MemberError(str(exc)) from None
        if named_tier != tier:
            raise MemberError(f"{name} is not a {tier} replica's name (e.g. {tier}-4)")


def run(config: ClusterConfig, action: str, tier: str, name: str | None, url: str | None, wait: float,
        as_json: bool, out: Any = sys.stdout, record_changes: bool = True) -> int:
    """One ``pygmy member`` command; ``record_changes``: keep ``cluster.json`` in step (not in a
    container, whose replicas take their peers from the environment and their members from the log)."""
    _check(tier, name)
    if action == "list":
        view = call(config, tier, "GET", "/members")
        if as_json:
            print(json.dumps(view, indent=2), file=out)
            return 0
        print(f"{tier}: leader {view['leader']} (term {view['term']}), last index {view['last_index']}"
              f"{', a change is pending' if view['pending'] else ''}", file=out)
        for m in view["members"]:
            state = "" if m["role"] == "voter" else ("  caught up" if m["caught_up"] else "  catching up")
            print(f"  {m['name']:12} {m['role']:8} {m['url']:28} lag {m['lag']}{state}", file=out)
        return 0
    assert name is not None
    if action == "lead":
        # 421s lead from replica to replica until ``name`` says it leads (a hand-over that an
        # election overtook is asked for again, of the new leader).
        # With --wait, a hand-over that ended without it leading (``lagging``) is asked for again.
        view = call(config, tier, "POST", f"/members/{name}/lead", timeout=max(10.0, wait),
                    retry_kinds=("lagging",) if wait > 0 else ())
        print(json.dumps(view, indent=2) if as_json else f"{name} leads {tier} (term {view['term']})", file=out)
        return 0
    if action == "add" and not url:
        raise MemberError("add needs the new replica's URL, e.g. http://10.0.0.4:8104")
    try:
        if action == "add":
            assert url is not None
            conf = call(config, tier, "POST", "/members", {"name": name, "url": url.rstrip("/")})
        elif action == "promote":
            # With --wait, while it catches up (``lagging``), ask again.
            conf = call(config, tier, "POST", f"/members/{name}/promote", timeout=max(10.0, wait),
                        retry_kinds=("lagging",) if wait > 0 else ())
        else:
            conf = call(config, tier, "DELETE", f"/members/{name}", timeout=max(10.0, wait))
    except MemberError as refused:  # an earlier attempt that went unanswered may have made it
        conf = _made_already(config, tier, action, name, url, refused)
    what = {"add": f"added {name} to {tier} as a learner at {url}; start it: pygmy start {name}",
            "promote": f"promoted {name} to a voter of {tier}", "remove": f"removed {name} from {tier}"}[action]
    if record_changes:
        record(config, tier, conf)
    print(json.dumps(conf, indent=2) if as_json else
          f"{what} (voters {', '.join(conf['voters'])}; learners {', '.join(conf['learners']) or 'none'})", file=out)
    return 0
