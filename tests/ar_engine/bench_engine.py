"""Quick engine-vs-transformers throughput probe (not a test; the official one is `omnistage bench ar`).

    OMP_WAIT_POLICY=PASSIVE PYTHONSAFEPATH=1 .venv/bin/python tests/ar_engine/bench_engine.py [--runs 3] [--threads 1]

Engine alone (no runtime) on the issue's workload (55M Qwen2, 64 requests, prompts 32..512,
outputs 16..256, EOS ignored, all at once) against transformers generate() one request at a
time on the first --serial-requests requests; throughput counts requested output tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch


def build_model(path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        initializer_range=0.2,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def run_engine(args, reqs) -> float:
    from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(
        EngineConfig(
            model_path=args.model,
            max_num_batched_tokens=args.budget,
            max_num_seqs=64,
            max_model_len=1024,
            enable_prefix_caching=False,
        )
    )
    eng.add_request("warmup", list(range(40)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(reqs):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    return sum(o for _, o in reqs) / (time.perf_counter() - t0)


def run_hf_serial(model, reqs) -> float:
    t0 = time.perf_counter()
    for p, o in reqs:
        model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=o,
            min_new_tokens=o,
            do_sample=False,
            pad_token_id=0,
        )
    return sum(o for _, o in reqs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--serial-requests", type=int, default=8, help="transformers serial runs the first N requests")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--model", default="/tmp/omnistage-bench-ar-55m")
    ap.add_argument("--budget", type=int, default=2048)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    build_model(args.model)
    rng = random.Random(0)
    reqs = [
        ([rng.randrange(32000) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(args.requests)
    ]
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        run_hf_serial(hf, [(list(range(40)), 4)])  # warm-up
    ours, theirs = [], []
    for r in range(args.runs):
        ours.append(run_engine(args, reqs))
        if hf is not None:
            with torch.no_grad():
                theirs.append(run_hf_serial(hf, reqs[: args.serial_requests]))
        print(
            f"run {r}: omnistage {ours[-1]:.1f} tok/s" + (f", hf serial {theirs[-1]:.1f} tok/s" if theirs else ""),
            flush=True,
        )

    def fmt(xs):
        return f"median {statistics.median(xs):.1f} (min {min(xs):.1f}, max {max(xs):.1f}) tok/s"

    print("omnistage engine:", fmt(ours))
    if theirs:
        print(f"transformers serial generate (first {args.serial_requests} requests):", fmt(theirs))
        ratios = [a / b for a, b in zip(ours, theirs)]
        print(f"ratio per run: median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
