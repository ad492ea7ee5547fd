"""`omnistage bench ar_engine [--runs N] [--threads N] [--quick]`: the LLMEngine alone.

A profiling probe, not the official figure (that is `omnistage bench ar`, through the
runtime): the engine in this process, no runtime, on the AR benchmark's workload (the 55M
Qwen2 checkpoint, 64 requests, prompts 32..512, outputs 16..256, EOS ignored, all submitted
at once), alternating with transformers `generate()` one request at a time on the first
`--serial-requests` requests. Throughput counts requested output tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from omnistage.bench.ar_common import SHAPES, build_bench_checkpoint, make_workload


def run_engine(checkpoint: str, requests, budget: int) -> float:
    """One pass of the whole workload through a fresh engine; returns output tokens / s."""
    from omnistage.stages.ar import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model_path=checkpoint,
            max_num_batched_tokens=budget,
            max_num_seqs=max(len(requests), 1),
            max_model_len=1024,
            enable_prefix_caching=False,
        )
    )
    engine.add_request("warmup", list(range(40)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    t0 = time.perf_counter()
    for i, (prompt, n_out) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return sum(n for _, n in requests) / (time.perf_counter() - t0)


def run_hf_serial(model, requests) -> float:
    """transformers generate() one request at a time; returns output tokens / s."""
    t0 = time.perf_counter()
    for prompt, n_out in requests:
        model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n_out,
            min_new_tokens=n_out,
            do_sample=False,
            pad_token_id=0,
        )
    return sum(n for _, n in requests) / (time.perf_counter() - t0)


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.1f} (min {min(values):.1f}, max {max(values):.1f})"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="omnistage bench ar_engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 requests, 1 run (smoke test)")
    ap.add_argument("--requests", type=int, help="workload size (default 64; --quick 8)")
    ap.add_argument("--serial-requests", type=int, default=8, help="transformers serial runs the first N requests")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--runs", type=int, help="timed passes (default 3; --quick 1)")
    ap.add_argument("--no-hf", action="store_true", help="time the engine only")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = SHAPES["quick" if args.quick else "55m"]
    checkpoint = str(build_bench_checkpoint(shape, "float32"))
    n = args.requests or (8 if args.quick else 64)
    prompt_range, output_range = ((16, 64), (8, 24)) if args.quick else ((32, 512), (16, 256))
    workload = make_workload(n, prompt_range, output_range, shape.vocab_size, seed=0)
    requests = list(zip(workload.prompts, workload.output_lens))
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        with torch.inference_mode():
            run_hf_serial(hf, [(list(range(40)), 4)])  # warm-up
    ours, theirs = [], []
    for r in range(args.runs or (1 if args.quick else 3)):
        ours.append(run_engine(checkpoint, requests, args.budget))
        if hf is not None:
            with torch.inference_mode():
                theirs.append(run_hf_serial(hf, requests[: args.serial_requests]))
        line = f"run {r}: omnistage engine {ours[-1]:.1f} tok/s"
        print(line + (f", transformers serial {theirs[-1]:.1f} tok/s" if theirs else ""), flush=True)
    print(f"omnistage engine: {_spread(ours)} tok/s")
    if theirs:
        print(f"transformers serial generate (first {args.serial_requests} requests): {_spread(theirs)} tok/s")
        ratios = [a / b for a, b in zip(ours, theirs)]
        print(f"ratio per run: {_spread(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
