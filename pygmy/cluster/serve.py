"""Run one Pygmy service in the foreground under Gunicorn (``pygmy serve``).

Replicas run ONE worker process (with threads) on purpose: the replication node, its log and its
leader state must live in a single process. The frontend runs ``--frontend-workers`` processes;
everything it keeps in memory is written to be correct with several of them.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import ssl
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gunicorn.app.base import BaseApplication

from pygmy.kit import logs, tls
from pygmy.kit.config import ClusterConfig


class _Gunicorn(BaseApplication):
    def __init__(self, factory: Callable[[], Any], options: dict[str, Any]) -> None:
        self.factory, self.options = factory, options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        return self.factory()


#: GIL switch interval in service processes (Python's default is 5 ms).
SWITCH_INTERVAL = 0.0005


def _worker_exit(server: Any, worker: Any) -> None:
    """Stop the threads the app started (replication node, sweepers) when Gunicorn stops a worker."""
    from pygmy.kit.metrics import worker_exited

    worker_exited(worker.pid)
    app = getattr(worker, "wsgi", None)
    runtime = getattr(app, "extensions", {}).get("pygmy_runtime")
    if runtime is not None:  # Gunicorn finished the HTTP requests in flight; now the frame requests
        left = runtime.drain()
        if left:
            logging.getLogger(__name__).warning("stopping with %d frame requests still in flight", left)
    for ext in ("pygmy_key_expirer", "pygmy_buys", "pygmy_restocker", "pygmy_subscription", "pygmy_invalidator",
                "pygmy_sightings", "pygmy_runtime"):
        owner = getattr(app, "extensions", {}).get(ext)
        if owner is not None:
            try:
                owner.stop()
            except Exception:  # keep stopping the others
                logging.getLogger(__name__).exception("stopping %s", ext)
    if runtime is not None:
        runtime.sm.close_all()  # closed here, not by the collections that are skipped below
    if os.getpid() == worker.pid:
        # Gunicorn's master also calls this hook for a worker it found dead, and goes on running:
        # only a worker that is itself exiting skips the collections.
        _exit_without_collections()


def _exit_without_collections() -> None:
    """Let the process exit without garbage collections over its whole heap: what is left is freed
    by the exit itself, and nothing left needs a finalizer (the databases are closed, logging is
    flushed at exit). Interpreter shutdown collects several times; with every service of a
    cluster stopping at once on 2 cores, that took most of the second each took to stop
    (measured: a whole cluster's ``pygmy up`` stop 1.3-2.2 s -> 0.6-0.8 s)."""
    gc.freeze()


def factory_for(tier: str, config: ClusterConfig, k: int) -> Callable[[], Any]:
    def build() -> Any:
        # Replies hop between threads (HTTP handler -> replication loop -> sender -> loop -> handler).
        # With the default 5 ms GIL switch interval each hop can wait for a busy thread's time slice.
        sys.setswitchinterval(SWITCH_INTERVAL)
        logs.setup(f"{tier}-{k}")
        if tier == "catalog":
            from pygmy.catalog.app import create_app
        elif tier == "order":
            from pygmy.order.app import create_app
        else:
            from pygmy.frontend.app import create_app
        return create_app(config, k)

    return build


def _prepare_metrics_dir(path: Path) -> None:
    """A clean prometheus multiprocess directory, set before prometheus_client is first imported."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)


def gunicorn_options(bind: str, workers: int, threads: int, name: str,
                     classes: Iterable[str] = ()) -> dict[str, Any]:
    """The Gunicorn settings every Pygmy service runs with (benchmarks reuse them for baselines).

    With several workers, the admission caps of ``classes`` hold for the service as a whole: the
    workers count their requests on one ``Board`` (``pygmy/kit/admission.py``)."""
    hooks: dict[str, Any] = {}
    if workers > 1 and classes:
        from pygmy.kit.admission import Board  # imports prometheus_client: after its directory is set

        board = Board(classes, slots=2 * workers + 2)  # a reload forks new workers before the old go
        hooks = {"pre_fork": board.assign, "child_exit": board.release}
    return {
        **hooks,
        "bind": bind,
        "workers": workers,
        "worker_class": "pygmy.cluster.worker.AdmissionWorker",  # gthread, refusing early under a surge
        "threads": threads,
        "timeout": 30,
        "graceful_timeout": 10,
        "keepalive": 30,
        "backlog": 1024,
        # URLs up to 8 KiB and headers up to 16 KiB must reach the app (which answers in JSON);
        # the worker bounds what Gunicorn reads instead (``worker.MAX_LINE``, ``worker.MAX_HEAD``).
        "limit_request_line": 0,
        "limit_request_field_size": 32768,
        "limit_request_fields": 1000,
        "preload_app": False,
        "worker_exit": _worker_exit,
        "on_exit": lambda arbiter: _exit_without_collections(),  # the master's exit, after its workers'
        "proc_name": f"pygmy-{name}",
        "accesslog": None,
        "errorlog": "-",
        "loglevel": "info",
        "logconfig_dict": logs.gunicorn_logconfig(name),
    }


def run_gunicorn(factory: Callable[[], Any], options: dict[str, Any]) -> None:
    """Serve the WSGI app ``factory()`` builds (in each worker) until Gunicorn is told to stop."""
    _Gunicorn(factory, options).run()


def tls_options(tier: str, identity: tls.Identity) -> dict[str, Any]:
    """Gunicorn's HTTPS settings for a service of ``tier``: mutual TLS on a replica (its callers are
    services and the operator's tools, each role checked by the worker), a certificate optional on
    the frontend (any client; one shown must be of the cluster's CA). The context is the
    identity's own, made once and reloaded when the files change (Gunicorn asks for one per connection)."""
    from pygmy.cluster.worker import AdmissionWorker

    mode = ssl.CERT_OPTIONAL if tier == "frontend" else ssl.CERT_REQUIRED
    AdmissionWorker.peer_roles = tls.HTTP_CLIENTS.get(tier)
    files = identity.files
    return {"certfile": str(files.cert), "keyfile": str(files.key), "ca_certs": str(files.ca),
            "cert_reqs": int(mode), "do_handshake_on_connect": False,
            "ssl_context": lambda conf, default: identity.server_context(mode)}


def serve(tier: str, config: ClusterConfig, k: int) -> None:
    _prepare_metrics_dir(config.run_dir() / "metrics" / f"{tier}-{k}")
    identity = tls.Identity.of(config.certs_path(), f"{tier}-{k}") if config.tls else None
    tls.use(identity)  # before the fork: every worker dials its peers with it
    options = gunicorn_options(
        f"{config.bind_address(f'{tier}-{k}')}:{config.listen_port(tier, k)}",
        workers=config.frontend_workers if tier == "frontend" else 1,
        threads=config.threads(tier),
        name=f"{tier}-{k}",
        classes=config.limits(tier),
    )
    if identity is not None:
        options.update(tls_options(tier, identity))
    run_gunicorn(factory_for(tier, config, k), options)
