"""The systems the AR benchmark measures, each run in its own process (see bench/ar.py):
the transformers baselines here, omnistage in bench/ar_omnistage.py.

Every runner takes the same job dict (checkpoint, workload, runs, ...) and returns a result
dict: per-run summaries, settings, peak RSS of its process tree, and extra outputs (greedy
tokens and logprobs for the correctness check, prefix-cache figures).

TTFT is measured from the moment the whole workload arrives (all requests at once), so a
serial system's TTFT includes the time its requests wait for the ones before them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from omnistage.bench.ar_common import (
    RunMetrics,
    tpot,
    tree_peak_rss_mb,
)
from omnistage.bench.ar_omnistage import run_omnistage


# -- transformers baselines ------------------------------------------------------------------
def _hf_model(job: dict):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        job["checkpoint"], dtype=getattr(torch, job["dtype"]), attn_implementation="sdpa"
    )
    return model.to(job["device"]).eval()


class _StepClock:
    """A stopping criterion that never stops: it records when each decoding step finished."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate(model, input_ids, attention_mask, max_new_tokens, clock=None, **kw):
    from transformers import StoppingCriteriaList

    return model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
        stopping_criteria=StoppingCriteriaList([clock]) if clock else None,
        **kw,
    )


def run_hf_serial(job: dict) -> dict:
    model = _hf_model(job)
    dev = job["device"]
    k = job.get("serial_requests") or len(job["prompts"])
    prompts, outs = job["prompts"][:k], job["output_lens"][:k]
    with torch.inference_mode():
        _generate(model, torch.tensor([prompts[0][:16]], device=dev), None, 4)  # warm-up
        runs = []
        for _ in range(job["runs"]):
            metrics = RunMetrics(0.0, 0)
            t0 = time.perf_counter()
            for prompt, n in zip(prompts, outs):
                clock = _StepClock()
                ids = torch.tensor([prompt], device=dev)
                metrics.output_tokens += _generate(model, ids, torch.ones_like(ids), n, clock).shape[1] - ids.shape[1]
                metrics.ttft_s.append(clock.times[0] - t0)
                if (v := tpot(clock.times[0], clock.times[n - 1], n)) is not None:
                    metrics.tpot_s.append(v)
            metrics.wall_s = time.perf_counter() - t0
            runs.append(metrics.summary())
        reference = _greedy_reference(model, job) if job.get("extras", True) else None
    return {
        "runs": runs,
        "peak_rss_mb": tree_peak_rss_mb(),
        "greedy_reference": reference,
        "settings": {
            "attn_implementation": "sdpa",
            "threads": torch.get_num_threads(),
            "requests_timed": k,
            "requested_output_tokens": sum(outs),
            "note": None
            if k == len(job["prompts"])
            else f"timed on the first {k} of {len(job['prompts'])} requests; TTFT counts "
            f"queueing behind those {k} only",
        },
    }


def _greedy_reference(model, job: dict) -> list[dict]:
    """Greedy tokens and their logprobs from generate() for the check requests."""
    out = []
    for prompt, n in zip(job["check_prompts"], job["check_output_lens"]):
        ids = torch.tensor([prompt], device=job["device"])
        res = _generate(model, ids, torch.ones_like(ids), n, output_logits=True, return_dict_in_generate=True)
        tokens = res.sequences[0, len(prompt) :].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(res.logits, tokens)]
        out.append({"tokens": tokens, "logprobs": logprobs})
    return out


def run_hf_static(job: dict) -> dict:
    model = _hf_model(job)
    dev = job["device"]
    prompts, outs = job["prompts"], job["output_lens"]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    with torch.inference_mode():
        _generate(model, ids[:2, -16:], mask[:2, -16:], 4)  # warm-up
        runs = []
        for _ in range(job["runs"]):
            clock = _StepClock()
            t0 = time.perf_counter()
            generated = _generate(model, ids, mask, max(outs), clock).shape[1] - width
            wall = time.perf_counter() - t0
            # every row runs to the longest; a request counts the tokens it asked for
            metrics = RunMetrics(wall, sum(min(n, generated) for n in outs))
            for n in outs:
                metrics.ttft_s.append(clock.times[0] - t0)
                if (v := tpot(clock.times[0], clock.times[n - 1], n)) is not None:
                    metrics.tpot_s.append(v)
            runs.append(metrics.summary())
    return {
        "runs": runs,
        "peak_rss_mb": tree_peak_rss_mb(),
        "settings": {
            "batch": len(prompts),
            "padded_prompt_len": width,
            "max_new_tokens": max(outs),
            "padding": "left",
            "attn_implementation": "sdpa",
            "threads": torch.get_num_threads(),
        },
    }


def run_hf_generate_batch(job: dict) -> dict:
    """transformers continuous batching (ContinuousBatchingManager), default settings."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = _hf_model(job)
    prompts, outs = job["prompts"], job["output_lens"]
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(outs), eos_token_id=-1, pad_token_id=0)
    # Default settings; --quick caps the cache (the default sizes it from free memory).
    cb_config = ContinuousBatchingConfig(**job.get("hf_cb_overrides", {}))
    runs, settings = [], {}
    for r in range(job["runs"]):
        # A fresh manager per run: its block sharing would otherwise hit on the previous
        # run's identical prompts.
        with model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=10
        ) as manager:
            _cb_collect(manager, [(f"warm{r}_{i}", prompts[i][:16], 4) for i in range(2)])
            t0 = time.perf_counter()
            results = _cb_collect(manager, [(f"r{r}_{i}", p, n) for i, (p, n) in enumerate(zip(prompts, outs))])
            wall = time.perf_counter() - t0
            metrics = RunMetrics(wall, sum(len(results[f"r{r}_{i}"].generated_tokens) for i in range(len(outs))))
            for i, n in enumerate(outs):
                ts = results[f"r{r}_{i}"].timestamps
                if len(results[f"r{r}_{i}"].generated_tokens) != n:
                    raise RuntimeError(
                        f"generate_batch returned {len(results[f'r{r}_{i}'].generated_tokens)} "
                        f"tokens for request {i}, asked {n}"
                    )
                metrics.ttft_s.append(ts[0] - t0)
                if (v := tpot(ts[0], ts[n - 1], n)) is not None:
                    metrics.tpot_s.append(v)
            runs.append(metrics.summary())
            cfg = manager.continuous_batching_config
            settings = {k: _plain(v) for k, v in vars(cfg).items()}
            settings["attn_implementation"] = str(model.config._attn_implementation)
    settings["threads"] = torch.get_num_threads()
    return {"runs": runs, "peak_rss_mb": tree_peak_rss_mb(), "settings": settings}


def _cb_collect(manager, requests):
    for rid, prompt, n in requests:
        manager.add_request(list(prompt), request_id=rid, max_new_tokens=n, record_timestamps=True, eos_token_id=-1)
    pending = {rid for rid, _, _ in requests}
    results = {}
    while pending:
        res = manager.get_result(timeout=1)
        if res is None:
            if not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped")
            continue
        if res.is_finished() and res.request_id in pending:
            if res.error:
                raise RuntimeError(f"generate_batch request failed: {res.error}")
            results[res.request_id] = res
            pending.discard(res.request_id)
    return results


def _plain(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


RUNNERS = {
    "omnistage": run_omnistage,
    "hf_serial": run_hf_serial,
    "hf_static": run_hf_static,
    "hf_generate_batch": run_hf_generate_batch,
}


def run_system(name: str, job: dict) -> dict:
    torch.set_num_threads(job["threads"])
    if job["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(job["device"]))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return RUNNERS[name](job)
