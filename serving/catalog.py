"""What a hosted pipeline wants and gives, for GET /v1/pipelines and /v1/pipelines/{name}.

Built from the pipeline's spec alone (no worker is asked): its input and output ports with
their types, each stage's per-request params (the stage kind's declarations in
omnistage.stages.params: type, range, default) and an example request body.
"""

from __future__ import annotations

import logging
from typing import Any

from omnistage.graph.spec import PIPELINE_OUTPUTS
from omnistage.serving.media import FORMATS_BY_PORT_TYPE
from omnistage.stages.diffusion.limits import stage_limits

log = logging.getLogger("omnistage.serving")

# Example values by input port type; tensor inputs get zeros of their declared shape, and a
# pipeline with neither gets no example.
_EXAMPLE_BY_TYPE: dict[str, Any] = {"text": "Hello", "tokens": [1, 2, 3]}
_EXAMPLE_MESSAGES = [{"role": "user", "content": "Hello"}]


def request_params_of(stage: Any) -> tuple[list[dict[str, Any]], bool]:
    """(declared per-request params of a stage, whether undeclared keys are accepted)."""
    from omnistage.stages.params import stage_request_params

    try:
        request = stage_request_params(stage)
    except KeyError:  # a kind that is not registered (a pipeline added as a built object)
        return [], True
    return request.describe(), bool(request.open)


def _example_request(spec: Any) -> dict[str, Any] | None:
    # Prompt-like inputs are alternatives (prompt | messages | tokens): the first one is enough.
    for port, port_type in spec.inputs.items():
        if port_type == "json" and port == "messages":
            return {"inputs": {port: _EXAMPLE_MESSAGES}}
        if port_type in _EXAMPLE_BY_TYPE:
            return {"inputs": {port: _EXAMPLE_BY_TYPE[port_type]}}
    # Otherwise every tensor input whose shape is declared: zeros, free dimensions of 2.
    tensors = getattr(spec, "input_tensors", {})
    examples = {port: _zeros(tensors[port]) for port in spec.inputs if port in tensors}
    examples = {port: value for port, value in examples.items() if value is not None}
    return {"inputs": examples} if examples else None


def _zeros(tensor: Any) -> Any:
    if tensor.shape is None:
        return None
    zero: Any = 0 if (tensor.dtype or "float32").startswith(("int", "uint")) else 0.0
    value = zero
    for dim in reversed(tensor.shape):
        value = [value] * (2 if dim is None else dim)
    return value


def _outputs(spec: Any) -> dict[str, dict[str, Any]]:
    streamed = {e.dst.port for e in spec.in_edges(PIPELINE_OUTPUTS) if e.streaming}
    out = {}
    for port, port_type in spec.outputs.items():
        entry: dict[str, Any] = {"type": port_type, "streamed": port in streamed}
        formats = FORMATS_BY_PORT_TYPE.get(port_type)
        if formats:
            entry["formats"] = list(formats)
        out[port] = entry
    return out


def describe_pipeline(entry: Any, *, detail: bool = True) -> dict[str, Any]:
    """One pipeline's card; `detail` adds its stages' params and the example request."""
    spec = entry.effective_spec
    card: dict[str, Any] = {
        "id": entry.name,
        "object": "pipeline",
        "description": getattr(spec, "description", "") or "",
        "ready": entry.is_ready(),
        "state": entry.state,
    }
    if spec is None:
        return card
    card["inputs"] = {port: {"type": t} for port, t in spec.inputs.items()}
    for port, tensor in getattr(spec, "input_tensors", {}).items():  # declared shape/dtype (graph/inputs.py)
        card["inputs"][port].update(shape=None if tensor.shape is None else list(tensor.shape), dtype=tensor.dtype)
    card["outputs"] = _outputs(spec)
    if not detail:
        return card
    stages = {}
    for name, stage in spec.stages.items():
        params, open_ = request_params_of(stage)
        stages[name] = {"kind": stage.kind, "params": params, "accepts_undeclared_params": open_}
        limits = stage_limits(stage) if entry.is_ready() else None  # the checkpoint's defaults and range
        if limits is not None:
            stages[name]["model_limits"] = limits
    card["stages"] = stages
    card["example_request"] = _example_request(spec)
    return card
