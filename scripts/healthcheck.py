"""Container HEALTHCHECK: GET /health on this service's port; exit 0 on 200, else 1. Standard library only.

With ``PYGMY_TLS`` set, over HTTPS: trusting ``ca.pem`` in ``PYGMY_CERTS_DIR`` and showing the
service's own certificate from there (the one ``<name>.pem`` with its key beside the CA's: a
replica takes callers of its own tier), as a container is handed just its own (docker-compose.tls.yml).
"""

import os
import ssl
import sys
import urllib.request
from pathlib import Path


def tls_context(folder: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(folder / "ca.pem"))
    ctx.check_hostname = False  # 127.0.0.1 is in every certificate, but the name we dial is not the point
    own = sorted(p for p in folder.glob("*.pem") if not p.name.endswith("-key.pem") and p.name != "ca.pem"
                 and (folder / f"{p.stem}-key.pem").exists())
    if own:
        ctx.load_cert_chain(str(own[0]), str(folder / f"{own[0].stem}-key.pem"))
    return ctx


def main() -> int:
    port = os.environ.get("PYGMY_PORT", "8000")
    tls = os.environ.get("PYGMY_TLS", "").strip().lower() in ("1", "true", "yes", "on")
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/health"
    try:
        context = tls_context(Path(os.environ.get("PYGMY_CERTS_DIR", "/certs"))) if tls else None
        with urllib.request.urlopen(url, timeout=2.5, context=context) as resp:
            return 0 if resp.status == 200 else 1
    except Exception as exc:  # HTTPError (503), connection refused, timeout, a handshake refused
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
