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

import importlib
import time
import types
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from omnistage.stages.base import Emission, Port, StageContext, StageRequest, StepRecord
from omnistage.stages.contracts import PORT_TYPES, error_emission
from omnistage.stages.dynamic import DynamicBatchEngine
from omnistage.stages.registry import register_stage

BATCH_MODES = ("none", "stack", "list")


def load_factory(ref: str) -> Callable[..., Any]:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ValueError(f"factory {ref!r} must look like 'package.module:callable'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _port_map(params: dict[str, Any], key: str, default: dict[str, str], streaming: list[str]) -> dict[str, Port]:
    spec = params.get(key) or default
    return {name: Port(type_, streaming=name in streaming) for name, type_ in spec.items()}


def _check_ports(params: dict[str, Any]) -> list[str]:
    problems = []
    for key in ("inputs", "outputs"):
        ports = params.get(key)
        if ports is None:
            continue
        if not isinstance(ports, dict) or not ports:
            problems.append(f"params.{key} must be a non-empty mapping port -> type")
            continue
        for name, type_ in ports.items():
            if type_ not in PORT_TYPES:
                problems.append(f"params.{key}.{name}: unknown port type {type_!r} (known: {', '.join(PORT_TYPES)})")
    for key, side in (("streaming_inputs", "inputs"), ("streaming_outputs", "outputs")):
        names = params.get(key) or []
        declared = params.get(side) or {}
        if declared:
            for n in names:
                if n not in declared:
                    problems.append(f"params.{key}: {n!r} is not one of params.{side}")
    return problems


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
    def add(self, request: StageRequest) -> None:
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
        if self._chunked.pop(request_id, None) is not None:
            self._chunks = deque(c for c in self._chunks if c[0] != request_id)

    def has_work(self) -> bool:
        return bool(self._chunks) or super().has_work()

    def next_wakeup(self):
        return 0.0 if self._chunks else super().next_wakeup()

    def num_requests(self) -> int:
        return super().num_requests() + len(self._chunked)

    def step(self) -> list[Emission]:
        emissions: list[Emission] = []
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
    @classmethod
    def validate_params(cls, params):
        problems = _check_ports(params)
        factory = params.get("factory")
        if not isinstance(factory, str) or ":" not in factory:
            problems.append("params.factory is required: 'package.module:callable'")
        if params.get("batch", "none") not in BATCH_MODES:
            problems.append(f"params.batch must be one of {', '.join(BATCH_MODES)}")
        if not isinstance(params.get("kwargs", {}), dict):
            problems.append("params.kwargs must be a mapping")
        return problems

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        p = ctx.params
        module = load_factory(p["factory"])(**(p.get("kwargs") or {}))
        if isinstance(module, torch.nn.Module):
            module = module.to(device=ctx.device, dtype=ctx.dtype).eval()
        self.module = module
        self.batch_mode = p.get("batch", "none")
        self.pass_params = bool(p.get("pass_params", False))

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

    @classmethod
    def validate_params(cls, params):
        problems = _check_ports(params)
        ins, outs = cls.ports(params)
        if len(ins) != len(outs):
            problems.append("noop: params.inputs and params.outputs must have the same number of ports")
        return problems

    def call(self, inputs: dict[str, Any], params: dict[str, Any] | None = None) -> Any:
        return {o: inputs.get(i) for i, o in zip(self.in_ports, self.output_names)}

    def forward_batch(self, requests: list[StageRequest]) -> list[Any]:
        return [self.call(r.inputs) for r in requests]
