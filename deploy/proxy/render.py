"""Start the reverse proxy: ``nginx.conf`` rendered for where it runs, then nginx in this process's place.

The shipped configuration names the frontends of the Compose file (``frontend-1:8000``,
``frontend-2:8000``). Elsewhere ``PYGMY_PROXY_UPSTREAMS`` names them instead, as comma-separated
``host:port`` (Kubernetes: the ``frontend`` Service, ``frontend:8000``), and ``PYGMY_PROXY_LISTEN``
what to listen on (default ``8000``). nginx starts once every upstream's name resolves (at most
``PYGMY_PROXY_WAIT`` s, default 300). Standard library only: the proxy's image has no Pygmy in it.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The upstream servers' lines of the shipped configuration (their parameters are kept).
_SERVER = re.compile(r"(?m)^(?P<indent>[ \t]*)server (?P<address>[^\s;]+)(?P<params>[^;\n]*);\n")
_LISTEN = "listen 8000 reuseport;"


def render(text: str, upstreams: list[str] | None = None, listen: str | None = None,
           run_dir: str | None = None, as_root: bool = False) -> str:
    """``text`` (the shipped ``nginx.conf``) with other upstream servers, another listen address,
    and its writable paths under ``run_dir`` instead of ``/tmp``."""
    servers = list(_SERVER.finditer(text))
    if len(servers) < 1:
        raise ValueError("the configuration names no upstream server")
    if upstreams:
        if any(not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+:\d+", u) for u in upstreams):
            raise ValueError(f"PYGMY_PROXY_UPSTREAMS must be host:port, ... (got {upstreams})")
        first = servers[0]
        lines = "".join(f"{first['indent']}server {u}{first['params']};\n" for u in upstreams)
        text = text[:first.start()] + lines + _SERVER.sub("", text[first.end():])
    if listen:
        if _LISTEN not in text:
            raise ValueError(f"the configuration does not say {_LISTEN!r}")
        text = text.replace(_LISTEN, f"listen {listen};")
    if run_dir:
        text = text.replace("/tmp/", f"{run_dir.rstrip('/')}/")
    return ("user root;\n" if as_root else "") + text


def wait_for_names(upstreams: list[str], timeout: float) -> list[str]:
    """Wait until every upstream's host name resolves; the ones that still do not after ``timeout``.
    nginx refuses to start when one does not, and under Swarm (no start order) or before a frontend's
    first task runs, a name resolves only once its service has a task."""
    deadline = time.monotonic() + timeout
    while True:
        missing = []
        for u in upstreams:
            host = u.rsplit(":", 1)[0].strip("[]")
            try:
                socket.getaddrinfo(host, None)
            except OSError:
                missing.append(host)
        if not missing or time.monotonic() >= deadline:
            return missing
        print(f"pygmy proxy: waiting for {', '.join(missing)} to resolve", file=sys.stderr, flush=True)
        time.sleep(1.0)


def main() -> None:
    conf = Path(os.environ.get("PYGMY_PROXY_CONF", HERE / "nginx.conf"))
    upstreams = [u.strip() for u in os.environ.get("PYGMY_PROXY_UPSTREAMS", "").split(",") if u.strip()]
    listen = os.environ.get("PYGMY_PROXY_LISTEN") or None
    out = Path("/tmp/pygmy-nginx.conf")
    try:
        text = render(conf.read_text(), upstreams, listen)
        out.write_text(text)
    except (OSError, ValueError) as exc:
        sys.exit(f"pygmy proxy: {exc}")
    names = [m["address"] for m in _SERVER.finditer(text)]
    missing = wait_for_names(names, float(os.environ.get("PYGMY_PROXY_WAIT", "300")))
    if missing:
        sys.exit(f"pygmy proxy: {', '.join(missing)} did not resolve within PYGMY_PROXY_WAIT s")
    os.execvp("nginx", ["nginx", "-e", "stderr", "-c", str(out), "-g", "daemon off;"])


if __name__ == "__main__":
    main()
