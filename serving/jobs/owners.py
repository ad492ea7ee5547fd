"""Who owns a job: the API key that submitted it, kept as a digest (never the key itself).

With API keys configured (serving/auth.py), every request carries a checked key and sees
only its own jobs: another key's job is answered 404 as if it did not exist. An open server
(no keys) has no owners: every client sees every job.
"""

from __future__ import annotations

import hashlib

from starlette.requests import HTTPConnection

from omnistage.serving.auth import ApiKeyGuard


def _keys_required(app) -> bool:
    cached = getattr(app.state, "jobs_keys_required", None)
    if cached is None:
        cached = any(m.cls is ApiKeyGuard for m in app.user_middleware)
        app.state.jobs_keys_required = cached
    return cached


def owner_of(connection: HTTPConnection) -> str | None:
    """The owner digest of a request or websocket, or None on an open server."""
    if not _keys_required(connection.app):
        return None
    # the key the guard checked: a header, or on a websocket ?api_key= / the subprotocol
    checked = (connection.scope.get("state") or {}).get("api_key")
    if checked:
        return "key_" + hashlib.sha256(checked.encode()).hexdigest()[:32]
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return "key_absent"  # unreachable behind the guard (401); matches no key's jobs
    return "key_" + hashlib.sha256(token.strip().encode()).hexdigest()[:32]
