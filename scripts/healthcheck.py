"""Container HEALTHCHECK: GET /health on this service's port; exit 0 on 200, else 1. Standard library only."""

import os
import sys
import urllib.request


def main() -> int:
    port = os.environ.get("PYGMY_PORT", "8000")
    url = f"http://127.0.0.1:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=2.5) as resp:
            return 0 if resp.status == 200 else 1
    except Exception as exc:  # HTTPError (503), connection refused, timeout
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
