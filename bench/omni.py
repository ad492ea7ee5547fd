"""`omnistage bench omni --json FILE [--quick]`: the Omni pipeline against transformers.

Model: the pinned benchmark checkpoint (bench/omni_model.py: a random Qwen2.5-Omni whose
thinker is hidden 512, 12 layers, intermediate 2048, 8 / 2 KV heads; small talker; token2wav
with the real 22-layer DiT structure), float32, CPU.

Workload: 16 audio-in chat requests (1-3 s clips, seeded), each answered with exactly 32 text
tokens and exactly 384 codec tokens (12 per text token, the 50 Hz codec rate: 7.68 s of 24 kHz
speech), at concurrency 1 and 8.

Fixed lengths, the same way on both systems: greedy thinker and talker; min tokens = max
tokens on both AR stages (omnistage: `min_tokens` / `max_tokens` of the thinker and the talker;
transformers: `thinker_min_new_tokens` / `thinker_max_new_tokens`, `talker_min_new_tokens` /
`talker_max_new_tokens`). The min-length rule masks every EOS / stop id (the thinker's
<|im_end|> and <|endoftext|>, the talker's codec pad and end) until the length is reached and
the max ends the sequence there, so neither system stops early or runs long; after the
thinker's last token both talkers continue on the text end / pad embeddings, as the model
defines. The talker's other defaults (repetition penalty 1.05) are the model's on both sides,
and omnistage's talker uses `generate_compat` (generate()'s prefill on unpadded input) so codec
tokens can be compared. Speech: omnistage's streaming token2wav windows (stage defaults);
transformers decodes the whole codec sequence at once.

Systems: omnistage (configs/tiny-omni.yaml on the benchmark checkpoint, one worker process per
stage, `--stage-threads` threads for the thinker, talker and token2wav workers); transformers
`generate()` one request at a time on a subset (`--hf-requests`, >= 4; recorded in the JSON)
and the concurrency-8 batch in one batched `generate()`, both with `--threads` torch threads.

Metrics per system: TTFT (first text chunk), TTFA (first audio chunk; transformers returns
text and audio together, so both equal its full latency), RTF (request latency / seconds of
audio it produced) and end-to-end throughput (requests/s and audio seconds per second).
Ratios: `ttfa_vs_hf_full_c1` = omnistage c1 TTFA p50 / transformers serial latency p50;
`throughput_vs_hf_c8` = omnistage c8 requests/s / transformers serial requests/s;
`throughput_vs_hf_batch_c8` = the same over the batched generate(). `checks.greedy_equal_hf`:
on the serial subset, omnistage's text and codec tokens equal transformers' exactly.

Rounds: after one warm-up request per system, the whole workload runs `--repeats` times
(default 3), each round omnistage (every concurrency) then transformers (serial subset, then
the batch), so each round's ratios compare runs minutes apart. Every figure under
`omnistage` / `hf` is the median over the rounds (each round's own figures are in `rounds`);
`ratios` holds each ratio's median, `ratio_ranges` its median, min, max and per-round values.
`checks.greedy_equal_hf` must hold in every round.

`--quick`: 2 requests, 3 text / 36 codec tokens, concurrency 1 and 2, 2 rounds, a smoke run of
the whole harness (about a minute once the checkpoint is built); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin (docs/bench-diffusion.md)

import torch  # noqa: E402

from omnistage.bench.omni_model import THINKER, bench_model_dir, load_reference  # noqa: E402
from omnistage.bench.omni_systems import (  # noqa: E402
    Lengths,
    RequestRecord,
    make_requests,
    run_hf_batch,
    run_hf_serial,
    run_omnistage,
    start_omnistage,
)
from omnistage.stages.omni.inputs import OmniProcessor  # noqa: E402

AUDIO_RATE = 24000


@dataclass
class BenchConfig:
    quick: bool = False
    requests: int = 16
    text_tokens: int = 32
    codec_tokens: int = 384
    concurrency: tuple[int, ...] = (1, 8)
    hf_requests: int = 4
    threads: int = 2
    stage_threads: int = 1
    repeats: int = 3

    @classmethod
    def make(cls, quick: bool, **overrides) -> BenchConfig:
        base = (
            cls(quick=True, requests=2, text_tokens=3, codec_tokens=36, concurrency=(1, 2), hf_requests=2, repeats=2)
            if quick
            else cls()
        )
        for key, value in overrides.items():
            if value is not None:
                setattr(base, key, value)
        return base


def log(msg: str) -> None:
    print(f"[bench omni {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def p50(values: list[float]) -> float:
    return statistics.median(values)


def summarize(records: list[RequestRecord], wall: float) -> dict:
    audio_s = [r.audio_samples / AUDIO_RATE for r in records]
    return {
        "requests": len(records),
        "wall_s": wall,
        "ttft_p50_s": p50([r.ttft for r in records]),
        "ttfa_p50_s": p50([r.ttfa for r in records]),
        "latency_p50_s": p50([r.latency for r in records]),
        "rtf_p50": p50([r.latency / a if a else math.inf for r, a in zip(records, audio_s)]),
        "requests_per_s": len(records) / wall,
        "audio_s_per_s": sum(audio_s) / wall,
        "text_tokens": sorted({r.text_tokens for r in records}),
        "codec_tokens": sorted({r.codec_tokens for r in records}),
        "audio_samples": sorted({r.audio_samples for r in records}),
    }


def run_all(cfg: BenchConfig) -> dict:
    lengths = Lengths(cfg.text_tokens, cfg.codec_tokens)
    requests = make_requests(cfg.requests)
    model_dir = bench_model_dir()
    log(f"model {model_dir}; {cfg.requests} requests, {lengths}, {cfg.repeats} rounds; starting omnistage")
    out: dict = {"config": {**asdict(cfg), "thinker": THINKER, "hf_serial_subset": cfg.hf_requests}}
    rounds, greedy = [], []
    with start_omnistage(model_dir, cfg.stage_threads) as pipeline:
        torch.set_num_threads(cfg.threads)
        model, processor = load_reference(model_dir), OmniProcessor(model_dir)
        if not cfg.quick:  # warm-up (first forwards, allocations)
            run_omnistage(pipeline, requests[:1], lengths, 1)
            run_hf_serial(model, processor, requests[:1], lengths)
        for i in range(cfg.repeats):
            summary, omni_records, hf_records = run_round(pipeline, model, processor, cfg, requests, lengths)
            log(f"round {i + 1}/{cfg.repeats}: ratios {summary['ratios']}")
            rounds.append(summary)
            greedy.append((omni_records, hf_records))
    c_max = max(cfg.concurrency)
    out["rounds"] = rounds
    for system, keys in (("omnistage", [f"c{c}" for c in cfg.concurrency]), ("hf", ["serial", f"batch_c{c_max}"])):
        out[system] = {k: median_summary([r[system][k] for r in rounds]) for k in keys}
    out["ratio_ranges"] = {k: spread([r["ratios"][k] for r in rounds]) for k in rounds[0]["ratios"]}
    out["ratios"] = {k: v["median"] for k, v in out["ratio_ranges"].items()}
    cfg2w = model.config.token2wav_config
    samples_per_code = cfg2w.dit_config.repeats * math.prod(cfg2w.bigvgan_config.upsample_rates)
    per_round = [checks(o, h, lengths, samples_per_code) for o, h in greedy]
    out["checks"] = {**per_round[0], **{k: all(c[k] for c in per_round) for k in ("greedy_equal_hf", "fixed_lengths")}}
    return out


def run_round(pipeline, model, processor, cfg: BenchConfig, requests, lengths: Lengths):
    """One pass of the workload through both systems: (summary, omnistage records at the
    lowest concurrency, transformers serial records)."""
    c_max = max(cfg.concurrency)
    summary: dict = {"omnistage": {}, "hf": {}}
    omni_records = {}
    for c in cfg.concurrency:
        records, wall = run_omnistage(pipeline, requests, lengths, c)
        omni_records[c] = records
        summary["omnistage"][f"c{c}"] = summarize(records, wall)
        log(f"omnistage c{c}: {summary['omnistage'][f'c{c}']}")
    hf_records, wall = run_hf_serial(model, processor, requests[: cfg.hf_requests], lengths)
    summary["hf"]["serial"] = summarize(hf_records, wall)
    log(f"transformers serial: {summary['hf']['serial']}")
    try:
        batch_records, wall = run_hf_batch(model, processor, requests[:c_max], lengths)
        summary["hf"][f"batch_c{c_max}"] = summarize(batch_records, wall)
    except Exception as exc:  # noqa: BLE001 - batched generate() support varies across versions
        summary["hf"][f"batch_c{c_max}"] = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"transformers batch c{c_max}: {summary['hf'][f'batch_c{c_max}']}")
    summary["ratios"] = ratios(summary, c_max)
    return summary, omni_records[min(cfg.concurrency)], hf_records


def median_summary(runs: list[dict]) -> dict:
    """Each numeric figure's median over the rounds; the length lists merged."""
    if any("error" in r for r in runs):
        return {"error": next(r["error"] for r in runs if "error" in r)}
    merged = {}
    for key, value in runs[0].items():
        if isinstance(value, list):
            merged[key] = sorted({x for r in runs for x in r[key]})
        elif isinstance(value, (int, float)):
            merged[key] = statistics.median(r[key] for r in runs)
    return merged


def spread(values: list[float | None]) -> dict:
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "runs": values}
    return {"median": statistics.median(known), "min": min(known), "max": max(known), "runs": values}


def ratios(out: dict, c_max: int) -> dict:
    omni, hf = out["omnistage"], out["hf"]
    batch = hf.get(f"batch_c{c_max}", {})
    return {
        "ttfa_vs_hf_full_c1": omni["c1"]["ttfa_p50_s"] / hf["serial"]["latency_p50_s"],
        f"throughput_vs_hf_c{c_max}": omni[f"c{c_max}"]["requests_per_s"] / hf["serial"]["requests_per_s"],
        f"throughput_vs_hf_batch_c{c_max}": (
            omni[f"c{c_max}"]["requests_per_s"] / batch["requests_per_s"] if "requests_per_s" in batch else None
        ),
    }


def checks(omni: list[RequestRecord], hf: list[RequestRecord], lengths: Lengths, samples_per_code: int) -> dict:
    """Exact greedy equality on the transformers subset, and the fixed lengths everywhere
    (audio = codec tokens x mel frames per token x the vocoder's samples per frame)."""
    pairs = list(zip(omni, hf))
    return {
        "greedy_equal_hf": all(o.text == h.text and o.codes == h.codes for o, h in pairs),
        "text_equal_hf": [o.text == h.text for o, h in pairs],
        "codes_equal_hf": [o.codes == h.codes for o, h in pairs],
        "fixed_lengths": all(
            r.text_tokens == lengths.text_tokens
            and r.codec_tokens == lengths.codec_tokens
            and r.audio_samples == lengths.codec_tokens * samples_per_code
            for r in [*omni, *hf]
        ),
        "samples_per_codec_token": samples_per_code,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omnistage bench omni", description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="a smoke run of the harness (numbers mean nothing)")
    ap.add_argument("--hf-requests", type=int, help="transformers serial subset size (>= 4 in a full run)")
    ap.add_argument("--threads", type=int, help="torch threads of the transformers baselines")
    ap.add_argument("--stage-threads", type=int, help="threads of omnistage's thinker, talker, token2wav workers")
    ap.add_argument("--repeats", type=int, help="rounds of the whole workload (figures are their medians)")
    args = ap.parse_args(argv)
    cfg = BenchConfig.make(
        args.quick,
        hf_requests=args.hf_requests,
        threads=args.threads,
        stage_threads=args.stage_threads,
        repeats=args.repeats,
    )
    if not cfg.quick and cfg.hf_requests < 4:
        ap.error("--hf-requests must be >= 4 in a full run")
    if cfg.repeats < 1:
        ap.error("--repeats must be >= 1")
    result = run_all(cfg)
    Path(args.json).write_text(json.dumps(result, indent=2))
    log(f"ratios (median, min, max over rounds) {result['ratio_ranges']}; checks {result['checks']}; wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
