"""The Pygmy client library: one pooled HTTP session, timeouts, errors that carry the JSON body.

Used by the ``pygmy`` command line, the tests, the load generator and the experiments.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import requests
from requests.adapters import HTTPAdapter

DEFAULT_URL = "http://127.0.0.1:8000"


class PygmyError(Exception):
    """An error answer (``status`` and ``message`` from the JSON body) or a transport failure (status 0)."""

    def __init__(self, status: int, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status, self.message, self.body = status, message, body or {}


class PygmyClient:
    def __init__(self, url: str = DEFAULT_URL, timeout: float = 10.0, token: str | None = None,
                 pool: int = 16) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.token = token
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=2, pool_maxsize=pool, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> PygmyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            resp = self.session.request(method, self.url + path, timeout=(2.0, self.timeout), **kw)
        except requests.RequestException as exc:
            raise PygmyError(0, f"cannot reach {self.url}: {type(exc).__name__}: {exc}") from exc
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code >= 400:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            raise PygmyError(resp.status_code, err.get("message") or resp.reason or "error", body)
        return body

    # -- the public API -----------------------------------------------------------------------------
    def search(self, topic: str) -> dict[str, Any]:
        return self.request("GET", f"/search/{quote(topic, safe='')}")

    def lookup(self, item: int | str) -> dict[str, Any]:
        return self.request("GET", f"/lookup/{item}")

    def buy(self, item: int | str, quantity: int | None = None, key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": key} if key else {}
        body = {"quantity": quantity} if quantity is not None else None
        return self.request("POST", f"/buy/{item}", json=body, headers=headers)

    def order(self, number: int | str) -> dict[str, Any]:
        return self.request("GET", f"/orders/{number}")

    def update(self, item: int | str, stock_delta: int | None = None, cost: float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if stock_delta is not None:
            body["stock_delta"] = stock_delta
        if cost is not None:
            body["cost"] = cost
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return self.request("POST", f"/update/{item}", json=body, headers=headers)

    def status(self) -> dict[str, Any]:
        return self.request("GET", "/status")

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/health")
