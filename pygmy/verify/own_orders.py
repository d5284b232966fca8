"""Read-your-writes for orders: ``GET /orders/N`` right after the buy that returned N (#16).

Each try buys through one frontend and at once reads the order back through the other, each on a
fresh connection so every Gunicorn worker takes part. Every read must answer 200 with the order.

``python -m pygmy.verify.own_orders --tries 10000`` runs it on a fresh local cluster of 2 frontends
x 2 workers and prints the count of reads that did not find their order (0 is the only good answer).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import requests


def own_order_reads(urls: list[str], tries: int, threads: int = 4, items: int = 7) -> list[str]:
    """Run ``tries`` buy-then-read pairs over ``threads`` clients; returns every failure, described."""
    failures: list[str] = []
    counter = iter(range(tries))
    lock = threading.Lock()

    def client(k: int) -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            buy_url, read_url = urls[i % len(urls)], urls[(i + 1) % len(urls)]
            item = 1 + i % items
            try:
                r = requests.post(f"{buy_url}/buy/{item}", json={"quantity": 1}, timeout=10,
                                  headers={"Idempotency-Key": f"own-{uuid.uuid4().hex}", "Connection": "close"})
                if r.status_code != 200:
                    failures.append(f"buy {item} via {buy_url}: {r.status_code} {r.text[:120]}")
                    continue
                n = r.json()["order_number"]
                g = requests.get(f"{read_url}/orders/{n}", timeout=10, headers={"Connection": "close"})
            except requests.RequestException as exc:
                failures.append(f"try {i}: {type(exc).__name__}: {exc}")
                continue
            if g.status_code != 200 or g.json().get("order_number") != n:
                failures.append(f"order {n} bought via {buy_url}, read via {read_url} "
                                f"({g.headers.get('X-Served-By', '')}): {g.status_code} {g.text[:120]}")

    workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return failures


def main(argv: list[str] | None = None) -> int:
    from pygmy.catalog.books import synthetic
    from pygmy.cluster.local import LocalCluster, free_port_base

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=10_000)
    p.add_argument("--threads", type=int, default=4)
    args = p.parse_args(argv)
    base = free_port_base()
    with tempfile.TemporaryDirectory(prefix="pygmy-own-") as data:
        # Stock for every try: 7 books x 1000 copies would run out before 10,000 buys.
        books = Path(data) / "books.json"
        books.write_text(json.dumps({"books": synthetic(7, topics=2, stock=args.tries + 1000)}))
        c = LocalCluster(Path(data) / "d", base, ["--frontends", "2", "--frontend-workers", "2",
                                                 "--books", str(books)]).start(reset=True)
        try:
            failures = own_order_reads([c.url, f"http://127.0.0.1:{base + 1}"], args.tries, args.threads)
        finally:
            c.stop()
    print(f"{args.tries - len(failures)} of {args.tries} orders read back at once; {len(failures)} not")
    for f in failures[:20]:
        print("  " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
