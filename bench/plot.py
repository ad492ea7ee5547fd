"""`omnistage bench plot RESULT.json -o FILE.png`: a benchmark result's main curve as a PNG.

- `bench ar` (run with `--concurrency`): omnistage's output throughput and TPOT p50 against
  the number of requests in flight, the transformers baselines as horizontal lines;
- `bench diffusion`: the latency CDF of every system under mixed traffic (all traces pooled);
- `bench runtime`: the histogram of stage-to-stage hop latencies (all runs' samples), with the
  bare pipe hop measured in the same run beside it.

Each benchmark also takes `--plot FILE.png` to draw its figure right after the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

# One fixed colour per series, so figures from different runs read alike (and tests can
# find every series in the image).
SERIES_COLORS = {
    "omnistage": "#1f77b4",
    "hf_serial": "#ff7f0e",
    "hf_static": "#2ca02c",
    "hf_generate_batch": "#d62728",
    "serial": "#ff7f0e",
    "request_batching": "#2ca02c",
    "pipe_hop": "#9467bd",
}
SERIES_LABELS = {
    "omnistage": "omnistage",
    "hf_serial": "transformers generate(), serial",
    "hf_static": "transformers generate(), one static batch",
    "hf_generate_batch": "transformers continuous batching",
    "serial": "diffusers, serial FIFO",
    "request_batching": "diffusers, request-level batching",
}


class PlotDataError(ValueError):
    """The result JSON lacks the data points the figure needs."""


def result_kind(result: dict) -> str:
    """Which benchmark wrote `result` ('ar', 'diffusion' or 'runtime')."""
    kind = result.get("bench")
    if kind in ("ar", "diffusion", "runtime"):
        return kind
    if "hop_us_p50" in result:
        return "runtime"
    if "mixed" in result and "saturation" in result:
        return "diffusion"
    raise PlotDataError("not a result of omnistage bench ar, diffusion or runtime")


def _figure(ncols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4 * ncols, 4.4), dpi=100, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, axes


def _caption(result: dict, width: int = 100) -> str:
    command = result.get("command") or ""
    quick = result.get("quick") or result.get("config", {}).get("quick") or result.get("settings", {}).get("quick")
    text = command + ("  [--quick: a smoke run, not a measurement]" if quick else "")
    return textwrap.fill(text, width)


def plot_ar(result: dict, path: str | Path) -> None:
    sweep = result.get("concurrency_sweep") or {}
    points = sweep.get("points") or []
    if not points:
        raise PlotDataError(
            "this bench ar result has no concurrency sweep: run it with --concurrency 1,8,32,64 (or --plot)"
        )
    levels = [p["concurrency"] for p in points]
    fig, (ax_tput, ax_tpot) = _figure(2)
    color = SERIES_COLORS["omnistage"]
    for ax, key, ylabel in (
        (ax_tput, "output_tok_s", "output tokens / s"),
        (ax_tpot, "tpot_ms_p50", "TPOT p50 (ms)"),
    ):
        med = [p[key]["median"] for p in points]
        low = [p[key]["median"] - p[key]["min"] for p in points]
        high = [p[key]["max"] - p[key]["median"] for p in points]
        ax.errorbar(levels, med, yerr=[low, high], color=color, marker="o", lw=2, capsize=4, label="omnistage")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("requests in flight (concurrency)")
        ax.set_ylabel(ylabel)
    for system in ("hf_serial", "hf_static", "hf_generate_batch"):
        entry = result.get("systems", {}).get(system, {})
        if "output_tok_s" in entry:
            ax_tput.axhline(
                entry["output_tok_s"]["median"],
                color=SERIES_COLORS[system],
                ls="--",
                lw=2,
                label=f"{SERIES_LABELS[system]} (whole workload at once)",
            )
    ax_tput.set_ylim(bottom=0)
    ax_tpot.set_ylim(bottom=0)
    ax_tput.legend(fontsize=8)
    ax_tput.set_title("throughput (median of rounds, min..max)")
    ax_tpot.set_title("time per output token")
    fig.suptitle(_caption(result, 200), fontsize=8)
    _save(fig, path)


def _save(fig, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot_diffusion(result: dict, path: str | Path) -> None:
    traces = result.get("mixed", {}).get("traces") or []
    pooled: dict[str, list[float]] = {}
    for trace in traces:
        for system, values in (trace.get("latencies_ms") or {}).items():
            pooled.setdefault(system, []).extend(values)
    if not pooled:
        raise PlotDataError("this bench diffusion result has no per-request mixed-traffic latencies")
    fig, (ax,) = _figure()
    for system, values in pooled.items():
        xs, ys = _cdf([v / 1000.0 for v in values])
        ax.step(xs, ys, where="post", color=SERIES_COLORS[system], lw=2, label=SERIES_LABELS.get(system, system))
    ax.set_xscale("log")
    _plain_log_ticks(ax)
    ax.set_xlabel("latency, arrival to image (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"mixed traffic: {len(traces)} trace(s), {len(next(iter(pooled.values())))} requests per system")
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(_caption(result), fontsize=8)
    _save(fig, path)


def plot_runtime(result: dict, path: str | Path) -> None:
    samples = result.get("samples") or {}
    hops = samples.get("hop_us") or []
    if not hops:
        raise PlotDataError("this bench runtime result has no hop samples")
    pipe = samples.get("pipe_hop_us") or []
    fig, (ax,) = _figure()
    lo, hi = min(hops + pipe), max(hops + pipe)
    bins = _log_bins(lo, hi, 60)
    ax.hist(hops, bins=bins, histtype="step", lw=2, color=SERIES_COLORS["omnistage"], label="omnistage stage hop")
    if pipe:
        ax.hist(pipe, bins=bins, histtype="step", lw=2, color=SERIES_COLORS["pipe_hop"], label="bare pipe hop")
    for q, style in ((0.5, "-"), (0.99, ":")):
        value = sorted(hops)[min(len(hops) - 1, round(q * (len(hops) - 1)))]
        ax.axvline(
            value, color=SERIES_COLORS["omnistage"], ls=style, lw=1, label=f"hop p{round(q * 100)} {value:.0f} us"
        )
    ax.set_xscale("log")
    _plain_log_ticks(ax)
    ax.set_xlabel("one-way latency (us)")
    ax.set_ylabel("samples")
    ax.set_title(f"stage-to-stage hop, receiver idle ({len(hops)} samples)")
    ax.legend(fontsize=8)
    fig.suptitle(_caption(result), fontsize=8)
    _save(fig, path)


def _plain_log_ticks(ax) -> None:
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _log_bins(lo: float, hi: float, count: int) -> list[float]:
    lo, hi = max(lo, 1e-3) * 0.95, max(hi, lo) * 1.05
    ratio = (hi / lo) ** (1.0 / count)
    return [lo * ratio**i for i in range(count + 1)]


PLOTTERS = {"ar": plot_ar, "diffusion": plot_diffusion, "runtime": plot_runtime}


def plot_result(result: dict, path: str | Path) -> None:
    """Draw `result`'s main curve into the PNG file `path`."""
    PLOTTERS[result_kind(result)](result, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnistage bench plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a JSON file written by omnistage bench ar|diffusion|runtime --json")
    ap.add_argument("-o", "--output", required=True, help="the PNG file to write")
    args = ap.parse_args(argv)
    try:
        result = json.loads(Path(args.result).read_text())
        plot_result(result, args.output)
    except (OSError, json.JSONDecodeError, PlotDataError) as err:
        print(f"omnistage bench plot: {args.result}: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
