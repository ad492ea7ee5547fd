"""The base of the OpenAI-shaped request bodies.

Unknown fields are refused (a misspelt parameter is a 400 naming it, not silently ignored),
and an explicit `null` for an optional field that has a default means that default: OpenAI's
API reference marks such fields nullable (`"n": null`, `"stream": null`), and clients built on
it (LiteLLM, LangChain) send them so.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            defaulted = _defaulted_not_nullable(cls)
            if any(data.get(key, 0) is None for key in defaulted):
                data = {key: value for key, value in data.items() if value is not None or key not in defaulted}
        return data


@functools.cache
def _defaulted_not_nullable(model: type[BaseModel]) -> frozenset[str]:
    """The body keys of `model`'s fields that have a default and whose type refuses None."""
    keys = set()
    for name, field in model.model_fields.items():
        if field.is_required() or _accepts_none(field.annotation):
            continue
        keys.add(field.alias or name)
    return frozenset(keys)


def _accepts_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(_accepts_none(arg) for arg in typing.get_args(annotation))
    return False
