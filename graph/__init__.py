"""Pipeline specs: the YAML format, its validation, and the typed PipelineSpec it produces.

`load_pipeline` / `PipelineValidationError` are re-exported lazily: importing the spec
dataclasses stays light (validation imports the stage registry, and with it torch).
"""

from omnistage.graph.spec import (  # noqa: F401
    BatchingSpec,
    EdgeSpec,
    Endpoint,
    ModelRef,
    PipelineSpec,
    PoolSpec,
    SourcePos,
    StageSpec,
    StreamSpec,
)

_LAZY = {"load_pipeline": "omnistage.graph.loader", "PipelineValidationError": "omnistage.graph.loader"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'omnistage.graph' has no attribute {name!r}")
