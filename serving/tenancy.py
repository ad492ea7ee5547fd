"""Per-key prefix-cache salt: with API keys configured, one key's prompts never reuse the KV
blocks another key's prompts filled.

A shared prefix cache answers a repeated prefix faster and reports it as `cached_tokens`;
across tenants that is a side channel (a key could time prompts to learn what another key
sent). Every stage that takes `cache_salt` gets the digest of the request's key (never the key
itself), joined with any salt the request asked for, on every route that runs a pipeline:
chat, completions, `/v1/pipelines/{name}/run` and jobs. An open server (no keys) adds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from starlette.requests import HTTPConnection

from omnistage.serving.jobs.owners import owner_of


def salted(
    spec: Any, params: dict[str, dict[str, Any]], owner: str | None, stages: Iterable[str] | None = None
) -> dict[str, dict[str, Any]]:
    """A copy of `params` in which each of `stages` (default: all of `spec`'s) that takes
    `cache_salt` has it prefixed by `owner`; `params` itself when `owner` is None."""
    from omnistage.stages.params import stage_request_params

    if owner is None:
        return params
    out = {stage: dict(values) if isinstance(values, dict) else values for stage, values in params.items()}
    for stage in spec.stages if stages is None else stages:
        if "cache_salt" not in stage_request_params(spec.stages[stage]):
            continue
        mine = out.setdefault(stage, {})
        if not isinstance(mine, dict):
            continue  # malformed params: the pipeline refuses them with a 400 naming the stage
        asked = mine.get("cache_salt")
        mine["cache_salt"] = owner if asked is None else f"{owner}:{asked}"
    return out


def salt_by_key(
    connection: HTTPConnection, served: Any, params: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """`params` salted for the connection's key on the stages a served (OpenAI-style) pipeline
    passes request params to."""
    return salted(served.spec, params, owner_of(connection), served.serve.params)
