"""The omnistage system at fixed numbers of requests in flight (`bench ar --concurrency`).

Each level replays the whole workload with at most `level` requests in flight: a client
submits the next request as soon as one finishes, so the stage sees a steady batch of that
size. TTFT here counts from each request's own submission (not the workload's arrival), so
it shows the engine's response at that load rather than the client's queue.
"""

from __future__ import annotations

from omnistage.bench.ar_common import RunMetrics, median_min_max, tpot

DEFAULT_LEVELS = {"quick": (1, 4, 8), "full": (1, 8, 32, 64)}


def parse_levels(text: str) -> list[int]:
    """'1,8,32,64' -> [1, 8, 32, 64] (positive integers, kept in the given order)."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency wants a comma list of positive integers, got {text!r}")
    return levels


def run_sweep(driver, job: dict) -> list[dict]:
    """One pass of the workload per level; returns the level's RunMetrics summary."""
    prompts, outs = job["prompts"], job["output_lens"]
    points = []
    for level in job["concurrency"]:
        # a salt of its own per level: no level reuses another's prompt blocks
        params = [
            {"max_tokens": n, "temperature": 0.0, "ignore_eos": True, "cache_salt": f"sweep{level}"} for n in outs
        ]
        res, t0, t_end = driver.run_all(prompts, params, concurrency=level)
        metrics = RunMetrics(t_end - t0, sum(x["count"] for x in res))
        for x, n in zip(res, outs):
            metrics.ttft_s.append(x["t_first"] - x["t_submit"])
            if (v := tpot(x["t_first"], x["t_last"], n)) is not None:
                metrics.tpot_s.append(v)
        points.append({"concurrency": level, **metrics.summary()})
        print(f"bench ar: omnistage at concurrency {level}: {metrics.tok_s:.1f} tok/s", flush=True)
    return points


def aggregate_sweeps(sweeps: list[list[dict]]) -> dict:
    """Per level, the median (min, max) over rounds of every figure."""
    points = []
    for per_round in zip(*sweeps):
        level = per_round[0]["concurrency"]
        keys = [k for k in per_round[0] if k != "concurrency"]
        points.append({"concurrency": level, **{k: median_min_max([p[k] for p in per_round]) for k in keys}})
    return {
        "system": "omnistage",
        "levels": [p["concurrency"] for p in points],
        "rounds": len(sweeps),
        "ttft_from": "each request's submission",
        "points": points,
    }
