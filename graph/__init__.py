"""Pipeline specs: the YAML format, its validation, and the typed PipelineSpec it produces."""

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
