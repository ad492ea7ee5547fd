"""Optional API keys: `Authorization: Bearer KEY` on every route but the probes, and a limit on
the requests one key may have in flight.

Keys come from `omnistage serve --api-key KEY` (repeatable) and the OMNISTAGE_API_KEYS
environment variable (comma-separated). With no keys the server is open, as before. A missing
or unknown key is answered 401 `invalid_api_key` (OpenAI's shape); a key already running
`max_concurrent` requests gets 429 `concurrency_limit_exceeded` with `Retry-After`. A streamed
response counts until its last byte is sent, a websocket until it closes. A websocket may
also carry the key as `?api_key=KEY` or the `openai-insecure-api-key.KEY` subprotocol (what
browsers can send).
"""

from __future__ import annotations

import hmac
import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from omnistage.serving.errors import error_body

KEYS_ENV = "OMNISTAGE_API_KEYS"
OPEN_PATHS = ("/health", "/ready", "/")  # probes carry no credentials; "/" is the demo page
OPEN_PREFIXES = ("/static/",)  # the demo page's files (no data; the page sends the key itself)
RETRY_AFTER_S = 1
WS_KEY_PROTOCOL = "openai-insecure-api-key."


@dataclass(frozen=True)
class ApiKeyPolicy:
    keys: tuple[str, ...]
    max_concurrent: int | None = None  # per key; None: no limit

    @classmethod
    def from_sources(
        cls, keys: Iterable[str] = (), max_concurrent: int | None = None, environ=os.environ
    ) -> ApiKeyPolicy | None:
        """The policy from `--api-key` values and OMNISTAGE_API_KEYS; None when no key is set."""
        found = [k.strip() for k in keys if k.strip()]
        found += [k.strip() for k in environ.get(KEYS_ENV, "").split(",") if k.strip()]
        if not found:
            return None
        return cls(tuple(dict.fromkeys(found)), max_concurrent)

    def match(self, presented: str) -> str | None:
        """The configured key equal to `presented` (compared in constant time), else None."""
        hit = None
        for key in self.keys:
            if hmac.compare_digest(key.encode(), presented.encode()):
                hit = key
        return hit


class ApiKeyGuard:
    """Pure ASGI middleware enforcing an ApiKeyPolicy."""

    def __init__(self, app, policy: ApiKeyPolicy):
        self.app = app
        self.policy = policy
        self.in_flight: Counter[str] = Counter()

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        path = scope.get("path", "")
        if kind not in ("http", "websocket") or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        key = self.policy.match(token.strip()) if scheme.lower() == "bearer" else None
        if key is None and kind == "websocket":  # browsers cannot set headers on a websocket
            auth = auth or _websocket_key(scope)
            key = self.policy.match(_websocket_key(scope))
        if key is None:
            message = (
                "Missing API key: send Authorization: Bearer YOUR_KEY."
                if not auth
                else "Incorrect API key provided (expected Authorization: Bearer YOUR_KEY)."
            )
            return await _reject(kind, send, 401, "invalid_api_key", message, {"www-authenticate": "Bearer"})
        limit = self.policy.max_concurrent
        if limit is not None and self.in_flight[key] >= limit:
            message = f"This API key already has {limit} requests in flight (the per-key limit); retry later."
            headers = {"retry-after": str(RETRY_AFTER_S)}
            return await _reject(kind, send, 429, "concurrency_limit_exceeded", message, headers)
        scope.setdefault("state", {})["api_key"] = key  # per-key limits further in (realtime sessions)
        self.in_flight[key] += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.in_flight[key] -= 1


def _websocket_key(scope) -> str:
    """The key a browser's websocket carries: `?api_key=` or the `openai-insecure-api-key.KEY` subprotocol."""
    from urllib.parse import parse_qs

    query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
    if query:
        return query[0]
    offered = dict(scope.get("headers") or ()).get(b"sec-websocket-protocol", b"").decode("latin-1")
    for proto in offered.split(","):
        if proto.strip().startswith(WS_KEY_PROTOCOL):
            return proto.strip()[len(WS_KEY_PROTOCOL) :]
    return ""


async def _reject(kind: str, send, status: int, code: str, message: str, headers: dict[str, str]) -> None:
    if kind == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": code})
        return
    body = json.dumps(error_body(message, status=status, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
