"""Generic stage kinds that make test and glue graphs out of plain Python/torch callables.

`torch_module` params:
    factory: "pkg.module:callable"      builds an nn.Module (or any callable) in the worker
    kwargs: {...}                        passed to the factory
    inputs: {port: type}                 default {x: tensor}
    outputs: {port: type}                default {y: tensor}
    streaming_inputs: [port, ...]        ports that accept chunks (streaming edges)
    streaming_outputs: [port, ...]       ports emitted in several chunks
    batch: none | stack | list           how a dynamic batch calls the module:
        none   one call per request, `m(**inputs)` (default)
        stack  one call per batch, each port's tensors stacked on a new dim 0 (requests with
               different shapes go to different batches); outputs unbound along dim 0
        list   one call per batch, each port given a list of the requests' values; the module
               returns a list (or dict of lists) with one entry per request
    pass_params: bool                    call `m(**inputs, params=request_params)` (batch "stack":
                                         the first request's params; "list": {"batch": [...]})
    per_chunk: bool                      with streaming inputs: call the module on every chunk
                                         as it arrives and emit its output at once (default:
                                         concatenate the chunks, then one call)
The module returns a dict {port: value}, a tuple (ports in declared order), a single value
(one output port; a dict whose keys are not all output ports counts as a value), or (batch "none" only) a generator of such dicts: one chunk per step.

`noop` params: inputs {port: type} (default {x: any}), outputs (default: same as inputs);
each input is passed to the output at the same position. With streaming_inputs the chunks
are passed through as they arrive.
"""

from __future__ import annotations

import difflib
import importlib
import time
import types
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from omnistage.errors import InvalidRequestError, StageConfigError
from omnistage.stages.base import Emission, Port, StageContext, StageRequest, StepRecord
from omnistage.stages.contracts import PORT_TYPES, error_emission
from omnistage.stages.dynamic import DynamicBatchEngine
from omnistage.stages.params import Param, ParamSet
from omnistage.stages.registry import register_stage

BATCH_MODES = ("none", "stack", "list")


def load_factory(ref: str) -> Callable[..., Any]:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise StageConfigError(f"params.factory {ref!r} must look like 'package.module:callable'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise StageConfigError(f"params.factory {ref!r}: cannot import {module_name!r} ({exc})") from None
    owner = module_name
    for part in attr.split("."):
        try:
            obj, owner = getattr(obj, part), f"{owner}.{part}"
        except AttributeError:
            close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise StageConfigError(f"params.factory {ref!r}: {owner!r} has no attribute {part!r}{hint}") from None
        except ImportError as exc:  # a lazily loaded attribute whose module fails to import
            raise StageConfigError(f"params.factory {ref!r}: cannot import {part!r} ({exc})") from None
    return obj


def _port_map(params: dict[str, Any], key: str, default: dict[str, str], streaming: list[str]) -> dict[str, Port]:
    spec = params.get(key) or default
    return {name: Port(type_, streaming=name in streaming) for name, type_ in spec.items()}


def _port_types_problem(ports: dict[str, Any]) -> str | None:
    if not ports:
        return "must be a non-empty mapping port -> type"
    bad = [f"{name}: {type_!r}" for name, type_ in ports.items() if type_ not in PORT_TYPES]
    return f"has unknown port types ({', '.join(bad)}; known: {', '.join(PORT_TYPES)})" if bad else None


def _factory_problem(ref: str) -> str | None:
    module_name, _, attr = ref.partition(":")
    return None if module_name and attr else "must look like 'package.module:callable'"


def _streaming_ports_declared(values: dict[str, Any]) -> tuple[str, str] | None:
    for key, side in (("streaming_inputs", "inputs"), ("streaming_outputs", "outputs")):
        declared = values.get(side) or {}
        for name in values.get(key) or () if declared else ():
            if name not in declared:
                return key, f"{key}: {name!r} is not one of params.{side}"
    return None


def _noop_ports_pair(values: dict[str, Any]) -> tuple[str, str] | None:
    ins, outs = values.get("inputs"), values.get("outputs")
    if ins and outs and len(ins) != len(outs):
        return "outputs", "noop: params.inputs and params.outputs must have the same number of ports"
    return None


_PORT_PARAMS = (
    Param(
        "inputs",
        "mapping",
        None,
        "Input ports {port: type}; default {x: tensor} ({x: any} for noop).",
        nullable=True,
        check=_port_types_problem,
    ),
    Param(
        "outputs",
        "mapping",
        None,
        "Output ports {port: type}; default {y: tensor} (noop: as inputs).",
        nullable=True,
        check=_port_types_problem,
    ),
    Param("streaming_inputs", "string_list", [], "Input ports that accept chunks (streaming edges)."),
    Param("streaming_outputs", "string_list", [], "Output ports emitted in several chunks."),
)

TORCH_MODULE_PARAMS = ParamSet(
    "torch_module",
    (
        Param(
            "factory",
            "string",
            None,
            "'package.module:callable' building the module in the worker.",
            required=True,
            check=_factory_problem,
        ),
        Param("kwargs", "mapping", {}, "Keyword arguments of the factory."),
        *_PORT_PARAMS,
        Param(
            "batch",
            "string",
            "none",
            "How a dynamic batch calls the module (see stages/generic.py).",
            choices=BATCH_MODES,
        ),
        Param("pass_params", "boolean", False, "Call m(**inputs, params=request_params)."),
        Param("per_chunk", "boolean", False, "With streaming inputs: call the module on every chunk."),
    ),
    rules=(_streaming_ports_declared,),
)

NOOP_PARAMS = ParamSet(
    "noop",
    (
        *_PORT_PARAMS,
        Param("per_chunk", "boolean", True, "With streaming inputs: pass each chunk on as it arrives."),
    ),
    rules=(_streaming_ports_declared, _noop_ports_pair),
)

# torch_module with pass_params: the module reads (and checks) its own request params.
MODULE_REQUEST_PARAMS = ParamSet(
    "torch_module request",
    open=True,
    doc="With the stage's `pass_params: true`, any keys: the module gets them as `params` and checks "
    "them itself. Without it, none.",
)
MODULE_NO_REQUEST_PARAMS = ParamSet(
    "torch_module request", empty_hint="this stage takes none: its YAML params lack `pass_params: true`"
)


class _CallableEngine(DynamicBatchEngine):
    """Shared machinery: per-chunk streaming inputs on top of dynamic batching."""

    default_inputs: dict[str, str] = {"x": "tensor"}
    default_outputs: dict[str, str] = {"y": "tensor"}

    @classmethod
    def ports(cls, params):
        s_in = list(params.get("streaming_inputs") or [])
        s_out = list(params.get("streaming_outputs") or [])
        ins = _port_map(params, "inputs", cls.default_inputs, s_in)
        outs = _port_map(
            params,
            "outputs",
            params.get("inputs") if cls.kind == "noop" and params.get("inputs") else cls.default_outputs,
            s_out,
        )
        return ins, outs

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        p = ctx.params
        self.in_ports, self.out_ports = self.ports(p)
        self.output_names = list(self.out_ports)
        self.per_chunk = bool(p.get("per_chunk", self.kind == "noop")) and bool(p.get("streaming_inputs"))
        # per-chunk mode: (request_id, port, chunk, last) waiting for the module
        self._chunks: deque[tuple[str, str, Any, bool]] = deque()
        self._chunked: dict[str, StageRequest] = {}
        self.chunks_total = 0
        self._rejected: list[Emission] = []  # requests with bad params, reported on the next step

    def call(self, inputs: dict[str, Any], params: dict[str, Any] | None = None) -> Any:
        raise NotImplementedError

    def to_outputs(self, result: Any) -> dict[str, Any]:
        # a dict keyed by output ports is a port map; with one output port any other value
        # (a dict with other keys included) is that port's value
        if isinstance(result, dict) and (len(self.output_names) > 1 or set(result) <= set(self.output_names)):
            return result
        if isinstance(result, tuple) and len(self.output_names) > 1:
            return dict(zip(self.output_names, result))
        return {self.output_names[0]: result}

    # per-chunk streaming ----------------------------------------------------------------
    def accepted_request_params(self) -> ParamSet:
        return self.request_params_for(self.ctx.params)

    def add(self, request: StageRequest) -> None:
        try:
            self.accepted_request_params().validate(request.params, fill_defaults=False)
        except InvalidRequestError as exc:
            self._rejected.append(error_emission(request.request_id, exc))
            return
        if self.per_chunk:
            self._chunked[request.request_id] = request
        else:
            super().add(request)

    def feed(self, request_id: str, port: str, chunk: Any, last: bool) -> None:
        if not self.per_chunk:
            return super().feed(request_id, port, chunk, last)
        if request_id in self._chunked:
            self._chunks.append((request_id, port, chunk, last))

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self._rejected = [e for e in self._rejected if e.request_id != request_id]
        if self._chunked.pop(request_id, None) is not None:
            self._chunks = deque(c for c in self._chunks if c[0] != request_id)

    def has_work(self) -> bool:
        return bool(self._chunks or self._rejected) or super().has_work()

    def next_wakeup(self):
        return 0.0 if self._chunks or self._rejected else super().next_wakeup()

    def num_requests(self) -> int:
        return super().num_requests() + len(self._chunked) + len(self._rejected)

    def step(self) -> list[Emission]:
        emissions, self._rejected = self._rejected, []
        if self._chunks:
            t0 = time.perf_counter()
            rids = []
            while self._chunks:
                rid, port, chunk, last = self._chunks.popleft()
                request = self._chunked.get(rid)
                if request is None:
                    continue
                rids.append(rid)
                try:
                    with torch.inference_mode():
                        out = self.to_outputs(self.call({**request.inputs, port: chunk}, request.params))
                    self.chunks_total += 1
                    emissions.append(Emission(rid, outputs=out, finished=last))
                except Exception as exc:  # noqa: BLE001
                    self.errors_total += 1
                    emissions.append(error_emission(rid, exc))
                    last = True
                if last:
                    self._chunked.pop(rid, None)
                    self._chunks = deque(c for c in self._chunks if c[0] != rid)
            self.step_log.append(
                StepRecord(tuple(rids), len(set(rids)), time.perf_counter() - t0, {"chunks": len(rids)})
            )
        return emissions + super().step()

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["chunk_requests"] = float(len(self._chunked))
        s["chunks_total"] = float(self.chunks_total)
        return s


@register_stage("torch_module")
class TorchModuleEngine(_CallableEngine):
    stage_params = TORCH_MODULE_PARAMS
    request_params = MODULE_REQUEST_PARAMS

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        p = ctx.params
        module = load_factory(p["factory"])(**(p.get("kwargs") or {}))
        if isinstance(module, torch.nn.Module):
            module = module.to(device=ctx.device, dtype=ctx.dtype).eval()
        self.module = module
        self.batch_mode = p.get("batch", "none")
        self.pass_params = bool(p.get("pass_params", False))

    @classmethod
    def request_params_for(cls, params: dict[str, Any]) -> ParamSet:
        return MODULE_REQUEST_PARAMS if (params or {}).get("pass_params") else MODULE_NO_REQUEST_PARAMS

    def call(self, inputs: dict[str, Any], params: dict[str, Any] | None = None) -> Any:
        if self.pass_params:
            return self.module(**inputs, params=params or {})
        return self.module(**inputs)

    def batch_key(self, request: StageRequest):
        if self.batch_mode != "stack":
            return None
        return tuple(
            (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, type(v).__name__)
            for k, v in sorted(request.inputs.items())
        )

    def forward_batch(self, requests: list[StageRequest]) -> list[Any]:
        with torch.inference_mode():
            if self.batch_mode == "stack":
                stacked = {k: torch.stack([r.inputs[k] for r in requests]) for k in requests[0].inputs}
                out = self.to_outputs(self.call(stacked, requests[0].params))
                return [{k: v[i] for k, v in out.items()} for i in range(len(requests))]
            if self.batch_mode == "list":
                listed = {k: [r.inputs[k] for r in requests] for k in requests[0].inputs}
                out = self.call(listed, {"batch": [r.params for r in requests]})
                if isinstance(out, dict):
                    return [{k: v[i] for k, v in out.items()} for i in range(len(requests))]
                return [self.to_outputs(o) for o in out]
            results: list[Any] = []
            for r in requests:
                try:
                    out = self.call(r.inputs, r.params)
                    results.append(out if isinstance(out, types.GeneratorType) else self.to_outputs(out))
                except Exception as exc:  # noqa: BLE001 - only this request fails
                    results.append(exc)
            return results


@register_stage("noop")
class NoopEngine(_CallableEngine):
    default_inputs = {"x": "any"}
    default_outputs = {"x": "any"}

    stage_params = NOOP_PARAMS

    def call(self, inputs: dict[str, Any], params: dict[str, Any] | None = None) -> Any:
        return {o: inputs.get(i) for i, o in zip(self.in_ports, self.output_names)}

    def forward_batch(self, requests: list[StageRequest]) -> list[Any]:
        return [self.call(r.inputs) for r in requests]
