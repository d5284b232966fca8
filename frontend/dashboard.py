"""``/dashboard``: a live page of the cluster, served by every frontend from files in this package.

The page (``frontend/static/``) polls ``/dashboard/state`` about once a second. The answer holds
nothing a worker keeps for itself: the tiers come from the worker's ``StatusView`` (every replica's
own ``/status``), and the request counts, latency histograms and each worker's cache and lease
figures from the multiprocess metrics files all workers of this frontend write. So it is the same
whichever worker answers. Rates, percentiles over the last second, chart history and the event list
are computed by the page from successive answers: a page shows what happened since it was opened,
and any number of open pages cost the server no memory.

Fault buttons post to ``/dashboard/faults`` (admin token), which hands the request to ``pygmy up``
through its control socket (``pygmy/kit/control.py``); without one, the page shows no buttons and
the server refuses.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flask import Flask, Response, jsonify, send_from_directory

from pygmy.frontend.statusview import StatusView
from pygmy.kit import control, metrics
from pygmy.kit.config import ClusterConfig
from pygmy.kit.web import fail, json_body

STATIC = Path(__file__).resolve().parent / "static"
#: What each worker mirrors into ``pygmy_frontend_worker`` (``pygmy/kit/metrics.py``).
WORKER_FIELDS = ("hits", "misses", "invalidations", "entries", "pushes", "lease_until", "lease_term")
#: The public operations the page charts, by the Flask route that serves them.
OPERATIONS = {"search": "/search/<path:topic>", "lookup": "/lookup/<item>", "buy": "/buy/<item>"}
DEFAULT_PAUSE = 5.0


def static_files() -> list[str]:
    """The page's files, as ``/dashboard/static/<name>`` serves them."""
    return sorted(str(f.relative_to(STATIC)) for f in STATIC.rglob("*") if f.is_file())


def _alive(pid: int) -> bool:
    """Whether a worker that wrote metrics still runs (a SIGKILLed one leaves its files behind)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_metrics(service: str) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """This frontend's workers and its per-operation counts and latency histograms, from one read
    of the metrics every worker writes."""
    by_route = {route: op for op, route in OPERATIONS.items()}
    ops: dict[str, dict[str, Any]] = {op: {"count": 0, "errors": 0, "buckets": []} for op in OPERATIONS}
    workers: dict[int, dict[str, float]] = {}
    for family in metrics.registry_for_scrape().collect():
        for s in family.samples:
            labels = s.labels
            if labels.get("service") != service:
                continue
            if s.name == "pygmy_frontend_worker":
                pid = int(labels.get("pid", os.getpid()))
                workers.setdefault(pid, {})[labels["field"]] = s.value
            elif (op := by_route.get(labels.get("route", ""))) is not None:
                if s.name == "pygmy_http_request_seconds_bucket":
                    le = labels["le"]
                    ops[op]["buckets"].append([None if le == "+Inf" else float(le), int(s.value)])
                elif s.name == "pygmy_http_request_seconds_count":
                    ops[op]["count"] = int(s.value)
                elif s.name == "pygmy_http_requests_total" and labels.get("status", "").startswith("5"):
                    ops[op]["errors"] += int(s.value)
    for op in ops.values():
        op["buckets"].sort(key=lambda b: float("inf") if b[0] is None else b[0])
    now = time.time()
    rows = []
    for pid, f in sorted(workers.items()):
        if not _alive(pid):
            continue
        until = f.get("lease_until", 0.0)
        rows.append({
            "pid": pid, "entries": int(f.get("entries", 0)), "hits": int(f.get("hits", 0)),
            "misses": int(f.get("misses", 0)), "invalidations": int(f.get("invalidations", 0)),
            "pushes": int(f.get("pushes", 0)), "lease_valid": until > now,
            "lease_left_ms": round(max(0.0, until - now) * 1000), "lease_term": int(f.get("lease_term", 0)),
        })
    return rows, ops


def register(app: Flask, config: ClusterConfig, name: str, views: StatusView,
             admin: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Add the page, its files, its state and its fault requests to a frontend's app."""
    replicas = [n for tier in ("catalog", "order") for n in config.peers(tier)]

    @app.get("/dashboard")
    def dashboard_page() -> Response:
        resp = send_from_directory(STATIC, "dashboard.html", max_age=0)
        resp.headers["Cache-Control"] = "no-cache"
        return resp

    @app.get("/dashboard/static/<path:filename>")
    def dashboard_static(filename: str) -> Response:
        return send_from_directory(STATIC, filename, max_age=300)  # 404 for anything not in the package

    @app.get("/dashboard/state")
    def dashboard_state() -> Response:
        """Everything the page draws, now: tiers (as of ``age_ms`` ago), workers, operations."""
        tiers, age = views.get()
        workers, ops = read_metrics(name)
        return jsonify({
            "frontend": name, "now": time.time(), "age_ms": round(age * 1000, 1),
            "tiers": {"catalog": tiers["catalog"], "order": tiers["order"]},
            "workers": workers, "operations": ops,
            "faults": control.available(config.run_dir()), "max_pause": control.MAX_PAUSE,
        })

    @app.post("/dashboard/faults")
    @admin
    def dashboard_faults() -> Response:
        """Kill, pause (SIGSTOP for ``seconds``) or start a replica, through ``pygmy up``."""
        body = json_body(required=True)
        action, target = body.get("action"), body.get("name")
        if action not in control.ACTIONS:
            fail(400, f"action must be one of {', '.join(control.ACTIONS)}")
        if target not in replicas:
            fail(400, f"name must be a replica of this cluster: {', '.join(replicas)}")
        req: dict[str, Any] = {"action": action, "name": target}
        if action == "pause":
            seconds = body.get("seconds", DEFAULT_PAUSE)
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not (
                    0 < seconds <= control.MAX_PAUSE):
                fail(400, f"seconds must be a number above 0 and at most {control.MAX_PAUSE:g}")
            req["seconds"] = seconds
        try:
            answer = control.request(config.run_dir(), req)
        except control.ControlError as exc:
            fail(exc.status, str(exc))
        return jsonify(answer)
