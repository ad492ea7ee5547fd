"""Typed, validated form of a pipeline YAML file.

These dataclasses are what every other layer sees: the runtime builds workers from
StageSpec/EdgeSpec, serving lists PipelineSpec names. The loader (graph/loader.py) is the only
producer; it attaches a SourcePos to everything so later errors can still point at the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Reserved endpoint names in edges: `from: inputs.text`, `to: outputs.audio`.
PIPELINE_INPUTS = "inputs"
PIPELINE_OUTPUTS = "outputs"

BATCHING_POLICIES = ("dynamic", "continuous", "step", "none")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class SourcePos:
    file: str
    line: int  # 1-based
    col: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass
class ModelRef:
    """Where a stage's weights come from.

    `source` is a local path, a hub id (resolved from the local HF cache only: nothing is
    downloaded at run time), or `tiny:<recipe>` (a built-in random-weight checkpoint built
    locally with a fixed seed on first use, see omnistage.models.recipes).
    """

    source: str
    subfolder: str | None = None
    prefix: str | None = None  # weight-name prefix to strip/select inside the checkpoint
    pos: SourcePos | None = None

    @property
    def is_tiny_recipe(self) -> bool:
        return self.source.startswith("tiny:")


@dataclass
class PoolSpec:
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    replicas: int = 1
    dtype: str = "float32"
    threads: int = 1  # torch intra-op threads per worker process
    cpus: list[int] | None = None  # CPU affinity of each worker (runtime/cpu_affinity.py); None: the server's
    memory: str | None = None  # optional budget, e.g. "2GiB" (KV pools size from it)
    step_timeout_s: float | None = 300.0  # watchdog on one engine step; None: off
    max_rss: str | None = None  # past it the worker is recycled between requests
    autoscaling: dict | None = None  # Ray Serve backend: its autoscaling_config
    resources: dict | None = None  # Ray Serve backend: custom Ray resources per replica
    pos: SourcePos | None = None  # where the pool mapping sits in the file (device errors at start)

    @property
    def memory_bytes(self) -> int | None:
        """`memory` in bytes ("2GiB" -> 2147483648), None when no budget is set."""
        if self.memory is None:
            return None
        from omnistage.graph.fields import memory_bytes

        return memory_bytes(self.memory)

    @property
    def max_rss_bytes(self) -> int | None:
        if self.max_rss is None:
            return None
        from omnistage.graph.fields import memory_bytes

        return memory_bytes(self.max_rss)

    def device_for_replica(self, index: int) -> str:
        return self.devices[index % len(self.devices)]


@dataclass
class BatchingSpec:
    policy: str = "dynamic"
    # dynamic / step
    max_batch_size: int = 8
    max_wait_ms: float = 2.0
    # continuous (autoregressive stages)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # step (denoisers): optional bound on latent tokens per step
    max_latent_tokens: int | None = None
    pos: SourcePos | None = None


@dataclass
class StageSpec:
    name: str
    kind: str
    model: ModelRef | None = None
    pool: PoolSpec = field(default_factory=PoolSpec)
    batching: BatchingSpec = field(default_factory=BatchingSpec)
    params: dict[str, Any] = field(default_factory=dict)
    # per-request parameter values a request gets when it sends none of its own
    request_defaults: dict[str, Any] = field(default_factory=dict)
    pos: SourcePos | None = None


@dataclass(frozen=True)
class Endpoint:
    stage: str  # a stage name, or PIPELINE_INPUTS / PIPELINE_OUTPUTS
    port: str

    def __str__(self) -> str:
        return f"{self.stage}.{self.port}"


@dataclass
class StreamSpec:
    chunk: int = 1  # items along dim 0 per delivered chunk
    left_context: int = 0  # items of the previous chunk repeated at the head of the next
    # per-request flow control (runtime/credit.py): the producer holds a request back once
    # this many of its chunks, or this many bytes, are sent but not yet consumed
    credit: int = 64
    credit_bytes: int = 4 * 2**20


@dataclass
class EdgeSpec:
    src: Endpoint
    dst: Endpoint
    stream: StreamSpec | None = None
    max_inflight: int | None = None
    pos: SourcePos | None = None

    @property
    def streaming(self) -> bool:
        return self.stream is not None


@dataclass
class PipelineSpec:
    name: str
    inputs: dict[str, str]  # port name -> port type
    outputs: dict[str, str]
    stages: dict[str, StageSpec]
    edges: list[EdgeSpec]
    description: str = ""
    source: Path | None = None
    # Request intake bound (admission control) and default per-request deadline.
    max_queued_requests: int = 256
    default_deadline_s: float | None = None
    # inputs declared with a shape/dtype (graph/inputs.py TensorSpec), checked at admission
    input_tensors: dict[str, Any] = field(default_factory=dict)
    # API family -> omnistage.graph.serves.ServeSpec (the `serves:` section)
    serves: dict[str, Any] = field(default_factory=dict)

    # Edge queries: the runtime keys edge permits and reader slots by an edge's index in
    # `edges`, so the index forms are the primary ones.
    def in_edge_ids(self, stage: str) -> list[int]:
        """Indices (in `edges`) of the edges into `stage` (or PIPELINE_OUTPUTS)."""
        return [i for i, e in enumerate(self.edges) if e.dst.stage == stage]

    def out_edge_ids(self, stage: str) -> list[int]:
        """Indices (in `edges`) of the edges out of `stage` (or PIPELINE_INPUTS)."""
        return [i for i, e in enumerate(self.edges) if e.src.stage == stage]

    def out_edge_ids_by_port(self, stage: str) -> dict[str, list[int]]:
        """Output port of `stage` -> indices of its out-edges in file order (a port's i-th
        edge reads the shared payload with reader slot i)."""
        out: dict[str, list[int]] = {}
        for i in self.out_edge_ids(stage):
            out.setdefault(self.edges[i].src.port, []).append(i)
        return out

    def in_edges(self, stage: str) -> list[EdgeSpec]:
        return [self.edges[i] for i in self.in_edge_ids(stage)]

    def out_edges(self, stage: str) -> list[EdgeSpec]:
        return [self.edges[i] for i in self.out_edge_ids(stage)]

    def topo_order(self) -> list[str]:
        """Stage names in dependency order (the loader has already rejected cycles)."""
        indeg = {name: 0 for name in self.stages}
        for e in self.edges:
            if e.dst.stage in indeg and e.src.stage in indeg:
                indeg[e.dst.stage] += 1
        order: list[str] = []
        ready = [n for n, d in indeg.items() if d == 0]
        while ready:
            n = ready.pop(0)
            order.append(n)
            for e in self.out_edges(n):
                if e.dst.stage in indeg:
                    indeg[e.dst.stage] -= 1
                    if indeg[e.dst.stage] == 0:
                        ready.append(e.dst.stage)
        return order
