"""Per-key prefix-cache salt: with API keys configured, one key's prompts never reuse the KV
blocks another key's prompts filled.

A shared prefix cache answers a repeated prefix faster and reports it as `cached_tokens`;
across tenants that is a side channel (a key could time prompts to learn what another key
sent). Every stage a served pipeline passes request params to that takes `cache_salt` gets
the digest of the request's key (never the key itself), joined with any salt the request
asked for. An open server (no keys) adds nothing.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import HTTPConnection

from omnistage.serving.jobs.owners import owner_of


def salt_by_key(
    connection: HTTPConnection, served: Any, params: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """`params` with each cache-salted stage's `cache_salt` prefixed by the key's digest."""
    from omnistage.stages.params import kind_params

    owner = owner_of(connection)
    if owner is None:
        return params
    for stage in served.serve.params:
        if "cache_salt" not in kind_params(served.spec.stages[stage].kind).request:
            continue
        mine = params.setdefault(stage, {})
        asked = mine.get("cache_salt")
        mine["cache_salt"] = owner if asked is None else f"{owner}:{asked}"
    return params
