"""Start the reverse proxy: ``nginx.conf`` rendered for where it runs, then nginx in this process's place.

The shipped configuration names the frontends of the Compose file (``frontend-1:8000``,
``frontend-2:8000``). Elsewhere ``PYGMY_PROXY_UPSTREAMS`` names them instead, as comma-separated
``host:port`` (Kubernetes: the ``frontend`` Service, ``frontend:8000``), and ``PYGMY_PROXY_LISTEN``
what to listen on (default ``8000``). Standard library only: the proxy's image has no Pygmy in it.
"""

from __future__ import annotations

import os
import re
import sys
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


def main() -> None:
    conf = Path(os.environ.get("PYGMY_PROXY_CONF", HERE / "nginx.conf"))
    upstreams = [u.strip() for u in os.environ.get("PYGMY_PROXY_UPSTREAMS", "").split(",") if u.strip()]
    listen = os.environ.get("PYGMY_PROXY_LISTEN") or None
    out = Path("/tmp/pygmy-nginx.conf")
    try:
        out.write_text(render(conf.read_text(), upstreams, listen))
    except (OSError, ValueError) as exc:
        sys.exit(f"pygmy proxy: {exc}")
    os.execvp("nginx", ["nginx", "-e", "stderr", "-c", str(out), "-g", "daemon off;"])


if __name__ == "__main__":
    main()
