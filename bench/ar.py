"""`omnistage bench ar --json FILE [--quick]`: the ar_lm stage against transformers.

Workload: a random-weight Qwen2 model (hidden 512, 8 layers, 8 heads, 2 KV heads,
intermediate 1408, vocab 32000, untied, ~55M parameters, float32); 64 requests (fixed seed)
with prompts of 32..512 tokens and 16..256 output tokens, EOS ignored, all arriving at once.
Throughput counts each request's requested output tokens only, for every system.

Systems, each in its own process (so its peak RSS is its own) and on the same requests:
- omnistage: the real runtime (Pipeline with one ar_lm stage, threads=2); engine-direct only
  when the Pipeline cannot start (the JSON's `omnistage_mode` says which),
- hf_serial: transformers generate() one request at a time,
- hf_static: generate() on all requests as one left-padded batch (runs to the longest),
- hf_generate_batch: transformers continuous batching (ContinuousBatchingManager, default
  settings, per-request max_new_tokens), warm-up excluded.
Each figure is the median of `--runs` (default 3) timed passes with min and max.

Also: greedy tokens and logprobs of 8 requests against generate() (`checks.greedy_equal_hf`),
and the prefix cache: 64 sequential requests sharing a 384-token prefix (unique 32-token
suffix, 16 output tokens), TTFT p50 with the prefix cache over without (`ratios.prefix_ttft`).
`--quick` shrinks everything (small model, 8 requests, 1 run) for the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omnistage.runtime.openmp import openmp_env

SYSTEMS = ("omnistage", "hf_serial", "hf_static", "hf_generate_batch")
# Every system's processes get the same OpenMP wait settings: the runtime's bounded spin
# (runtime/openmp.py) unless the caller sets OMP_WAIT_POLICY / GOMP_SPINCOUNT itself.
OMP_ENV = openmp_env()
LOGPROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.05}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omnistage bench ar", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", dest="json_path", help="write the results here")
    p.add_argument("--quick", action="store_true", help="reduced run for smoke tests (< 60 s)")
    p.add_argument("--runs", type=int, help="timed passes per system (default 3; --quick 1)")
    p.add_argument("--model", choices=["55m", "quick", "0.5b"], help="model shape")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (default on CPU) or bfloat16")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every system")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of systems to run")
    p.add_argument("--requests", type=int, help="workload size (default 64; --quick 8)")
    p.add_argument(
        "--serial-requests",
        type=int,
        help="time hf_serial on the first K requests only (its throughput does not "
        "depend on the batch; the JSON says so)",
    )
    p.add_argument("--budget", type=int, default=2048, help="omnistage max_num_batched_tokens (per-step token budget)")
    p.add_argument(
        "--settle-s",
        type=float,
        help="idle seconds before each system's process (default 20; --quick 0): "
        "a virtual machine's host can stay busy for a while after a process frees GiBs, "
        "which slows whichever system runs next (docs/bench-ar.md)",
    )
    p.add_argument("--no-prefix", action="store_true", help="skip the prefix-cache part")
    p.add_argument(
        "--concurrency",
        metavar="LEVELS",
        help="also run omnistage with at most N requests in flight for each N of this comma list "
        "(e.g. 1,8,32,64), once per round; the JSON's concurrency_sweep holds the points",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw throughput and TPOT against concurrency into this PNG "
        "(runs the sweep at 1,8,32,64, or 1,4,8 with --quick, unless --concurrency is given)",
    )
    p.add_argument(
        "--engine-direct",
        action="store_true",
        help="measure omnistage's engine in-process instead of through the runtime",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    return _orchestrate(args, argv)


def _worker(args) -> int:
    from omnistage.bench.ar_common import write_json
    from omnistage.bench.ar_systems import run_system

    job = json.loads(Path(args.job).read_text())
    result = run_system(args.worker, job)
    write_json(args.out, result)
    return 0


def _make_job(args) -> tuple[dict, dict]:
    from omnistage.bench.ar_common import (
        SHAPES,
        build_bench_checkpoint,
        make_prefix_workload,
        make_workload,
    )

    quick = args.quick
    shape = SHAPES[args.model or ("quick" if quick else "55m")]
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    n = args.requests or (8 if quick else 64)
    prompt_range, output_range = ((16, 64), (8, 24)) if quick else ((32, 512), (16, 256))
    t0 = time.perf_counter()
    print(
        f"bench ar: building {shape.name} checkpoint ({shape.num_params() / 1e6:.1f}M params)",
        file=sys.stderr,
        flush=True,
    )
    checkpoint = build_bench_checkpoint(shape, dtype)
    print(f"bench ar: checkpoint ready in {time.perf_counter() - t0:.1f}s: {checkpoint}", file=sys.stderr, flush=True)
    workload = make_workload(n, prompt_range, output_range, shape.vocab_size, seed=0)
    n_check = 4 if quick else 8
    check_lens = [min(n_out, 8 if quick else 32) for n_out in workload.output_lens[:n_check]]
    job = {
        "checkpoint": str(checkpoint),
        "device": args.device,
        "dtype": dtype,
        "threads": args.threads,
        "runs": args.runs or (1 if quick else 3),
        "budget": args.budget,
        "engine_direct": args.engine_direct,
        "prompts": workload.prompts,
        "output_lens": workload.output_lens,
        "check_prompts": workload.prompts[:n_check],
        "check_output_lens": check_lens,
        "serial_requests": args.serial_requests,
        "hf_cb_overrides": {"num_blocks": 16, "max_batch_tokens": 256} if quick else {},
        "concurrency": _concurrency_levels(args),
    }
    prefix_desc = None
    if not args.no_prefix:
        pw = make_prefix_workload(
            8 if quick else 64, 64 if quick else 384, 8 if quick else 32, 4 if quick else 16, shape.vocab_size
        )
        job["prefix"] = {"prompts": pw.prompts, "output_len": pw.output_len}
        prefix_desc = {
            "requests": len(pw.prompts),
            "prefix_len": pw.prefix_len,
            "suffix_len": len(pw.prompts[0]) - pw.prefix_len,
            "output_len": pw.output_len,
            "arrival": "sequential",
            "cached": "one cache_salt shared by all requests (first one warms)",
            "uncached": "a unique cache_salt per request (no sharing)",
        }
    meta = {
        "model": {
            **shape.__dict__,
            "params_m": round(shape.num_params() / 1e6, 1),
            "dtype": dtype,
            "checkpoint": str(checkpoint),
            "init": "random, std 0.2",
        },
        "workload": {
            "requests": n,
            "prompt_len_range": list(prompt_range),
            "output_len_range": list(output_range),
            "seed": workload.seed,
            "eos": "ignored",
            "arrival": "all at once",
            "requested_output_tokens": workload.requested_tokens,
            "prompt_tokens": sum(len(p) for p in workload.prompts),
            "ttft_from": "workload arrival (includes queueing)",
        },
        "prefix_workload": prefix_desc,
    }
    return job, meta


def _concurrency_levels(args) -> list[int]:
    from omnistage.bench.ar_sweep import DEFAULT_LEVELS, parse_levels

    if args.concurrency:
        try:
            return parse_levels(args.concurrency)
        except ValueError as err:
            raise SystemExit(f"omnistage bench ar: {err}") from None
    if args.plot:
        return list(DEFAULT_LEVELS["quick" if args.quick else "full"])
    return []


def _run_subprocess(system: str, job_path: Path, out_path: Path, timeout: float) -> dict:
    """Run one system in its own process; its progress lines pass through to our stderr."""
    cmd = [
        sys.executable,
        "-m",
        "omnistage.bench.ar",
        "--worker",
        system,
        "--job",
        str(job_path),
        "--out",
        str(out_path),
    ]
    env = {**os.environ, "PYTHONSAFEPATH": "1", "TOKENIZERS_PARALLELISM": "false", **OMP_ENV}
    t0 = time.perf_counter()
    tail: list[str] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            tail = (tail + [line])[-60:]
            if line.startswith("bench ar:"):
                print(line, end="", file=sys.stderr, flush=True)
            if time.perf_counter() - t0 > timeout:
                proc.kill()
        proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.returncode != 0 or not out_path.exists():
        return {"error": f"exit {proc.returncode}: {''.join(tail)[-3000:]}"}
    result = json.loads(out_path.read_text())
    result["process_wall_s"] = time.perf_counter() - t0
    return result


def _orchestrate(args, argv: list[str]) -> int:
    from omnistage.bench.ar_common import write_json

    started = time.time()
    load_start = os.getloadavg()
    job, meta = _make_job(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    settle_s = args.settle_s if args.settle_s is not None else (0.0 if args.quick else 20.0)
    results, sequence = _run_rounds(job, systems, settle_s, timeout=300 if args.quick else 3600)
    out = {
        "bench": "ar",
        "quick": args.quick,
        "command": " ".join(["omnistage", "bench", "ar", *argv]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "device": args.device,
            "threads": args.threads,
            "env": OMP_ENV,
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
        },
        "rounds": {
            "count": job["runs"],
            "order": "every system once per round, each in a fresh process; the order rotates by one system per round",
            "sequence": sequence,
            "settle_s": settle_s,
        },
        **meta,
        **_figures(results, job),
        "targets": {"vs_hf_serial": 6, "vs_hf_static": 2, "vs_hf_generate_batch": 5, "prefix_ttft_max": 0.2},
        "elapsed_s": time.time() - started,
    }
    if args.json_path:
        write_json(args.json_path, out)
    if args.plot and out.get("concurrency_sweep"):
        from omnistage.bench.plot import plot_ar

        plot_ar(out, args.plot)
    elif args.plot:
        print("bench ar: no concurrency sweep was measured; no plot drawn", file=sys.stderr)
    print(markdown_summary(out))
    print(f"omnistage measured through: {out.get('omnistage_mode')}")
    failed = [s for s, r in results.items() if "error" in r]
    return 1 if "omnistage" in failed else 0


def _run_rounds(job: dict, systems: list[str], settle_s: float, timeout: float) -> tuple[dict, list[list[str]]]:
    """Every system once per round, each in a fresh process; returns the merged results per
    system and the order they ran in.

    Interleaving makes a change in the machine's load hit every system alike, and rotating the
    order keeps a machine that slows under sustained load from charging it to whichever system
    always runs last. Round 0 also does the greedy check and the prefix-cache part. Before
    each system the machine idles settle_s, the same pause for every system: after a process
    frees GiBs (transformers' continuous batching) a VM's host can stay busy long enough to
    slow the next system's timed pass (docs/bench-ar.md, "Method").
    """
    results: dict[str, dict] = {}
    rounds = job["runs"]
    sequence: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-ar-") as tmp:
        for r in range(rounds):
            job_path = Path(tmp) / f"job{r}.json"
            job_path.write_text(json.dumps({**job, "runs": 1, "extras": r == 0, "prefix_runs": rounds}))
            sequence.append([])
            for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
                if "error" in results.get(system, {}):
                    continue
                if settle_s > 0 and (r > 0 or sequence[-1]):
                    time.sleep(settle_s)
                sequence[-1].append(system)
                print(f"bench ar: round {r + 1}/{rounds}: running {system} ...", file=sys.stderr, flush=True)
                res = _run_subprocess(system, job_path, Path(tmp) / f"{system}{r}.json", timeout=timeout)
                _merge(results, system, res)
    return results, sequence


def _merge(results: dict[str, dict], system: str, res: dict) -> None:
    """Adds one round's result of `system` to `results` and reports it on stderr."""
    if "error" in res:
        print(f"bench ar: {system} FAILED: {res['error'][-800:]}", file=sys.stderr)
        results[system] = res
        return
    run = res["runs"][0]
    print(
        f"bench ar: {system}: {run['output_tok_s']:.1f} tok/s (ttft p50 "
        f"{run['ttft_ms_p50']:.0f} ms, tpot p50 {run['tpot_ms_p50']:.1f} ms, peak RSS "
        f"{res['peak_rss_mb']:.0f} MiB, {res['process_wall_s']:.0f}s)",
        file=sys.stderr,
        flush=True,
    )
    if system not in results:
        results[system] = res
        return
    merged = results[system]
    merged["runs"] += res["runs"]
    merged["sweeps"] = merged.get("sweeps", []) + res.get("sweeps", [])
    merged["peak_rss_mb"] = max(merged["peak_rss_mb"], res["peak_rss_mb"])


def _figures(results: dict[str, dict], job: dict) -> dict:
    """Per-system figures (median, min, max over rounds), the ratios, the prefix cache, the
    greedy check and the concurrency sweep."""
    from omnistage.bench.ar_common import aggregate, median_min_max

    out: dict = {"systems": {}, "ratios": {}}
    for system, res in results.items():
        if "error" in res:
            out["systems"][system] = {"error": res["error"]}
            continue
        entry = {**aggregate(res["runs"]), "peak_rss_mb": res["peak_rss_mb"], "settings": res.get("settings", {})}
        if system == "omnistage":
            entry["mode"] = res.get("mode")
            entry["engine_stats"] = res.get("engine_stats", {})
            out["omnistage_mode"] = res.get("mode")
        out["systems"][system] = entry

    def tok_s(system):
        return out["systems"].get(system, {}).get("output_tok_s", {}).get("median")

    omni = tok_s("omnistage")
    for key, base in (
        ("vs_hf_serial", "hf_serial"),
        ("vs_hf_static", "hf_static"),
        ("vs_hf_generate_batch", "hf_generate_batch"),
    ):
        out["ratios"][key] = omni / tok_s(base) if omni and tok_s(base) else None

    omni_res = results.get("omnistage", {})
    prefix = omni_res.get("prefix")
    out["ratios"]["prefix_ttft"] = None
    if prefix:
        out["prefix_cache"] = {
            "ttft_ms_p50_cached": median_min_max(prefix["cached"]),
            "ttft_ms_p50_uncached": median_min_max(prefix["uncached"]),
            "cached_prompt_share": median_min_max(prefix["cached_share"]),
        }
        un = out["prefix_cache"]["ttft_ms_p50_uncached"]["median"]
        out["ratios"]["prefix_ttft"] = out["prefix_cache"]["ttft_ms_p50_cached"]["median"] / un
    out["checks"] = _greedy_check(
        omni_res.get("greedy"),
        results.get("hf_serial", {}).get("greedy_reference"),
        LOGPROB_TOLERANCE.get(job["dtype"], 1e-3),
    )
    if omni_res.get("sweeps"):
        from omnistage.bench.ar_sweep import aggregate_sweeps

        out["concurrency_sweep"] = aggregate_sweeps(omni_res["sweeps"])
    return out


def markdown_summary(out: dict) -> str:
    """The results as markdown tables (what docs/bench-ar.md records)."""

    def fig(entry, key, fmt="{:.1f}"):
        f = entry.get(key)
        if not f:
            return "-"
        return f"{fmt.format(f['median'])} ({fmt.format(f['min'])}..{fmt.format(f['max'])})"

    lines = [
        "| system | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | peak RSS MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for system, entry in out["systems"].items():
        if "error" in entry:
            lines.append(f"| {system} | failed: {entry['error'][:80]} | | | | | |")
            continue
        lines.append(
            f"| {system} | {fig(entry, 'output_tok_s')} | {fig(entry, 'ttft_ms_p50', '{:.0f}')} | "
            f"{fig(entry, 'ttft_ms_p99', '{:.0f}')} | {fig(entry, 'tpot_ms_p50')} | "
            f"{fig(entry, 'tpot_ms_p99')} | {entry['peak_rss_mb']:.0f} |"
        )
    lines += ["", "| ratio | value | target |", "|---|---|---|"]
    targets = {"vs_hf_serial": ">= 6", "vs_hf_static": ">= 2", "vs_hf_generate_batch": ">= 5", "prefix_ttft": "<= 0.2"}
    for key, value in out["ratios"].items():
        lines.append(
            f"| {key} | {value:.2f} | {targets.get(key, '')} |"
            if value is not None
            else f"| {key} | - | {targets.get(key, '')} |"
        )
    pc = out.get("prefix_cache")
    if pc:
        lines += [
            "",
            f"prefix cache: TTFT p50 cached {fig(pc, 'ttft_ms_p50_cached')} ms, uncached "
            f"{fig(pc, 'ttft_ms_p50_uncached')} ms, cached share of prompt tokens "
            f"{fig(pc, 'cached_prompt_share', '{:.3f}')}",
        ]
    sweep = out.get("concurrency_sweep")
    if sweep:
        lines += [
            "",
            "| omnistage, requests in flight | output tok/s | TTFT p50 ms (from submission) | TPOT p50 ms |",
            "|---|---|---|---|",
        ]
        for point in sweep["points"]:
            lines.append(
                f"| {point['concurrency']} | {fig(point, 'output_tok_s')} | "
                f"{fig(point, 'ttft_ms_p50', '{:.0f}')} | {fig(point, 'tpot_ms_p50')} |"
            )
    lines += ["", f"checks: {json.dumps(out['checks'])}"]
    return "\n".join(lines)


def _greedy_check(ours, reference, tolerance: float) -> dict:
    if not ours or not reference:
        return {"greedy_equal_hf": None, "reason": "omnistage or hf_serial did not run"}
    tokens_equal = all(a["tokens"] == b["tokens"] for a, b in zip(ours, reference))
    diffs = [abs(x - y) for a, b in zip(ours, reference) for x, y in zip(a["logprobs"], b["logprobs"])]
    have_logprobs = all(len(a["logprobs"]) == len(a["tokens"]) for a in ours)
    max_diff = max(diffs) if diffs else None
    return {
        "greedy_equal_hf": bool(tokens_equal and have_logprobs and max_diff is not None and max_diff <= tolerance),
        "tokens_equal": tokens_equal,
        "max_logprob_abs_diff": max_diff,
        "logprob_tolerance": tolerance,
        "requests": len(ours),
        "tokens_compared": sum(len(a["tokens"]) for a in reference),
    }


if __name__ == "__main__":
    sys.exit(main())
