"""The pipeline format's keys, in one table read by both validation and the JSON Schema.

Each section (the top level, a stage, a pool, ...) maps key -> Field. Scalar constraints
(type, minimum, enum) are checked generically from here; keys whose value has several shapes
(`model`, `devices`, `batching`, `stream`) have `type="special"` and their own checks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from omnistage.graph.spec import BATCHING_POLICIES, DTYPES
from omnistage.stages.contracts import MEMORY_PATTERN, memory_bytes  # noqa: F401 (read as F.memory_bytes)


@dataclass(frozen=True)
class Field:
    type: str  # "string" | "integer" | "number" | "boolean" | "mapping" | "list" | "special"
    doc: str
    required: bool = False
    minimum: float | None = None
    exclusive_minimum: float | None = None
    enum: tuple[str, ...] | None = None
    nullable: bool = False
    pattern: str | None = None


NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]*$"
PIPELINE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
DEVICE_PATTERN = r"^(cpu|cuda(:[0-9]+)?)$"

PIPELINE = {
    "name": Field(
        "string",
        "Pipeline name (what /v1/models lists and requests select).",
        required=True,
        pattern=PIPELINE_NAME_PATTERN,
    ),
    "description": Field("string", "Free text shown in listings."),
    "inputs": Field(
        "mapping",
        "Pipeline input ports: {port: type} or {port: {type, shape, dtype}} (shape/dtype checked at admission). "
        "Edges read them as `inputs.PORT`.",
    ),
    "outputs": Field(
        "mapping", "Pipeline output ports: {port: type}. Edges write them as `outputs.PORT`.", required=True
    ),
    "stages": Field("mapping", "Stages by name: {name: {kind, model, pool, batching, params}}.", required=True),
    "edges": Field("list", "Connections: [{from: stage.port, to: stage.port, stream, max_inflight}].", required=True),
    "limits": Field("mapping", "Admission control: {max_queued_requests, deadline_s}."),
    "serves": Field(
        "mapping",
        "OpenAI API families served (chat, completions, images, speech): {family: {role: port, params: [stage]}}.",
    ),
}

STAGE = {
    "kind": Field("string", "Registered stage kind (torch_module, ar_lm, denoiser, ...).", required=True),
    "model": Field("special", "Weights: a local path, a hub id, `tiny:<recipe>`, or {source, subfolder, prefix}."),
    "pool": Field("mapping", "Where and how many: {devices, replicas, dtype, threads, memory}."),
    "batching": Field("special", "Batching policy and knobs, or just the policy name."),
    "params": Field("mapping", "Kind-specific settings, checked by the kind's validate_params()."),
    "request_defaults": Field(
        "mapping",
        "Per-request parameters a request gets when it does not send them (its own values win); "
        "checked against the kind's request parameters.",
    ),
}

MODEL = {
    "source": Field(
        "string",
        "Local path (relative paths start at the YAML file's folder), "
        "hub id (local HF cache only), or `tiny:<recipe>`.",
        required=True,
    ),
    "subfolder": Field("string", "Subfolder inside the checkpoint (e.g. `transformer`).", nullable=True),
    "prefix": Field(
        "string",
        "Weight-name prefix selecting this stage's weights in a shared checkpoint (e.g. `thinker.`).",
        nullable=True,
    ),
}

POOL = {
    "devices": Field(
        "special",
        "Devices for the replicas, round-robin: a list or a comma string of `cpu`, `cuda`, `cuda:N`. Default [cpu].",
    ),
    "replicas": Field("integer", "Worker processes for this stage. Default 1.", minimum=1),
    "dtype": Field("string", "Weight/activation dtype. Default float32.", enum=DTYPES),
    "threads": Field("integer", "torch intra-op threads per worker. Default 1.", minimum=1),
    "cpus": Field(
        "special",
        "CPU affinity of each worker, a list of CPU ids or a string like `1` or `0-3,6` (embedded runtime, "
        "Linux). Default: every CPU the server may use.",
    ),
    "memory": Field("special", "Memory budget per replica, e.g. `2GiB` (KV pools size from it)."),
    "step_timeout_s": Field(
        "number",
        "Watchdog: a worker whose engine step runs longer is killed and restarted; its requests fail "
        "(retryable). null turns it off. Default 300.",
        exclusive_minimum=0,
        nullable=True,
    ),
    "max_rss": Field(
        "special",
        "Resident memory per worker, e.g. `4GiB`: past it the worker is drained and restarted between requests.",
    ),
    "autoscaling": Field(
        "mapping",
        "Ray Serve backend: {min_replicas, max_replicas, initial_replicas, target_ongoing_requests} "
        "(Serve's autoscaling_config; replaces `replicas` there, ignored embedded).",
    ),
    "resources": Field(
        "special",
        "Ray Serve backend: custom Ray resources per replica, {name: amount} (pins a stage to the nodes "
        "that offer them; ignored embedded).",
    ),
}

# A pool's `autoscaling:` block, read by the Ray Serve backend only (ray_serve/options.py maps
# it onto Serve's autoscaling_config; the embedded runtime runs `replicas` workers).
AUTOSCALING = {
    "min_replicas": Field("integer", "Fewest replicas Serve keeps. Default 1.", minimum=0),
    "max_replicas": Field("integer", "Most replicas Serve starts.", required=True, minimum=1),
    "initial_replicas": Field("integer", "Replicas at deployment. Default min_replicas.", minimum=0),
    "target_ongoing_requests": Field(
        "number",
        "Requests in flight per replica Serve scales towards (each request counts at every stage).",
        exclusive_minimum=0,
    ),
}

# Knobs of each batching policy (BatchingSpec fields).
BATCHING_KNOBS: dict[str, dict[str, Field]] = {
    "dynamic": {
        "max_batch_size": Field("integer", "Most requests in one step. Default 8.", minimum=1),
        "max_wait_ms": Field("number", "Longest a request waits for batch mates. Default 2.", minimum=0),
    },
    "continuous": {
        "max_num_batched_tokens": Field("integer", "Token budget of one step. Default 2048.", minimum=1),
        "max_num_seqs": Field("integer", "Most running sequences. Default 64.", minimum=1),
    },
    "step": {
        "max_batch_size": Field("integer", "Most requests advanced per step. Default 8.", minimum=1),
        "max_wait_ms": Field("number", "Longest a new request waits to join. Default 2.", minimum=0),
        "max_latent_tokens": Field("integer", "Bound on latent tokens per step.", minimum=1, nullable=True),
    },
    "none": {},
}
assert set(BATCHING_KNOBS) == set(BATCHING_POLICIES)

BATCHING_POLICY = Field(
    "string", "dynamic | continuous | step | none. Default: the kind's first supported policy.", enum=BATCHING_POLICIES
)

EDGE = {
    "from": Field("string", "Producer: `stage.port` or `inputs.PORT`.", required=True),
    "to": Field("string", "Consumer: `stage.port` or `outputs.PORT`.", required=True),
    "stream": Field(
        "special",
        "Deliver chunks while the producer runs: {chunk, left_context, credit, credit_bytes} "
        "or true. The consumer port must accept streaming input.",
    ),
    "max_inflight": Field(
        "integer",
        "Most requests between the producer taking them and the consumer finishing them (backpressure: a full edge holds the producer back).",
        minimum=1,
        nullable=True,
    ),
}

STREAM = {
    "chunk": Field("integer", "Items along dim 0 per delivered chunk. Default 1.", minimum=1),
    "left_context": Field(
        "integer", "Items of the previous chunk repeated at the head of the next. Default 0.", minimum=0
    ),
    "credit": Field(
        "integer",
        "Most chunks of one request sent but not yet consumed; the producer holds that request back meanwhile. Default 64.",
        minimum=1,
    ),
    "credit_bytes": Field(
        "integer",
        "Most bytes of one request's tensors sent but not yet consumed (a larger chunk still goes alone). Default 4194304.",
        minimum=1,
    ),
}

LIMITS = {
    "max_queued_requests": Field(
        "integer", "Intake queue bound; a full queue rejects at once (overloaded). Default 256.", minimum=1
    ),
    "deadline_s": Field(
        "number", "Default per-request deadline in seconds (null: none).", exclusive_minimum=0, nullable=True
    ),
}


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,6` (the form of taskset -c and cpusets) -> [0, 1, 2, 3, 6]."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list like 0-3,6")
        low, high = int(first), int(last) if sep else int(first)
        if high < low:
            raise ValueError(f"{text!r}: the range {part.strip()} runs backwards")
        cpus.update(range(low, high + 1))
    return sorted(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
