"""The Pygmy client library: one pooled HTTP session, timeouts, errors that carry the JSON body.

Used by the ``pygmy`` command line, the tests, the load generator and the experiments. Every
request tells the server how long it will wait (``X-Request-Timeout-Ms``), so no tier works on
after it has gone. With ``retries``, requests that are safe to repeat (reads, and buys with an
``Idempotency-Key``) are retried after a 503 or no answer, with jittered exponential backoff,
never sooner than ``Retry-After`` says, and within a retry budget (``pygmy/kit/retry.py``).
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

import requests
from requests.adapters import HTTPAdapter

from pygmy.kit.retry import DEADLINE_HEADER, RetryBudget, backoff, retry_after, says_overloaded

DEFAULT_URL = "http://127.0.0.1:8000"


class PygmyError(Exception):
    """An error answer (``status`` and ``message`` from the JSON body) or a transport failure (status 0)."""

    def __init__(self, status: int, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status, self.message, self.body = status, message, body or {}
        self.retry_after: float | None = None  # seconds, from the answer's Retry-After


def overloaded(exc: PygmyError) -> bool:
    """Refused at once, nothing done (``pygmy.kit.retry.says_overloaded``)."""
    return says_overloaded(exc.status, exc.body)


class PygmyClient:
    def __init__(self, url: str = DEFAULT_URL, timeout: float = 10.0, token: str | None = None,
                 pool: int = 16, retries: int = 0, budget: RetryBudget | None = None,
                 verify: bool | str = True, cert: str | tuple[str, str] | None = None) -> None:
        """``verify``: the CA file an ``https://`` frontend's certificate must come from (a
        cluster's ``certs/ca.pem``; True: the system's); ``cert``: a client certificate to show."""
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.token = token
        self.retries = retries
        self.budget = budget or RetryBudget()
        self.session = requests.Session()
        # Per request, not on the session: Requests lets REQUESTS_CA_BUNDLE override a session's ``verify``.
        self._tls: dict[str, Any] = {"verify": verify, "cert": cert} if verify is not True or cert else {}
        adapter = HTTPAdapter(pool_connections=2, pool_maxsize=pool, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> PygmyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, *, retry: bool | None = None, **kw: Any) -> Any:
        """One call within ``timeout`` seconds in all. ``retry`` (default: for GET) allows retries."""
        deadline = time.monotonic() + self.timeout
        may_retry = method == "GET" if retry is None else retry
        self.budget.request()
        attempt = 0
        unsure = False  # an earlier attempt may have done the work
        while True:
            try:
                return self._once(method, path, deadline, **kw)
            except PygmyError as exc:
                attempt += 1
                if unsure and overloaded(exc):
                    # "Overloaded" says nothing was done: true of this attempt, not of an earlier one.
                    exc.body = {**exc.body, "error": {k: v for k, v in exc.body["error"].items() if k != "overloaded"}}
                    exc.message += " (an earlier attempt's outcome is unknown: retry with the same key)"
                    exc.args = (f"{exc.status}: {exc.message}",)
                unsure = unsure or (exc.status in (0, 503) and not overloaded(exc))
                if not (may_retry and exc.status in (0, 503) and attempt <= self.retries):
                    raise
                wait = max(exc.retry_after or 0.0, backoff(attempt, base=0.1, cap=2.0))
                if time.monotonic() + wait >= deadline or not self.budget.try_retry():
                    raise
                time.sleep(wait)

    def _once(self, method: str, path: str, deadline: float, **kw: Any) -> Any:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PygmyError(0, f"no answer from {self.url} within {self.timeout:g} s")
        headers = {**kw.pop("headers", {}), DEADLINE_HEADER: str(max(1, int(left * 1000)))}
        try:
            resp = self.session.request(method, self.url + path, timeout=(min(2.0, left), left), headers=headers,
                                        **self._tls, **kw)
        except requests.RequestException as exc:
            raise PygmyError(0, f"cannot reach {self.url}: {type(exc).__name__}: {exc}") from exc
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code >= 400:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            error = PygmyError(resp.status_code, err.get("message") or resp.reason or "error", body)
            error.retry_after = retry_after(resp.headers.get("Retry-After"))
            raise error
        return body

    # -- the public API -----------------------------------------------------------------------------
    def search(self, topic: str, limit: int | None = None, next: str | None = None) -> dict[str, Any]:
        """A page of a topic's books; pass the answer's ``next`` back for the following page."""
        params = {k: v for k, v in (("limit", limit), ("next", next)) if v is not None}
        return self.request("GET", f"/search/{quote(topic, safe='')}", params=params or None)

    def lookup(self, item: int | str) -> dict[str, Any]:
        return self.request("GET", f"/lookup/{item}")

    def buy(self, item: int | str, quantity: int | None = None, key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": key} if key else {}
        body = {"quantity": quantity} if quantity is not None else None
        # Safe to repeat only under a key: the same key never buys twice.
        return self.request("POST", f"/buy/{item}", json=body, headers=headers, retry=key is not None)

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
