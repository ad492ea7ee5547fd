"""`omnistage bench diffusion --json FILE [--quick]`: step-level batching against diffusers.

Workloads, all on the fixed SD3-architecture benchmark model
(bench/diffusion_model.py), float32, CPU, CFG (guidance 4.5), 77 CLIP + 77 T5 tokens:

- saturation: 32 small (256x256) requests, steps uniform in 4..12, all submitted at once.
  Throughput of omnistage vs serial diffusers and vs the ideal bare batched loop.
- mixed traffic: 48 requests (2/3 small with 4 steps, 1/3 large 512x512 with 12 steps),
  seeded Poisson arrivals at 70% of the serial pipeline's capacity measured in this run;
  the same traces replayed to serial FIFO, request-level batching and omnistage.
- equality: 4 saturation requests, omnistage images vs serial diffusers images (1e-3).

omnistage runs through its real runtime (omnistage.Pipeline: orchestrator + one worker
process per stage, shared-memory tensors). Baselines run in this process with
torch.set_num_threads(2); omnistage's denoiser worker gets 2 threads, its text-encoder and
VAE workers 1 each (they are idle most of the time: see docs/bench-diffusion.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# libgomp reads this when torch loads. With the default (spin before sleeping), idle OpenMP
# threads burn CPU that a busy neighbour needs (docs/bench-diffusion.md). Every system here
# (this process and omnistage's workers, which inherit the environment) gets the same passive
# setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_OMP_POLICY_APPLIED_HERE = "torch" not in sys.modules

import torch  # noqa: E402

from omnistage.bench.diffusion_baselines import (  # noqa: E402
    GUIDANCE_SCALE,
    MAX_SEQUENCE_LENGTH,
    BenchRequest,
    RunResult,
    run_ideal,
    run_request_batching,
    run_serial,
    service_times,
)
from omnistage.bench.diffusion_model import (  # noqa: E402
    DENOISER_CONFIG,
    PROMPTS,
    bench_model_dir,
    load_reference_pipeline,
)
from omnistage.bench.diffusion_omnistage import run_omnistage, start_omnistage  # noqa: E402

SMALL, LARGE = 256, 512


@dataclass
class BenchConfig:
    quick: bool = False
    threads: int = 2
    # images per denoiser forward (x2 rows with CFG); the largest batch that keeps the
    # per-row speed on a small CPU (docs/bench-diffusion.md, "Batch size on CPU")
    max_batch_size: int = 4
    saturation_requests: int = 32
    saturation_steps: tuple[int, int] = (4, 12)
    saturation_repeats: int = 3
    mixed_requests: int = 48
    mixed_small_steps: int = 4
    mixed_large_steps: int = 12
    mixed_traces: int = 3
    load: float = 0.7
    capacity_samples: int = 3

    @classmethod
    def make(cls, quick: bool) -> BenchConfig:
        if not quick:
            return cls()
        return cls(
            quick=True,
            saturation_requests=4,
            saturation_steps=(1, 3),
            saturation_repeats=1,
            mixed_requests=6,
            mixed_small_steps=1,
            mixed_large_steps=2,
            mixed_traces=1,
            capacity_samples=1,
        )


LOADAVG: list[tuple[str, float]] = []


def log(msg: str) -> None:
    """Progress to stderr, with the machine's 1-minute load average (it is shared and noisy)."""
    import os

    load = os.getloadavg()[0]
    LOADAVG.append((msg, load))
    print(f"[bench diffusion {time.strftime('%H:%M:%S')} load {load:.1f}] {msg}", file=sys.stderr, flush=True)


# -- workloads ------------------------------------------------------------------------------


def saturation_requests(cfg: BenchConfig, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    lo, hi = cfg.saturation_steps
    return [
        BenchRequest(i, PROMPTS[i % len(PROMPTS)], 1000 + i, SMALL, rng.randint(lo, hi))
        for i in range(cfg.saturation_requests)
    ]


def mixed_trace(cfg: BenchConfig, rate_rps: float, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    n_large = cfg.mixed_requests // 3
    kinds = [LARGE] * n_large + [SMALL] * (cfg.mixed_requests - n_large)
    rng.shuffle(kinds)
    t = 0.0
    out = []
    for i, size in enumerate(kinds):
        steps = cfg.mixed_large_steps if size == LARGE else cfg.mixed_small_steps
        out.append(BenchRequest(i, PROMPTS[i % len(PROMPTS)], seed * 1000 + i, size, steps, arrival_s=t))
        t += rng.expovariate(rate_rps)
    return out


# -- figures --------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency_figures(result: RunResult) -> dict:
    lat = [r.latency_s * 1000 for r in result.records]
    wait = [r.queue_wait_s * 1000 for r in result.records]
    return {
        "latency_ms_p50": percentile(lat, 0.5),
        "latency_ms_p99": percentile(lat, 0.99),
        "queue_wait_ms_mean": statistics.fmean(wait),
        "wall_s": result.wall_s,
        "throughput_rps": len(result.records) / result.wall_s,
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def max_image_diff(a: RunResult, b: RunResult, count: int) -> float:
    worst = 0.0
    for ra, rb in list(zip(a.records, b.records))[:count]:
        worst = max(worst, (ra.image.float() - rb.image.float()).abs().max().item())
    return worst


def warm_up(ref, pipe, cfg: BenchConfig) -> None:
    small = BenchRequest(0, PROMPTS[0], 1, SMALL, 1)
    large = BenchRequest(1, PROMPTS[1], 2, LARGE, 1)
    run_serial(ref, [small, large])
    run_omnistage(pipe, [small, large])


def measure_capacity(ref, cfg: BenchConfig) -> dict:
    """Serial service time per request kind, then capacity on the 2/3 small + 1/3 large mix."""
    small = [BenchRequest(i, PROMPTS[i], 7 + i, SMALL, cfg.mixed_small_steps) for i in range(cfg.capacity_samples)]
    large = [BenchRequest(i, PROMPTS[i], 9 + i, LARGE, cfg.mixed_large_steps) for i in range(cfg.capacity_samples)]
    t_small = statistics.fmean(service_times(run_serial(ref, small)))
    t_large = statistics.fmean(service_times(run_serial(ref, large)))
    mean_service = (2 * t_small + t_large) / 3
    return {
        "service_s_small": t_small,
        "service_s_large": t_large,
        "mean_service_s": mean_service,
        "capacity_rps": 1.0 / mean_service,
        "arrival_rate_rps": cfg.load / mean_service,
    }


def run_benchmark(cfg: BenchConfig, partial_path: Path | None = None) -> dict:
    """All workloads; after each phase the figures so far go to `partial_path` (long runs)."""
    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    model_dir = bench_model_dir()
    log(f"model {model_dir}; quick={cfg.quick}; loading diffusers reference and starting omnistage")
    ref = load_reference_pipeline(model_dir, threads=cfg.threads)
    pipe = start_omnistage(model_dir, cfg)
    try:
        warm_up(ref, pipe, cfg)
        out: dict = {"bench": "diffusion", "config": _config_summary(cfg, model_dir)}
        runs, equal_diff = _saturation(ref, pipe, cfg)
        out["saturation"] = {name: {"throughput_rps": spread(v)} for name, v in runs.items()}
        _dump_partial(partial_path, out)
        cap = measure_capacity(ref, cfg)
        log(f"serial capacity {cap['capacity_rps']:.3f} rps; arrivals at {cap['arrival_rate_rps']:.3f} rps")
        traces = _mixed(
            ref,
            pipe,
            cfg,
            cap["arrival_rate_rps"],
            lambda t: _dump_partial(partial_path, {**out, "mixed_partial": {**cap, "traces": t}}),
        )
        out["mixed"] = {**cap, "traces": traces}
        out.update(_summary(runs, traces, equal_diff))
        out["elapsed_s"] = time.perf_counter() - t_start
        loads = [x for _, x in LOADAVG]
        out["machine_loadavg_1m"] = {"min": min(loads), "max": max(loads), "median": statistics.median(loads)}
        return out
    finally:
        pipe.close()


def _saturation(ref, pipe, cfg: BenchConfig) -> tuple[dict[str, list[float]], float | None]:
    """Throughput (rps) of every system per repeat, and omnistage's largest pixel difference
    from serial diffusers on the first 4 requests."""
    sat_requests = saturation_requests(cfg)
    runs: dict[str, list[float]] = {"serial": [], "request_batching": [], "ideal": [], "omnistage": []}
    equal_diff = None
    for rep in range(cfg.saturation_repeats):
        log(f"saturation {rep + 1}/{cfg.saturation_repeats}: {len(sat_requests)} requests")
        systems = {
            "serial": lambda: run_serial(ref, sat_requests),
            "request_batching": lambda: run_request_batching(ref, sat_requests, cfg.max_batch_size),
            "ideal": lambda: _in_thread(run_ideal, ref, sat_requests, cfg.max_batch_size),
            "omnistage": lambda: run_omnistage(pipe, sat_requests),
        }
        results = {}
        for name in _rotated(list(systems), rep):  # the machine drifts: vary who goes first
            results[name] = systems[name]()
        for name, res in results.items():
            runs[name].append(len(res.records) / res.wall_s)
        if equal_diff is None:
            equal_diff = max_image_diff(results["omnistage"], results["serial"], 4)
        log("  throughput rps: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in runs.items()))
    return runs, equal_diff


def _mixed(ref, pipe, cfg: BenchConfig, rate_rps: float, dump) -> list[dict]:
    """Each trace replayed to every system (the order rotating per trace); `dump(traces)` after
    each trace."""
    traces = []
    for k in range(cfg.mixed_traces):
        trace = mixed_trace(cfg, rate_rps, seed=100 + k)
        row = {
            "seed": 100 + k,
            "duration_s": trace[-1].arrival_s,
            "sizes": [r.size for r in trace],
            "latencies_ms": {},  # per request, in trace order: the CDF's data points
        }
        systems = {
            "serial": lambda t: run_serial(ref, t),
            "request_batching": lambda t: run_request_batching(ref, t, cfg.max_batch_size),
            "omnistage": lambda t: run_omnistage(pipe, t),
        }
        for name in _rotated(list(systems), k):
            log(
                f"mixed trace {k + 1}/{cfg.mixed_traces} ({len(trace)} requests over {trace[-1].arrival_s:.1f}s): {name}"
            )
            res = systems[name](trace)
            row[name] = latency_figures(res)
            if name == "omnistage":
                row[name]["step_ms_p50"] = res.extra["step_ms_p50"]
                row[name]["denoiser_queue_wait_ms_mean"] = res.extra["denoiser_queue_wait_ms_mean"]
            log("  " + ", ".join(f"{key} {val:.1f}" for key, val in row[name].items()))
            row["latencies_ms"][name] = [rec.latency_s * 1000 for rec in res.records]
        traces.append(row)
        dump(traces)
    return traces


def _summary(runs: dict[str, list[float]], traces: list[dict], equal_diff: float | None) -> dict:
    """Per-system figures (median, min, max over traces), ratios, checks and targets."""
    out: dict = {}

    def med(system: str, key: str) -> dict:
        return spread([t[system][key] for t in traces])

    for system in ("serial", "request_batching", "omnistage"):
        out[system] = {
            key: med(system, key)
            for key in ("latency_ms_p50", "latency_ms_p99", "queue_wait_ms_mean", "throughput_rps")
        }
        out[system]["saturation_throughput_rps"] = spread(runs[system])
    out["omnistage"]["step_ms_p50"] = med("omnistage", "step_ms_p50")
    out["omnistage"]["denoiser_queue_wait_ms_mean"] = med("omnistage", "denoiser_queue_wait_ms_mean")
    out["ideal"] = {"saturation_throughput_rps": spread(runs["ideal"])}

    def ratio(a: str, b: str, key: str) -> list[float]:
        return [t[a][key] / t[b][key] for t in traces]

    ratios = {
        "throughput_vs_serial": spread([o / s for o, s in zip(runs["omnistage"], runs["serial"])]),
        "throughput_vs_ideal": spread([o / i for o, i in zip(runs["omnistage"], runs["ideal"])]),
        "p50_latency_vs_serial": spread(ratio("omnistage", "serial", "latency_ms_p50")),
        "p50_latency_vs_request_batching": spread(ratio("omnistage", "request_batching", "latency_ms_p50")),
        "p99_latency_vs_serial": spread(ratio("omnistage", "serial", "latency_ms_p99")),
    }
    wait_vs_step = [t["omnistage"]["queue_wait_ms_mean"] / max(t["omnistage"]["step_ms_p50"], 1e-9) for t in traces]
    out["ratios"] = {k: v["median"] for k, v in ratios.items()}
    out["ratios_spread"] = ratios
    out["checks"] = {
        "equal_diffusers": bool(equal_diff is not None and equal_diff < 1e-3),
        "equal_diffusers_max_abs_diff": equal_diff,
        "equal_diffusers_requests": 4,
    }
    targets = {
        "throughput_vs_serial": (out["ratios"]["throughput_vs_serial"], ">=", 1.0),
        "throughput_vs_ideal": (out["ratios"]["throughput_vs_ideal"], ">=", 0.9),
        "p50_latency_vs_serial": (out["ratios"]["p50_latency_vs_serial"], "<=", 0.5),
        "p50_latency_vs_request_batching": (out["ratios"]["p50_latency_vs_request_batching"], "<=", 0.5),
        "p99_latency_vs_serial": (out["ratios"]["p99_latency_vs_serial"], "<=", 1.5),
        "queue_wait_ms_mean_vs_step_ms_p50": (statistics.median(wait_vs_step), "<=", 1.0),
    }
    out["targets"] = {
        k: {"value": v, "target": f"{op} {t}", "met": (v >= t if op == ">=" else v <= t)}
        for k, (v, op, t) in targets.items()
    }
    return out


def _dump_partial(path: Path | None, data: dict) -> None:
    if path is not None:
        path.write_text(json.dumps({"partial": True, **data}, indent=2, default=float))


def _in_thread(fn, *args):
    """Run fn in a fresh thread, as the serial and request-batching systems serve theirs."""
    import threading

    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _rotated(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


def _config_summary(cfg: BenchConfig, model_dir: Path) -> dict:
    return {
        "quick": cfg.quick,
        "threads": cfg.threads,
        "max_batch_size": cfg.max_batch_size,
        "denoiser": DENOISER_CONFIG,
        "dtype": "float32",
        "guidance_scale": GUIDANCE_SCALE,
        "text_tokens": {"clip": MAX_SEQUENCE_LENGTH, "t5": MAX_SEQUENCE_LENGTH},
        "sizes": {"small": SMALL, "large": LARGE},
        "model_dir": str(model_dir),
        "saturation": {
            "requests": cfg.saturation_requests,
            "steps": list(cfg.saturation_steps),
            "repeats": cfg.saturation_repeats,
        },
        "mixed": {
            "requests": cfg.mixed_requests,
            "small_steps": cfg.mixed_small_steps,
            "large_steps": cfg.mixed_large_steps,
            "traces": cfg.mixed_traces,
            "load": cfg.load,
        },
        "torch": torch.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "omp_wait_policy_applied_in_bench_process": _OMP_POLICY_APPLIED_HERE,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="omnistage bench diffusion", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", dest="json_path", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="reduced workloads (about a minute)")
    ap.add_argument("--max-batch-size", type=int, default=None)
    ap.add_argument("--traces", type=int, default=None)
    ap.add_argument("--saturation-repeats", type=int, default=None)
    ap.add_argument("--plot", metavar="FILE.png", help="draw the mixed-traffic latency CDF per system into this PNG")
    args = ap.parse_args(argv)
    cfg = BenchConfig.make(args.quick)
    if args.max_batch_size:
        cfg.max_batch_size = args.max_batch_size
    if args.traces:
        cfg.mixed_traces = args.traces
    if args.saturation_repeats:
        cfg.saturation_repeats = args.saturation_repeats
    partial = Path(args.json_path + ".partial") if args.json_path else None
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
    result = run_benchmark(cfg, partial)
    result["command"] = "omnistage bench diffusion " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(result, indent=2, default=float)
    if args.json_path:
        Path(args.json_path).write_text(text)
    if args.plot:
        from omnistage.bench.plot import plot_diffusion

        plot_diffusion(result, args.plot)
    print(
        json.dumps(
            {
                "ratios": result["ratios"],
                "checks": result["checks"],
                "targets": {k: v["met"] for k, v in result["targets"].items()},
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
