"""What a pipeline YAML means to Ray Serve: deployment names and options per stage pool.

- `num_replicas`: the pool's `replicas`, unless the pool has an `autoscaling:` block, which
  becomes Serve's `autoscaling_config` (min/max/initial replicas, target ongoing requests,
  counted as the requests each replica's engine holds: ray_serve/scaling.py);
- `ray_actor_options`: `num_cpus` = the pool's `threads` x `cpus_per_thread` (below 1 lets a
  small machine oversubscribe its cores, as the embedded runtime does), `num_gpus: 1` for a
  pool on `cuda` devices (Ray then shows the replica its GPU as `cuda:0`), and the pool's
  `resources` as custom resources (pin a stage to the nodes that offer them);
- every stage deployment routes with ray_serve/router.py's PinnedRouter.

Every replica loads the pipeline itself from a PipelineSource (config paths and `--set`
overrides), so the Serve config stays plain JSON that `serve deploy` and KubeRay accept.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omnistage.graph.spec import PipelineSpec
from omnistage.ray_serve.scaling import POLICY_PATH
from omnistage.runtime.openmp import openmp_env

INGRESS = "ingress"
# Each request holds one open stream per stage it uses, plus short delivery calls: the engine
# batches them all, so a replica takes far more than Serve's default of 5.
STAGE_MAX_ONGOING = 4096
INGRESS_MAX_ONGOING = 1024


@dataclass
class PipelineSource:
    """Where every process of the application reads the pipelines from."""

    configs: list[str]
    overrides: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict) -> PipelineSource:
        return cls(list(data["configs"]), list(data.get("overrides") or []))

    @classmethod
    def resolve(cls, configs: list[str], overrides: list[str] = ()) -> PipelineSource:
        """Files that exist here by absolute path (replicas start in other directories);
        names of shipped configs (`tiny-llm`) as they are."""
        paths = [str(Path(c).resolve()) if Path(c).is_file() else str(c) for c in configs]
        return cls(paths, list(overrides))

    def to_dict(self) -> dict:
        return asdict(self)

    def load_all(self) -> list[PipelineSpec]:
        from omnistage.graph.loader import load_pipeline
        from omnistage.serving.registry import overrides_per_config

        own = overrides_per_config(self.configs, self.overrides)
        return [load_pipeline(c, overrides=o) for c, o in zip(self.configs, own)]

    def load(self, name: str) -> PipelineSpec:
        for spec in self.load_all():
            if spec.name == name:
                return spec
        raise KeyError(f"no pipeline named {name!r} in {self.configs}")


@dataclass
class BackendOptions:
    """Settings of the application that are not in the pipeline files."""

    cpus_per_thread: float = 1.0
    ingress_replicas: int = 1
    ingress_cpus: float = 0.0
    drain_timeout: float = 30.0
    # a stage replica's emits leave at most this often under a steady flow (replica.py)
    relay_interval_ms: float = 20.0
    # environment of the ingress replicas (the jobs store settings the CLI was given)
    ingress_env: dict[str, str] = field(default_factory=dict)
    api_keys: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict | None) -> BackendOptions:
        known = {k: v for k, v in (data or {}).items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def to_dict(self) -> dict:
        return asdict(self)


def deployment_name(pipeline: str, stage: str) -> str:
    return f"{pipeline}.{stage}"


def stage_options(spec: PipelineSpec, stage: str, opts: BackendOptions) -> dict[str, Any]:
    """Keyword arguments of `serve.deployment(...).options()` for one stage pool (plain JSON
    besides the router path, so config.py writes the same values)."""
    pool = spec.stages[stage].pool
    # the OpenMP settings of an embedded worker, in place before torch loads in the replica
    env = {**openmp_env(), "OMP_NUM_THREADS": str(pool.threads)}
    actor: dict[str, Any] = {
        "num_cpus": float(pool.threads) * opts.cpus_per_thread,
        "runtime_env": {"env_vars": env},
    }
    if any(d.startswith("cuda") for d in pool.devices):
        actor["num_gpus"] = 1
    if pool.resources:
        actor["resources"] = dict(pool.resources)
    scaling = pool.autoscaling
    out: dict[str, Any] = {
        "name": deployment_name(spec.name, stage),
        "ray_actor_options": actor,
        "max_ongoing_requests": STAGE_MAX_ONGOING,
    }
    if scaling:
        out["autoscaling_config"] = autoscaling_config(scaling)
    else:
        out["num_replicas"] = max(1, int(pool.replicas))
    return out


def autoscaling_config(scaling: dict[str, Any]) -> dict[str, Any]:
    """The pool's `autoscaling:` block in Serve's terms (validated by graph/fields.py)."""
    out = {k: scaling[k] for k in ("min_replicas", "max_replicas", "initial_replicas") if k in scaling}
    if "target_ongoing_requests" in scaling:
        out["target_ongoing_requests"] = scaling["target_ongoing_requests"]
    out["policy"] = {"policy_function": POLICY_PATH}  # scale on the requests engines hold
    return out


def ingress_options(opts: BackendOptions) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": opts.ingress_cpus}
    if opts.ingress_env:
        actor["runtime_env"] = {"env_vars": dict(opts.ingress_env)}
    return {
        "name": INGRESS,
        "num_replicas": opts.ingress_replicas,
        "ray_actor_options": actor,
        "max_ongoing_requests": INGRESS_MAX_ONGOING,
    }


@dataclass(frozen=True)
class Reservation:
    """What an application's replicas ask of Ray: pool threads (each reserving
    cpus_per_thread CPUs) at the replicas' starting count and at their largest (autoscaling's
    max_replicas), the ingress's CPUs, and GPUs and custom resources at the starting count."""

    threads: int
    max_threads: int
    ingress_cpus: float
    other: dict[str, float]

    def cpus(self, cpus_per_thread: float) -> float:
        return self.threads * cpus_per_thread + self.ingress_cpus


def reservation(specs: list[PipelineSpec], opts: BackendOptions) -> Reservation:
    """Read from the deployments' own options (stage_options), so it counts what they ask."""
    threads = max_threads = 0
    other: dict[str, float] = {}
    for spec in specs:
        for name, stage in spec.stages.items():
            deployment = stage_options(spec, name, opts)
            scaling = deployment.get("autoscaling_config")
            if scaling:  # Serve starts at initial_replicas, else min_replicas
                start = int(scaling.get("initial_replicas", scaling.get("min_replicas", 1)))
                most = int(scaling.get("max_replicas", start))
            else:
                start = most = deployment["num_replicas"]
            threads += stage.pool.threads * start
            max_threads += stage.pool.threads * max(start, most)
            actor = deployment["ray_actor_options"]
            needs = {**actor.get("resources", {}), **({"GPU": actor["num_gpus"]} if "num_gpus" in actor else {})}
            for resource, amount in needs.items():
                other[resource] = other.get(resource, 0.0) + float(amount) * start
    return Reservation(threads, max_threads, opts.ingress_cpus * opts.ingress_replicas, other)


def fitting_cpus_per_thread(res: Reservation, cpus: float) -> float:
    """The largest cpus_per_thread (in hundredths) at which every replica fits `cpus`, those
    an autoscaled pool may add included."""
    return int(100 * max(0.0, cpus - res.ingress_cpus) / max(1, res.max_threads)) / 100


def shortfall(res: Reservation, cluster: dict[str, float], opts: BackendOptions) -> str | None:
    """What to say when the replicas ask more than the cluster has (None: they fit)."""
    cpus = cluster.get("CPU", 0.0)
    if res.cpus(opts.cpus_per_thread) > cpus + 1e-9:
        fitting = fitting_cpus_per_thread(res, cpus)
        hint = f"--ray-cpus-per-thread {fitting:g}" if fitting > 0 else "fewer replicas"
        return (
            f"the application reserves {res.cpus(opts.cpus_per_thread):g} Ray CPUs ({res.threads} pool threads x "
            f"--ray-cpus-per-thread {opts.cpus_per_thread:g}, plus the ingress) and Ray has {cpus:g}: "
            f"the replicas that do not fit would wait to be scheduled forever. Try {hint}."
        )
    for name, need in sorted(res.other.items()):
        if need > cluster.get(name, 0.0) + 1e-9:
            what = "a cuda device" if name == "GPU" else f"the resource {name!r}"
            return (
                f"the application's replicas ask for {need:g} of {name} (pools with {what}) and Ray has "
                f"{cluster.get(name, 0.0):g}: those replicas would wait to be scheduled forever."
            )
    return None
