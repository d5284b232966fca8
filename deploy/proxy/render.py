"""Start the reverse proxy: ``nginx.conf`` rendered for where it runs, then nginx in this process's place.

The shipped configuration names the frontends of the Compose file (``frontend-1:8000``,
``frontend-2:8000``). Elsewhere ``PYGMY_PROXY_UPSTREAMS`` names them instead, as comma-separated
``host:port`` (Kubernetes: the ``frontend`` Service, ``frontend:8000``), and ``PYGMY_PROXY_LISTEN``
what to listen on (default ``8000``). nginx starts once every upstream's name resolves (at most
``PYGMY_PROXY_WAIT`` s, default 300). With ``PYGMY_TLS`` set, clients get HTTPS with the certificate
``PYGMY_PROXY_CERT`` (default ``proxy``: ``pygmy certs --only proxy --host NAME``) from
``PYGMY_CERTS_DIR``, and the frontends are reached over HTTPS, verified against ``ca.pem`` there,
showing ``client.pem``. nginx reads certificates at start: rotate them with a restart of the proxy. Standard library only: the proxy's image has no Pygmy in it.
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
_PASS = "proxy_pass http://frontends;\n"


def tls_lines(certs: str, server_cert: str) -> tuple[str, str]:
    """What the server block and the proxied location gain with TLS: clients get HTTPS with
    ``server_cert`` (its names are what clients dial), and the frontends are reached over HTTPS,
    verified against the cluster's CA, showing the ``client`` certificate (any outside caller's role)."""
    server = (f"        ssl_certificate {certs}/{server_cert}.pem;\n"
              f"        ssl_certificate_key {certs}/{server_cert}-key.pem;\n"
              "        ssl_protocols TLSv1.2 TLSv1.3;\n"
              "        ssl_session_cache shared:pygmy:10m;\n"
              "        # Plain HTTP on this port: refused, as JSON.\n"
              "        error_page 497 = @bad_request;\n")
    location = ("            proxy_ssl_trusted_certificate " + certs + "/ca.pem;\n"
                "            proxy_ssl_verify on;\n"
                "            proxy_ssl_verify_depth 2;\n"
                "            # Every certificate of the cluster's CA names localhost; the CA is what is checked.\n"
                "            proxy_ssl_name localhost;\n"
                "            proxy_ssl_session_reuse on;\n"
                f"            proxy_ssl_certificate {certs}/client.pem;\n"
                f"            proxy_ssl_certificate_key {certs}/client-key.pem;\n")
    return server, location


def render(text: str, upstreams: list[str] | None = None, listen: str | None = None,
           run_dir: str | None = None, as_root: bool = False, certs: str | None = None,
           server_cert: str = "proxy") -> str:
    """``text`` (the shipped ``nginx.conf``) with other upstream servers, another listen address,
    its writable paths under ``run_dir`` instead of ``/tmp``, and with ``certs`` (a folder made by
    ``pygmy certs``) TLS on both sides: HTTPS to clients, HTTPS with the CA to the frontends."""
    servers = list(_SERVER.finditer(text))
    if len(servers) < 1:
        raise ValueError("the configuration names no upstream server")
    if upstreams:
        if any(not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+:\d+", u) for u in upstreams):
            raise ValueError(f"PYGMY_PROXY_UPSTREAMS must be host:port, ... (got {upstreams})")
        first = servers[0]
        lines = "".join(f"{first['indent']}server {u}{first['params']};\n" for u in upstreams)
        text = text[:first.start()] + lines + _SERVER.sub("", text[first.end():])
    if run_dir:  # before the TLS lines: the certificates' folder may be under /tmp
        text = text.replace("/tmp/", f"{run_dir.rstrip('/')}/")
    if listen or certs:
        if _LISTEN not in text:
            raise ValueError(f"the configuration does not say {_LISTEN!r}")
        address = listen or "8000 reuseport"
        if certs:
            server, location = tls_lines(certs.rstrip("/"), server_cert)
            text = text.replace(_LISTEN, f"listen {address} ssl;\n" + server)
            if _PASS not in text:
                raise ValueError(f"the configuration does not say {_PASS!r}")
            text = text.replace(_PASS, "proxy_pass https://frontends;\n" + location)
        else:
            text = text.replace(_LISTEN, f"listen {address};")
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
    tls = os.environ.get("PYGMY_TLS", "").strip().lower() in ("1", "true", "yes", "on")
    certs = os.environ.get("PYGMY_CERTS_DIR", "/certs") if tls else None
    out = Path("/tmp/pygmy-nginx.conf")
    try:
        text = render(conf.read_text(), upstreams, listen, certs=certs,
                      server_cert=os.environ.get("PYGMY_PROXY_CERT", "proxy"))
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
