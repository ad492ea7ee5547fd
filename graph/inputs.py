"""Shape and dtype declarations of a pipeline's tensor inputs, and their check at admission.

A pipeline input may be declared with a shape and dtype instead of a bare type:

    inputs:
      x: {type: tensor, shape: [null, 8], dtype: float32}   # any number of rows of 8

`shape` lists one entry per dimension: an integer fixes that dimension, null leaves it free.
The runtime checks such inputs when a request is admitted (`check_inputs`), so a wrong
shape is refused with an InvalidRequestError naming `inputs.PORT` (HTTP 400) before any
stage sees it, instead of failing inside a stage's module.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnistage.errors import InvalidRequestError
from omnistage.graph.checks import Report, did_you_mean
from omnistage.graph.nodes import MapNode, ScalarNode, SeqNode, describe

TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
PORT_KEYS = ("type", "shape", "dtype")


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor input must look like; None leaves that part free."""

    shape: tuple[int | None, ...] | None = None
    dtype: str | None = None

    def describe(self) -> str:
        parts = []
        if self.shape is not None:
            parts.append("[" + ", ".join("*" if d is None else str(d) for d in self.shape) + "]")
        if self.dtype is not None:
            parts.append(self.dtype)
        return " ".join(parts)

    def problem(self, value: Any) -> str | None:
        """Why `value` does not match (a sentence fragment), or None when it does."""
        shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
        if type(value).__module__ == "numpy":  # has a shape and a dtype, but stages take torch's
            return f"must be a torch tensor {self.describe()}, got a numpy array (torch.from_numpy makes one, no copy)"
        if shape is None or dtype is None:
            return f"must be a tensor {self.describe()}, got {type(value).__name__}"
        got = tuple(int(d) for d in shape)
        if self.shape is not None and (
            len(got) != len(self.shape) or any(want is not None and want != d for want, d in zip(self.shape, got))
        ):
            want = TensorSpec(shape=self.shape).describe()
            return f"must have shape {want}, got shape [{', '.join(map(str, got))}]"
        if self.shape is not None and 0 in got:  # a declared shape's free sizes are 1 or more
            return f"must not be empty, got shape [{', '.join(map(str, got))}]"
        name = str(dtype).removeprefix("torch.")
        if self.dtype is not None and name != self.dtype:
            return f"must have dtype {self.dtype}, got {name}"
        return None


def check_inputs(spec: Any, inputs: Mapping[str, Any]) -> None:
    """Refuse a request whose declared tensor inputs do not match (InvalidRequestError,
    param `inputs.PORT`). Inputs without a declaration pass unchecked."""
    for port, tensor_spec in spec.input_tensors.items():
        if port in inputs:
            problem = tensor_spec.problem(inputs[port])
            if problem is not None:
                raise InvalidRequestError(f"input {port!r} {problem}", param=f"inputs.{port}")


def check_params(spec: Any, params: Mapping[str, Any], *, queued: bool = False) -> None:
    """Refuse per-request params for unknown stages, a stage's params that are not a dict,
    and what its stage kind's declaration refuses (an unknown key, a value out of range, a
    rule across values; over the stage's YAML request_defaults, as the stage sees them):
    InvalidRequestError naming the stage and the key. The stage checks again with what only it
    knows (an instance's narrower set, its model's limits); this part any process can answer at
    once, so a job with bad params is refused when it is submitted instead of failing later.

    queued: also each kind's own checks from the stage's spec and checkpoint files
    (StageEngine.check_queued; e.g. a size beyond what the diffusion model covers), for a queue
    in front of a ready pipeline (the jobs API, a realtime session's settings)."""
    from omnistage.stages.registry import get_stage_class

    bad = set(params) - set(spec.stages)
    if bad:
        raise InvalidRequestError(
            f"params for unknown stage(s) {sorted(bad)}; stages are {sorted(spec.stages)}", param="params"
        )
    for stage, values in params.items():
        if not isinstance(values, Mapping):
            raise InvalidRequestError(
                f"params for stage {stage!r} must be an object {{name: value}}, got {type(values).__name__}",
                param=f"params.{stage}",
            )
        if not all(isinstance(key, str) and key for key in values):
            raise InvalidRequestError(
                f"params for stage {stage!r}: every parameter name must be a non-empty string", param=f"params.{stage}"
            )
        try:
            kind = get_stage_class(spec.stages[stage].kind)
        except KeyError:  # a kind registered only in the workers (a built object): they check
            continue
        merged = {**(spec.stages[stage].request_defaults or {}), **values}
        try:
            kind.request_params_for(spec.stages[stage].params or {}).validate(merged)
            if queued:
                kind.check_queued(spec.stages[stage], merged)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"stage {stage!r}: {exc}", param=exc.param) from None


def check_request(
    spec: Any, inputs: Any, params: dict[str, dict] | None, deadline: float | None
) -> tuple[dict[str, dict], float | None]:
    """The admission checks every runtime backend makes before a request touches a stage:
    inputs a dict of known ports (none missing when the pipeline has inputs) with their
    declared shapes, params only for known stages. Returns the params as a new dict and the
    deadline, defaulted from the pipeline's `default_deadline_s`."""
    if not isinstance(inputs, dict):
        raise InvalidRequestError("inputs must be a dict {pipeline input port: value}")
    unknown = set(inputs) - set(spec.inputs)
    if unknown:
        raise InvalidRequestError(f"unknown pipeline input(s) {sorted(unknown)}; inputs are {sorted(spec.inputs)}")
    if spec.inputs and not inputs:
        raise InvalidRequestError(f"no pipeline inputs given; inputs are {sorted(spec.inputs)}")
    check_inputs(spec, inputs)  # declared shapes/dtypes: 400 before any stage
    params = dict(params or {})
    check_params(spec, params)
    if deadline is None and spec.default_deadline_s:
        deadline = time.time() + spec.default_deadline_s
    return params, deadline


def parse_port(node: MapNode, where: str, report: Report, port_types: tuple[str, ...]) -> tuple[str, TensorSpec] | None:
    """A port written as {type, shape, dtype}: (type, TensorSpec), or None after reporting."""
    ok = True
    for key in node.entries:
        if key not in PORT_KEYS:
            report.add(node.key_pos[key], f"unknown key {key!r} in {where}{did_you_mean(key, PORT_KEYS)}")
            ok = False
    type_node = node.get("type")
    if not (isinstance(type_node, ScalarNode) and type_node.value in port_types):
        at = type_node.pos if type_node is not None else node.pos
        got = describe(type_node) if type_node is not None else "nothing"
        value = type_node.value if isinstance(type_node, ScalarNode) else None
        hint = did_you_mean(value, port_types) if isinstance(value, str) else ""
        report.add(at, f"{where}.type must be a port type ({', '.join(port_types)}), got {got}{hint}")
        ok = False  # the shape and dtype are still checked: every problem at once
    shape = _shape(node.get("shape"), f"{where}.shape", report)
    dtype_node = node.get("dtype")
    dtype = None
    if dtype_node is not None:
        if isinstance(dtype_node, ScalarNode) and dtype_node.value in TENSOR_DTYPES:
            dtype = dtype_node.value
        else:
            value = dtype_node.value if isinstance(dtype_node, ScalarNode) else None
            hint = did_you_mean(value, TENSOR_DTYPES) if isinstance(value, str) else ""
            report.add(dtype_node.pos, f"{where}.dtype must be one of {', '.join(TENSOR_DTYPES)}{hint}")
            ok = False
    if shape is False or not ok:
        return None
    return type_node.value, TensorSpec(shape=shape, dtype=dtype)


def _shape(node: Any, where: str, report: Report) -> tuple[int | None, ...] | None | bool:
    """The declared shape, None when absent, False after reporting a problem."""
    if node is None:
        return None
    if not isinstance(node, SeqNode):
        report.add(node.pos, f"{where} must be a list of sizes (integers, or null for any), got {describe(node)}")
        return False
    dims: list[int | None] = []
    for item in node.items:
        value = item.value if isinstance(item, ScalarNode) else item
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            dims.append(value)
        else:
            report.add(item.pos, f"{where}: each size must be an integer >= 0 or null (any), got {describe(item)}")
            return False
    return tuple(dims)
