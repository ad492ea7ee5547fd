"""The omnistage system of the AR benchmark: the real runtime (Pipeline with one ar_lm stage).

Falls back to driving the stage's LLMEngine in-process when the Pipeline cannot start (the
result's `mode` says which). Besides the timed runs, round 0 records the greedy-check
tokens and logprobs and the prefix-cache figures, and every round runs the concurrency sweep
when the job asks for one (bench/ar_sweep.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

import torch

from omnistage.bench.ar_common import RunMetrics, percentile, tpot, tree_peak_rss_mb

PIPELINE_YAML = """\
name: bench-ar
inputs: {{tokens: tokens}}
outputs: {{tokens: tokens, info: json}}
stages:
  llm:
    kind: ar_lm
    model: {checkpoint}
    pool: {{devices: [{device}], threads: {threads}, dtype: {dtype}}}
    batching: {{policy: continuous, max_num_batched_tokens: {budget}, max_num_seqs: {max_seqs}}}
    params: {{block_size: {block_size}, num_kv_blocks: {num_kv_blocks}, max_model_len: {max_model_len}}}
edges:
  - {{from: inputs.tokens, to: llm.tokens}}
  - {{from: llm.tokens, to: outputs.tokens, stream: true}}
  - {{from: llm.info, to: outputs.info}}
"""


def omnistage_settings(job: dict) -> dict:
    longest = max(len(p) + n for p, n in zip(job["prompts"], job["output_lens"]))
    block = 16
    blocks = sum(-(-(len(p) + n) // block) for p, n in zip(job["prompts"], job["output_lens"]))
    return {
        "checkpoint": job["checkpoint"],
        "device": job["device"],
        "dtype": job["dtype"],
        "threads": job["threads"],
        "budget": job.get("budget", 2048),
        "max_seqs": max(len(job["prompts"]), 1),
        "block_size": block,
        "num_kv_blocks": int(blocks * 1.25) + 64,
        "max_model_len": max(longest, 1024),
    }


class _PipelineDriver:
    """Submits requests through omnistage.Pipeline.stream and times their token chunks."""

    mode = "pipeline"

    def __init__(self, job: dict, settings: dict):
        from omnistage import Pipeline

        self._tmp = tempfile.TemporaryDirectory()
        path = Path(self._tmp.name) / "bench-ar.yaml"
        path.write_text(PIPELINE_YAML.format(**settings))
        self.pipeline = Pipeline.from_yaml(str(path))

    async def one(self, prompt, params, t0, gate) -> dict:
        first = last = None
        tokens, info = [], None
        async with gate:
            submitted = time.perf_counter()
            async for chunk in self.pipeline.stream({"tokens": list(prompt)}, {"llm": params}):
                if chunk.port == "tokens" and chunk.data is not None and len(chunk.data):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    data = chunk.data
                    tokens.extend(data.tolist() if hasattr(data, "tolist") else data)
                elif chunk.port == "info" and chunk.data is not None:
                    info = chunk.data
        return {
            "first": first - t0,
            "last": last - t0,
            "count": len(tokens),
            "info": info,
            "tokens": tokens,
            "t_first": first,
            "t_last": last,
            "t_submit": submitted,
        }

    def run_all(self, prompts, params_list, concurrency: int | None = None) -> tuple[list[dict], float, float]:
        """All requests at once, or at most `concurrency` in flight (the next one is submitted
        when one finishes)."""

        async def go():
            gate = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
            t0 = time.perf_counter()
            res = await asyncio.gather(*(self.one(p, q, t0, gate) for p, q in zip(prompts, params_list)))
            return res, t0, time.perf_counter()

        return asyncio.run(go())

    def stats(self) -> dict:
        try:
            return self.pipeline.stage_stats().get("llm", {})
        except Exception:  # noqa: BLE001 - stats are informative only
            return {}

    def close(self):
        self.pipeline.close()
        self._tmp.cleanup()


class _EngineDriver:
    """Fallback: drives the ar_lm stage's LLMEngine in this process (no runtime)."""

    mode = "engine-direct"

    def __init__(self, job: dict, settings: dict):
        from omnistage.stages.ar import EngineConfig, LLMEngine

        torch.set_num_threads(settings["threads"])
        self.engine = LLMEngine(
            EngineConfig(
                model_path=settings["checkpoint"],
                dtype=getattr(torch, settings["dtype"]),
                device=settings["device"],
                block_size=settings["block_size"],
                num_kv_blocks=settings["num_kv_blocks"],
                max_num_batched_tokens=settings["budget"],
                max_num_seqs=settings["max_seqs"],
                max_model_len=settings["max_model_len"],
            )
        )
        self._n = 0

    def run_all(self, prompts, params_list):
        from omnistage.stages.ar import SamplingParams

        t0 = time.perf_counter()
        state = {}
        for prompt, params in zip(prompts, params_list):
            rid = f"e{self._n}"
            self._n += 1
            p = dict(params)
            salt = p.pop("cache_salt", None)
            self.engine.add_request(rid, list(prompt), SamplingParams.from_dict(p), cache_salt=salt)
            state[rid] = {"first": None, "last": None, "count": 0, "logprobs": [], "info": None}
        order = list(state)
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            now = time.perf_counter()
            for o in outs:
                s = state[o.request_id]
                if o.new_token_ids:
                    s["first"] = s["first"] if s["first"] is not None else now
                    s["last"] = now
                    s["count"] += len(o.new_token_ids)
                    if o.new_logprobs:
                        s["logprobs"] += [{"logprob": lp[t]} for t, lp in zip(o.new_token_ids, o.new_logprobs)]
                    s.setdefault("tokens", []).extend(o.new_token_ids)
                if o.finished:
                    s["info"] = {
                        "usage": {"prompt_tokens": o.num_prompt_tokens, "cached_tokens": o.num_cached_tokens},
                        "logprobs": s["logprobs"],
                        "tokens": s.get("tokens", []),
                    }
        res = []
        for rid in order:
            s = state[rid]
            res.append(
                {
                    "first": s["first"] - t0,
                    "last": s["last"] - t0,
                    "count": s["count"],
                    "info": s["info"],
                    "tokens": s.get("tokens", []),
                    "t_first": s["first"],
                    "t_last": s["last"],
                }
            )
        return res, t0, time.perf_counter()

    def stats(self):
        return self.engine.stats()

    def close(self):
        pass


def run_omnistage(job: dict) -> dict:
    settings = omnistage_settings(job)
    driver = None
    if not job.get("engine_direct"):
        try:
            driver = _PipelineDriver(job, settings)
        except Exception as exc:  # noqa: BLE001 - fall back, and say so in the JSON
            fallback_reason = f"{type(exc).__name__}: {exc}"
            print(f"bench ar: Pipeline unavailable ({fallback_reason}); measuring engine-direct", flush=True)
    if driver is None:
        driver = _EngineDriver(job, settings)
    try:
        return _omnistage_measure(driver, job, settings)
    finally:
        driver.close()


def _omnistage_measure(driver, job: dict, settings: dict) -> dict:
    prompts, outs = job["prompts"], job["output_lens"]

    def params(n, salt, **extra):
        return {"max_tokens": n, "temperature": 0.0, "ignore_eos": True, "cache_salt": salt, **extra}

    # warm-up (excluded): a few requests of the workload's shapes
    driver.run_all(prompts[:4], [params(min(8, n), "warmup") for n in outs[:4]])
    runs = []
    for r in range(job["runs"]):
        # a fresh cache salt per run, so a run never hits the previous run's identical prompts
        res, t0, t_end = driver.run_all(prompts, [params(n, f"run{r}") for n in outs])
        got = [x["count"] for x in res]
        if got != list(outs):
            raise RuntimeError(f"omnistage returned {got[:8]}... tokens, asked {outs[:8]}...")
        metrics = RunMetrics(t_end - t0, sum(got))
        for x, n in zip(res, outs):
            metrics.ttft_s.append(x["first"])
            if (v := tpot(x["t_first"], x["t_last"], n)) is not None:
                metrics.tpot_s.append(v)
        runs.append(metrics.summary())
        print(f"bench ar: omnistage run {r + 1}/{job['runs']}: {metrics.tok_s:.1f} tok/s", flush=True)

    if not job.get("extras", True):
        sweep = _sweep(driver, job)
        return {
            "runs": runs,
            "sweeps": [sweep] if sweep else [],
            "peak_rss_mb": tree_peak_rss_mb(),
            "mode": driver.mode,
            "settings": settings,
        }
    # greedy check requests: tokens + logprobs
    res, _, _ = driver.run_all(job["check_prompts"], [params(n, "check", logprobs=0) for n in job["check_output_lens"]])
    greedy = []
    for x in res:
        info = x["info"] or {}
        lps = info.get("logprobs") or []
        greedy.append({"tokens": x["tokens"], "logprobs": [e["logprob"] for e in lps]})

    prefix = _prefix_part(driver, job) if job.get("prefix") else None
    sweep = _sweep(driver, job)
    stats = driver.stats()
    return {
        "runs": runs,
        "sweeps": [sweep] if sweep else [],
        "peak_rss_mb": tree_peak_rss_mb(),
        "greedy": greedy,
        "prefix": prefix,
        "mode": driver.mode,
        "settings": settings,
        "engine_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
    }


def _sweep(driver, job: dict) -> list[dict] | None:
    if not job.get("concurrency"):
        return None
    if driver.mode != "pipeline":
        print("bench ar: the concurrency sweep needs the Pipeline; skipped", flush=True)
        return None
    from omnistage.bench.ar_sweep import run_sweep

    return run_sweep(driver, job)


def _prefix_part(driver, job: dict) -> dict:
    """Sequential requests sharing a long prefix: TTFT with the prefix cache vs without."""
    spec = job["prefix"]
    prompts, n = spec["prompts"], spec["output_len"]
    result = {"cached": [], "uncached": [], "cached_share": []}
    for r in range(job.get("prefix_runs", job["runs"])):
        for mode in ("uncached", "cached"):
            ttfts, cached, total = [], 0, 0
            for i, prompt in enumerate(prompts):
                # cached: one salt, so every request after the first reuses the prefix blocks;
                # uncached: a unique salt per request, so nothing is ever shared.
                salt = f"prefix{r}" if mode == "cached" else f"prefix{r}-{i}"
                (x,), t0, _ = driver.run_all(
                    [prompt], [{"max_tokens": n, "temperature": 0.0, "ignore_eos": True, "cache_salt": salt}]
                )
                usage = (x["info"] or {}).get("usage", {})
                if i > 0:  # the first request warms the cache
                    ttfts.append(x["first"])
                    cached += usage.get("cached_tokens", 0)
                    total += usage.get("prompt_tokens", len(prompt))
            result[mode].append(percentile(ttfts, 50) * 1e3)
            if mode == "cached":
                result["cached_share"].append(cached / max(total, 1))
    return result
