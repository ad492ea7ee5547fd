"""The one engine protocol every stage kind implements.

A worker process hosts one engine and loops: take new requests, chunks and aborts ->
`step()` -> send the returned emissions along the stage's out-edges. How messages move
between processes (transport) is not the engine's business: engines see plain Python
objects and CPU/GPU tensors.

Batching policies are engine shapes:
- dynamic: each request finishes in the one step that batches it (encoders, VAE, vocoder).
- continuous: an autoregressive engine steps every running sequence once per step.
- step: a denoiser advances every active request by one sampler step per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from omnistage.stages.params import NO_PARAMS, ParamSet

if TYPE_CHECKING:  # the graph layer sits above this one: the type only, no import at run time
    from omnistage.graph.spec import BatchingSpec


@dataclass(frozen=True)
class Port:
    """A typed input or output port of a stage kind.

    type: one of omnistage.stages.contracts.PORT_TYPES.
    streaming: on an input, the stage accepts chunks through `feed()` while the request runs
        (a streaming edge may only end at such a port); on an output, the stage may emit the
        port in several chunks (concatenated along dim 0 for non-streaming consumers).
    optional: an input that need not be connected.
    """

    type: str
    streaming: bool = False
    optional: bool = False


@dataclass
class StageContext:
    """Everything an engine needs to build itself inside its worker process."""

    stage_name: str
    kind: str
    model_path: str | None  # resolved local directory (or file), None if the kind needs none
    model_subfolder: str | None
    model_prefix: str | None
    device: torch.device
    dtype: torch.dtype
    batching: BatchingSpec  # its defaults are the spec's; engines read the fields directly
    params: dict[str, Any]
    replica_index: int = 0
    memory_bytes: int | None = None  # the pool's memory budget per replica (pool.memory), if set


@dataclass
class StageRequest:
    request_id: str
    inputs: dict[str, Any]  # port name -> value (non-streaming inputs, complete)
    params: dict[str, Any] = field(default_factory=dict)  # this stage's per-request params
    deadline: float | None = None  # time.time() seconds; engines may drop late requests
    arrival: float = field(default_factory=time.time)


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()  # a port's value meaning "this request never produces this port"


@dataclass
class Emission:
    """What a step produced for one request.

    outputs holds chunks for some output ports (may be empty, e.g. a progress-only step).
    finished=True is the request's last emission from this stage. error set => the request
    failed in this stage (finished is implied); other requests are unaffected.
    progress: optional (done, total) for long requests (denoising step i of n).
    """

    request_id: str
    outputs: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    error: str | None = None
    # "invalid_request": the request's own fault (HTTP 400), "invalid_request:CODE" with a specific
    # error code (context_length_exceeded); "internal": the stage failed (500).
    error_kind: str = "internal"
    progress: tuple[int, int] | None = None
    param: str | None = None  # the request parameter an invalid_request error is about
    # With finished=True: output ports this request never produced. A stage reached only through
    # such ports (and stages reached only through those) never sees the request; see runtime/routing.py.
    # A port's value ABSENT in a finished emission's outputs declares it too.
    absent_ports: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.finished and self.outputs and any(v is ABSENT for v in self.outputs.values()):
            absent = [p for p, v in self.outputs.items() if v is ABSENT]
            self.outputs = {p: v for p, v in self.outputs.items() if v is not ABSENT}
            self.absent_ports = (*self.absent_ports, *absent)


@dataclass
class StepRecord:
    """One step's shape, kept by engines for metrics and for tests that prove batching."""

    request_ids: tuple[str, ...]
    batch_size: int
    duration_s: float
    extra: dict[str, Any] = field(default_factory=dict)


class StageEngine:
    """Base class of every stage kind. Subclasses register with @register_stage("kind").

    Class attributes declare the ports (used by YAML validation without building anything),
    the batching policies the kind supports, and its parameters (stages/params.py):
    `stage_params` for the YAML `params:`, `request_params` for what one request may send.
    `ports(params)` may refine the ports from params.
    """

    kind: ClassVar[str] = ""
    inputs: ClassVar[dict[str, Port]] = {}
    outputs: ClassVar[dict[str, Port]] = {}
    batching_policies: ClassVar[tuple[str, ...]] = ("dynamic", "none")
    needs_model: ClassVar[bool] = False
    stage_params: ClassVar[ParamSet] = NO_PARAMS
    request_params: ClassVar[ParamSet] = NO_PARAMS

    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        self.step_log: list[StepRecord] = []  # bounded by the worker (keeps the last N)

    @classmethod
    def ports(cls, params: dict[str, Any]) -> tuple[dict[str, Port], dict[str, Port]]:
        return dict(cls.inputs), dict(cls.outputs)

    @classmethod
    def request_params_for(cls, params: dict[str, Any]) -> ParamSet:
        """The request params of a stage of this kind with these YAML `params:` (a kind whose
        stage params decide what a request may send narrows `request_params` here)."""
        return cls.request_params

    @classmethod
    def validate_params(cls, params: dict[str, Any]) -> list[str]:
        """Problems with stage-level params from the YAML (messages, no positions). Kinds whose
        params depend on each other add their own checks on top of the declared ones."""
        return cls.stage_params.problems(params)

    @classmethod
    def check_queued(cls, stage: Any, params: dict[str, Any]) -> None:
        """Refuse (InvalidRequestError naming the param) what this kind would refuse of a
        request's params, knowing only its StageSpec and checkpoint files, before the request
        is queued: the jobs API answers 400 at submission instead of failing the job later.
        Called once the pipeline is ready, after the declared request_params passed."""

    # -- the protocol ---------------------------------------------------------------------
    def add(self, request: StageRequest) -> None:
        raise NotImplementedError

    def feed(self, request_id: str, port: str, chunk: Any, last: bool) -> None:
        """A chunk for a streaming input port of a request already added."""
        raise NotImplementedError(f"stage kind {self.kind!r} takes no streaming input")

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def step(self) -> list[Emission]:
        raise NotImplementedError

    def has_work(self) -> bool:
        """True when step() would make progress now."""
        raise NotImplementedError

    def num_requests(self) -> int:
        raise NotImplementedError

    def next_wakeup(self) -> float | None:
        """Seconds until the engine wants step() even without new input (dynamic batching's
        max_wait); None = only on new input."""
        return None

    # -- flow control (runtime/credit.py) ---------------------------------------------------
    @property
    def paused(self) -> set[str]:
        """Requests whose consumer is behind: an engine that honours this skips them in step()
        (the rest of the batch goes on) and leaves them out of has_work(); one that does not
        simply runs ahead."""
        try:
            return self._paused
        except AttributeError:
            self._paused: set[str] = set()
            return self._paused

    def pause(self, request_id: str) -> None:
        self.paused.add(request_id)

    def resume(self, request_id: str) -> None:
        self.paused.discard(request_id)

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        """Engine-specific gauges/counters for /metrics (e.g. kv_blocks_free, prefix_hits)."""
        return {}
