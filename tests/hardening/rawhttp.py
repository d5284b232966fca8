"""Raw HTTP over a socket: for requests ``requests`` refuses to send (bad bytes, huge lines)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse


@dataclass
class RawReply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def send(url: str, head: bytes, body: bytes = b"", timeout: float = 10.0) -> RawReply:
    """Send ``head`` (request line and headers, no final blank line) and ``body``; read one answer."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        extra = b"Host: %s:%d\r\nConnection: close\r\n" % (u.hostname.encode(), u.port)
        if body:
            extra += b"Content-Length: %d\r\n" % len(body)
        s.sendall(head.rstrip(b"\r\n") + b"\r\n" + extra + b"\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    raw_head, _, rest = data.partition(b"\r\n\r\n")
    lines = raw_head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", len(rest)))
    return RawReply(status, headers, rest[:length])
