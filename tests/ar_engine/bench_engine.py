"""Quick engine-vs-transformers throughput probe (not a test; the official one is `omnistage bench ar`).

    PYTHONSAFEPATH=1 .venv/bin/python tests/ar_engine/bench_engine.py [--requests 64] [--hf serial,static] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch


def build_model(path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=4096, initializer_range=0.2,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf", default="")
    ap.add_argument("--model", default="/tmp/omnistage-bench-ar-55m")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    build_model(args.model)
    rng = random.Random(0)
    reqs = [([rng.randrange(32000) for _ in range(rng.randint(32, 512))], rng.randint(16, 256)) for _ in range(args.requests)]
    total_out = sum(o for _, o in reqs)

    from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(EngineConfig(model_path=args.model, max_num_batched_tokens=args.budget, max_num_seqs=64,
                                 max_model_len=1024, enable_prefix_caching=False))
    # warm-up
    eng.add_request("w", list(range(40)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(reqs):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
    steps = 0
    prof = None
    if args.profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    if prof is not None:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    dt = time.perf_counter() - t0
    print(f"omnistage: {total_out} tokens in {dt:.1f}s = {total_out / dt:.1f} tok/s, {steps} steps")

    if args.hf:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        if "serial" in args.hf:
            t0 = time.perf_counter()
            n = min(len(reqs), 8)
            toks = 0
            for p, o in reqs[:n]:
                m.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=o,
                           min_new_tokens=o, do_sample=False)
                toks += o
            dt = time.perf_counter() - t0
            print(f"hf serial (first {n}): {toks / dt:.1f} tok/s")


if __name__ == "__main__":
    main()
