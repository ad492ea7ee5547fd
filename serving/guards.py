"""Checks every request passes before any route sees it: the Host header and the body size.

Host (DNS rebinding): a web page can make the user's browser send requests to a name that
resolves to 127.0.0.1; the browser then sends that name as Host. A server bound to loopback
therefore answers only Host values that are loopback names or addresses (`localhost`,
`*.localhost`, `127.x.x.x`, `[::1]`) or listed with `--allowed-host`; others get 421
`host_not_allowed`. A request without a Host header (HTTP/1.0 tools) passes: browsers always
send one.

Body size: a Content-Length above the limit is answered 413 `body_too_large` before the body
is read; a body without a length (chunked) is counted while the route reads it, and the read
fails with the same 413 as soon as it passes the limit.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Iterable

from omnistage.serving.cli import DEFAULT_MAX_BODY_BYTES
from omnistage.serving.errors import body_too_large_message, error_body

__all__ = ["DEFAULT_MAX_BODY_BYTES", "HostPolicy", "RequestGuard", "host_name", "is_loopback"]

log = logging.getLogger("omnistage.serving")

LOOPBACK_NAMES = ("localhost",)


def host_name(host_header: str) -> str:
    """`Example.com:8000` -> `example.com`; `[::1]:8000` -> `::1`."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def is_loopback(name: str) -> bool:
    """A loopback address or a name that always resolves to one (RFC 6761 `.localhost`);
    `name` without a port (`::1`, `127.0.0.1`, `localhost`)."""
    name = name.strip("[]").lower()
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HostPolicy:
    """Which Host values a server answers. `None` from `for_bind` means: any."""

    def __init__(self, allowed: Iterable[str] = ()):
        self.allowed = tuple(host_name(a) for a in allowed if a.strip())  # a port given with a name is ignored

    @classmethod
    def for_bind(cls, bind_host: str, allowed: Iterable[str] = ()) -> HostPolicy | None:
        allowed = list(allowed)
        if is_loopback(bind_host) or allowed:
            return cls(allowed)
        return None

    def permits(self, host_header: str) -> bool:
        name = host_name(host_header)
        if is_loopback(name):
            return True
        for pattern in self.allowed:
            if pattern == "*" or name == pattern:
                return True
            if pattern.startswith("*.") and name.endswith(pattern[1:]):
                return True
        return False


class RequestGuard:
    """Pure ASGI middleware applying the Host policy and the Content-Length limit."""

    def __init__(self, app, host_policy: HostPolicy | None, max_body_bytes: int | None):
        self.app = app
        self.host_policy = host_policy
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        host = headers.get(b"host")
        if self.host_policy is not None and host is not None:
            text = host.decode("latin-1")
            if not self.host_policy.permits(text):
                log.warning("refused a request for Host %r (not a loopback name; see --allowed-host)", text[:100])
                message = (
                    f"Host {text[:100]!r} is not served here: this server is bound to a loopback address and "
                    "answers only loopback names and the hosts given with --allowed-host."
                )
                return await _reject(kind, send, 421, "host_not_allowed", message, param="Host")
        length = headers.get(b"content-length")
        if kind == "http" and self.max_body_bytes is not None and length is not None:
            try:
                size = int(length)
            except ValueError:
                size = -1
            if size < 0:
                return await _reject(kind, send, 400, "invalid_content_length", "Content-Length is not a number")
            if size > self.max_body_bytes:
                return await _reject(kind, send, 413, "body_too_large", body_too_large_message(self.max_body_bytes))
        elif kind == "http" and self.max_body_bytes is not None:
            receive = _counting_receive(receive, self.max_body_bytes)
        return await self.app(scope, receive, send)


def _counting_receive(receive, limit: int):
    """receive() for a body without Content-Length: raises 413 once more than `limit` bytes
    arrived, inside the route's body read, so the error handlers answer it as JSON."""
    from starlette.exceptions import HTTPException

    received = 0

    async def wrapped():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise HTTPException(413, body_too_large_message(limit))
        return message

    return wrapped


async def _reject(kind: str, send, status: int, code: str, message: str, param: str | None = None) -> None:
    if kind == "websocket":
        # before the handshake is accepted, a close is answered as HTTP 403 by the server
        await send({"type": "websocket.close", "code": 1008, "reason": code})
        return
    body = json.dumps(error_body(message, status=status, code=code, param=param)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
