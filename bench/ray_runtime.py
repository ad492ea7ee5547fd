"""`omnistage bench runtime --backend ray [--quick] [--runs N] [--json FILE]`: the Ray Serve
backend against the embedded runtime, in the same run on the same machine.

Both run the same pipeline files at once (embedded: worker processes; Ray: the Serve
application `omnistage serve --backend ray` runs, driven from this process by a RayPipeline
over the stage deployments' handles), alternating per run:
- throughput: tiny-llm, `concurrency` requests at once (greedy, `max_tokens` each, EOS
  ignored), generated tokens per second; `ratios.ray_vs_embedded_throughput` = Ray / embedded.
  One wave takes a fraction of a second, so a run makes `waves` of each (embedded then Ray,
  then Ray then embedded, ...) and divides each side's tokens by its summed time. The generated tokens must
  be equal on both (the run fails otherwise).
- `ray.request_overhead_ms_p50`: p50 of `run()` through a one-stage no-op pipeline on Ray
  minus the same on the embedded runtime (one request at a time): what Serve's calls add.
- `ray.chunk_overhead_us_p50`: one streamed tiny-llm request at a time; (time from the first
  to the last token chunk on Ray - the same on embedded) / chunks: what relaying one chunk
  through the driver adds. p50 over the requests.
Each figure is the median over runs, with min and max.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGETS = {
    "ratios.ray_vs_embedded_throughput": (">=", 0.8),
    "ray.request_overhead_ms_p50": ("<=", 10.0),
}
APP = "omnistage-bench"
NOOP_YAML = """name: bench-noop
inputs: {x: any}
outputs: {y: any}
stages:
  a: {kind: noop, params: {inputs: {x: any}}, batching: {policy: dynamic, max_wait_ms: 0}}
edges:
  - {from: inputs.x, to: a.x}
  - {from: a.x, to: outputs.y}
"""
PROMPT = "the quick brown fox jumps over the lazy dog " * 2


def _summary(runs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def _p50(values: list[float]) -> float:
    return statistics.median(values)


def _wave(pipe, concurrency: int, max_tokens: int) -> tuple[float, list]:
    """`concurrency` requests at once: seconds until the last ends, and the tokens of each."""
    params = {"llm": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}}

    async def all_at_once():
        return await asyncio.gather(*(pipe.generate({"prompt": f"{i} {PROMPT}"}, params) for i in range(concurrency)))

    t0 = time.perf_counter()
    outs = asyncio.run(all_at_once())
    return time.perf_counter() - t0, [o["tokens"] for o in outs]


def _throughputs(embedded, remote, concurrency: int, max_tokens: int, waves: int) -> tuple[float, float]:
    """Tokens per second of each side over `waves` waves each, which side goes first
    alternating (what one side leaves running in the background falls on both alike)."""
    emb_total = ray_total = 0.0
    tokens = 0
    for wave in range(waves):
        if wave % 2 == 0:
            emb_s, emb_tokens = _wave(embedded, concurrency, max_tokens)
            ray_s, ray_tokens = _wave(remote, concurrency, max_tokens)
        else:
            ray_s, ray_tokens = _wave(remote, concurrency, max_tokens)
            emb_s, emb_tokens = _wave(embedded, concurrency, max_tokens)
        if ray_tokens != emb_tokens:
            raise RuntimeError("Ray Serve generated other tokens than the embedded runtime")
        emb_total += emb_s
        ray_total += ray_s
        tokens += sum(len(t) for t in emb_tokens)
    return tokens / emb_total, tokens / ray_total


def _run_ms(pipe, count: int) -> list[float]:
    for i in range(5):
        pipe.run({"x": i})
    times = []
    for i in range(count):
        t0 = time.perf_counter()
        out = pipe.run({"x": i})
        times.append((time.perf_counter() - t0) * 1000.0)
        if out["y"] != i:
            raise RuntimeError(f"bench-noop returned {out['y']!r} for {i}")
    return times


def _stream_spans(pipe, count: int, max_tokens: int) -> tuple[list[float], int]:
    """Per request: seconds from the first to the last token chunk; and chunks per request."""
    params = {"llm": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}}

    async def one() -> tuple[float, int]:
        stamps = []
        async for chunk in pipe.stream({"prompt": PROMPT}, params):
            if chunk.port == "tokens" and chunk.data:
                stamps.append(time.perf_counter())
        return stamps[-1] - stamps[0], len(stamps)

    spans, chunks = [], 0
    for _ in range(count):
        span, chunks = asyncio.run(one())
        spans.append(span)
    return spans, chunks


def _start_ray(configs: list[str]):
    import ray
    from ray import serve

    from omnistage.ray_serve.app import build_app

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    owned = not ray.is_initialized()
    if owned:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    # the replicas share the cores with the embedded workers, as every process here does
    args = {"configs": configs, "options": {"cpus_per_thread": 0.1}}
    serve.run(build_app(args), name=APP, route_prefix=None, blocking=False, logging_config={"enable_access_log": False})
    return owned


def _ray_pipeline(spec):
    from ray import serve

    from omnistage.ray_serve.options import deployment_name
    from omnistage.ray_serve.pipeline import RayPipeline

    handles = {s: serve.get_deployment_handle(deployment_name(spec.name, s), app_name=APP) for s in spec.stages}
    return RayPipeline.connect(spec, handles, APP, ready_timeout=600)


def run_bench(quick: bool = False, runs: int = 3, progress: bool = True) -> dict[str, Any]:
    import ray
    from ray import serve
    from tqdm import tqdm

    from omnistage.graph.loader import load_pipeline
    from omnistage.runtime.pipeline import Pipeline

    concurrency, max_tokens, waves = (4, 16, 1) if quick else (32, 64, 5)
    noop_requests, stream_requests = (20, 3) if quick else (200, 10)
    workdir = Path(tempfile.mkdtemp(prefix="omnistage-bench-ray-"))
    (workdir / "bench-noop.yaml").write_text(NOOP_YAML)
    configs = ["tiny-llm", str(workdir / "bench-noop.yaml")]
    specs = [load_pipeline(c) for c in configs]
    embedded = {s.name: Pipeline.from_spec(s, wait_ready=False) for s in specs}
    owned = _start_ray(configs)
    remote: dict[str, Any] = {}
    try:
        for p in embedded.values():
            p.wait_ready(600)
        remote = {s.name: _ray_pipeline(s) for s in specs}
        bar = tqdm(total=runs * 3, desc="bench runtime --backend ray", disable=not progress, file=sys.stderr)
        figures: dict[str, list[float]] = {k: [] for k in ("emb_tps", "ray_tps", "ratio", "req_ms", "chunk_us")}
        reference = {"embedded_run_ms_p50": [], "ray_run_ms_p50": [], "chunks_per_request": 0}
        for _ in range(runs):
            emb_tps, ray_tps = _throughputs(embedded["tiny-llm"], remote["tiny-llm"], concurrency, max_tokens, waves)
            figures["emb_tps"].append(emb_tps)
            figures["ray_tps"].append(ray_tps)
            figures["ratio"].append(ray_tps / emb_tps)
            bar.update()
            emb_ms = _p50(_run_ms(embedded["bench-noop"], noop_requests))
            ray_ms = _p50(_run_ms(remote["bench-noop"], noop_requests))
            reference["embedded_run_ms_p50"].append(emb_ms)
            reference["ray_run_ms_p50"].append(ray_ms)
            figures["req_ms"].append(ray_ms - emb_ms)
            bar.update()
            emb_spans, chunks = _stream_spans(embedded["tiny-llm"], stream_requests, max_tokens)
            ray_spans, ray_chunks = _stream_spans(remote["tiny-llm"], stream_requests, max_tokens)
            per_chunk = [(r - e) / max(1, chunks - 1) * 1e6 for r, e in zip(sorted(ray_spans), sorted(emb_spans))]
            figures["chunk_us"].append(_p50(per_chunk))
            reference["chunks_per_request"] = min(chunks, ray_chunks)
            bar.update()
        bar.close()
    finally:
        for p in [*remote.values(), *embedded.values()]:
            p.close(drain_timeout=5)
        serve.delete(APP)
        if owned:
            serve.shutdown()
            ray.shutdown()
    ratio, req, chunk = _summary(figures["ratio"]), _summary(figures["req_ms"]), _summary(figures["chunk_us"])
    result = {
        "bench": "runtime",
        "backend": "ray",
        "ratios": {"ray_vs_embedded_throughput": ratio["median"]},
        "ray": {
            "throughput_tok_s": statistics.median(figures["ray_tps"]),
            "request_overhead_ms_p50": req["median"],
            "chunk_overhead_us_p50": chunk["median"],
        },
        "embedded": {"throughput_tok_s": statistics.median(figures["emb_tps"])},
        "spread": {
            "ratios.ray_vs_embedded_throughput": ratio,
            "ray.request_overhead_ms_p50": req,
            "ray.chunk_overhead_us_p50": chunk,
            "ray.throughput_tok_s": _summary(figures["ray_tps"]),
            "embedded.throughput_tok_s": _summary(figures["emb_tps"]),
        },
        "reference": {
            "embedded_run_ms_p50": _summary(reference["embedded_run_ms_p50"]),
            "ray_run_ms_p50": _summary(reference["ray_run_ms_p50"]),
            "chunks_per_request": reference["chunks_per_request"],
        },
        "outputs_equal": True,  # checked every run: the bench fails otherwise
        "targets": {k: f"{op} {b}" for k, (op, b) in TARGETS.items()},
        "settings": {
            "quick": quick,
            "runs": runs,
            "concurrency": concurrency,
            "max_tokens": max_tokens,
            "waves_per_run": waves,
            "noop_requests_per_run": noop_requests,
            "stream_requests_per_run": stream_requests,
            "cpus": os.cpu_count(),
        },
    }
    result["meets_targets"] = {k: _meets(result, k) for k in TARGETS}
    return result


def _meets(result: dict, key: str) -> bool:
    group, name = key.split(".")
    op, bound = TARGETS[key]
    value = result[group][name]
    return value >= bound if op == ">=" else value <= bound
