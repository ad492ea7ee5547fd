"""What every OpenAI-shaped route shares: the pipeline a `model` names and the `serves:` entry
for the route's API family, the routing of API fields to the stages that declare them, and
refusals with the offending field named."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from omnistage.errors import InvalidRequestError
from omnistage.graph.serves import FAMILIES
from omnistage.serving.deps import get_registry
from omnistage.serving.errors import ModelNotFoundError


class UnsupportedError(InvalidRequestError):
    """A field or value the pipeline cannot honour (400, naming the field)."""

    code = "unsupported_value"


class ModelNotServingError(InvalidRequestError):
    code = "model_not_supported"


def invalid(message: str, param: str | None, code: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


@dataclass
class Served:
    """A ready pipeline and how it serves one API family."""

    name: str
    pipeline: Any  # omnistage.runtime.pipeline.Pipeline
    serve: Any  # omnistage.graph.serves.ServeSpec

    @property
    def spec(self) -> Any:
        return self.pipeline.spec

    def port(self, role: str) -> str | None:
        return self.serve.port(role)

    def stage_params(self, fields: dict[str, Any], stages: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """Each `params:` stage (or each of `stages`) gets the fields its kind declares as
        per-request params. A field no listed stage takes is refused, naming it."""
        from omnistage.stages.params import stage_request_params

        out: dict[str, dict[str, Any]] = {}
        taken: set[str] = set()
        for stage in self.serve.params if stages is None else stages:
            declared = stage_request_params(self.spec.stages[stage])
            mine = {k: v for k, v in fields.items() if k in declared}
            taken |= set(mine)
            if mine:
                out[stage] = mine
        for key in fields:
            if key not in taken:
                raise UnsupportedError(f"the pipeline {self.name!r} does not take {key!r}", param=key)
        return out


def served_pipeline(request: Request, model: str, family: str) -> Served:
    """The ready pipeline named `model` if it serves `family`: 404 model_not_found for an
    unknown name, 400 model_not_supported for one that does not serve this API."""
    registry = get_registry(request)
    entry = registry.entry(model)
    if entry is None:
        raise ModelNotFoundError(model, registry.names())
    spec = entry.effective_spec
    serves = getattr(spec, "serves", None) or {}
    if family not in serves:
        takers = [e.name for e in registry.entries() if family in (getattr(e.spec, "serves", None) or {})]
        raise ModelNotServingError(
            f"the model {model!r} does not serve the {family} API (models that do: {', '.join(takers) or 'none'})",
            param="model",
        )
    # a stage's error naming its `prompt` is reported under the field the route built it from
    request.state.prompt_field = FAMILIES[family].prompt_field
    return Served(model, registry.get(model), serves[family])


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
