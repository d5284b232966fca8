"""Requests pipelined on one connection straight to a frontend (#39): each is answered, in order,
whichever way it takes through the worker (a cached lookup from the event loop, a search or a miss
on a pool thread), and none is left hanging behind another."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

from harness import Cluster, http_answers


def test_pipelined_lookups_and_searches_are_answered_in_order(cluster: Cluster) -> None:
    host, port = urlsplit(cluster.url).hostname, urlsplit(cluster.url).port
    assert host and port
    paths = ["/lookup/1", "/search/distributed%20systems", "/lookup/2", "/lookup/1", "/lookup/3",
             "/search/graduate%20school", "/lookup/99999"]
    for _ in range(3):  # the first round misses the cache, later ones hit it
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(b"".join(f"GET {p} HTTP/1.1\r\nHost: t\r\nX-Request-Id: pipe-{i}\r\n\r\n".encode()
                                  for i, p in enumerate(paths)))
            for i, (path, (status, headers, body)) in enumerate(zip(paths, http_answers(sock, len(paths)), strict=True)):
                answer = json.loads(body)
                assert headers["x-request-id"] == f"pipe-{i}", (path, headers)
                if path == "/lookup/99999":
                    assert status == 404
                elif path.startswith("/lookup/"):
                    assert status == 200 and answer["item_number"] == int(path.rsplit("/", 1)[1]), answer
                else:
                    assert status == 200 and "items" in answer, answer
