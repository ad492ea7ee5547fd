"""token2wav alone: real-time factor of the stage per setting, and each setting's speech
against the default's.

    omnistage bench omni_token2wav [--requests 1] [--codes 384] [--steps 10,6,4] [--threads 1]
                                   [--repeats 3] [--json FILE] [--quick]

The token2wav stage of configs/tiny-omni.yaml (the `tiny:qwen2_5_omni` checkpoint: the real
22-layer DiT at width 32, BigVGAN at 128 channels) decodes `--requests` requests of `--codes`
codec tokens each, sent at once, through the engine protocol (streaming windows with the
default window plan, windows of all requests batched), in one process with `--threads` torch
threads. Settings: the ODE step counts of `--steps` (10 is the model's, the reference).
Rounds alternate the settings (round 1: all settings, round 2: all settings, ...), so a load
change on the machine hits every setting alike. Per setting: `rtf` = stage seconds / audio
seconds (median, min, max over the rounds), `cpu_rtf` the same with the process's CPU seconds
(on a loaded machine closer to what a quiet one gives at one thread; it sums the threads), the DiT evaluations per forward, and the waveform
and mel SNR against the reference setting's decode of the same codes and seeds (mel: the DiT
output concatenated over the windows); the reference against itself shows the decode is
deterministic (the SNR's ceiling, ~3000 dB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from omnistage.graph.spec import BatchingSpec
from omnistage.models.recipes import resolve_model
from omnistage.stages.base import StageContext, StageRequest
from omnistage.stages.omni.token2wav import Token2WavStage

MODEL = "tiny:qwen2_5_omni"


def build_stage(
    model_dir, max_batch_size: int = 8, params: dict | None = None, prefix: str | None = None
) -> Token2WavStage:
    """A token2wav engine in this process (CPU, float32), as a worker would build it."""
    ctx = StageContext(
        stage_name="token2wav",
        kind="token2wav",
        model_path=str(model_dir),
        model_subfolder=None,
        model_prefix=prefix,
        device=torch.device("cpu"),
        dtype=torch.float32,
        batching=BatchingSpec(max_batch_size=max_batch_size, max_wait_ms=0.0),
        params=dict(params or {}),
    )
    return Token2WavStage(ctx)


def decode(stage: Token2WavStage, codes: list[list[int]], steps: int) -> dict:
    """Every request's codes at once; returns seconds, audio per request, mel per request and
    the DiT evaluations counted on the network."""
    evals, mels = [0], {}
    dit = stage.net.packed_dit
    forward = dit.forward
    solves = stage.totals["forwards"]

    def counted(*a, **k):
        evals[0] += 1
        return forward(*a, **k)

    dit.forward = counted
    audio: dict[str, list[torch.Tensor]] = {}
    t0, cpu0 = time.perf_counter(), time.process_time()
    for i, c in enumerate(codes):
        params = {"seed": i, "num_steps": steps}
        stage.add(StageRequest(f"r{i}", inputs={"codes": c}, params=params, arrival=float(i)))
    states = dict(stage.requests)
    while stage.has_work():
        for em in stage.step():
            if em.error:
                raise RuntimeError(em.error)
            audio.setdefault(em.request_id, []).append(em.outputs.get("audio", torch.zeros(0)))
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    del dit.forward  # the class method again
    for rid, state in states.items():
        mels[rid] = torch.cat(state.mel)
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "audio": {rid: torch.cat(chunks) for rid, chunks in audio.items()},
        "mel": mels,
        "evals_per_solve": evals[0] / max(1, stage.totals["forwards"] - solves),
    }


def snr_db(signal: torch.Tensor, reference: torch.Tensor) -> float:
    err = ((signal.double() - reference.double()) ** 2).sum().clamp_min(1e-300)
    return round(float(10 * torch.log10((reference.double() ** 2).sum() / err)), 1)


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--codes", type=int, default=384)
    ap.add_argument("--steps", default="10,6,4", help="ODE step counts; the first is the reference")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 request of 48 codes, 1 round")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.codes, args.repeats = 1, 48, 1
    torch.set_num_threads(args.threads)
    steps = [int(s) for s in args.steps.split(",")]
    stage = build_stage(resolve_model(MODEL))
    g = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, stage.net.num_codes, (args.codes,), generator=g).tolist() for _ in range(args.requests)]
    audio_s = args.requests * args.codes * stage.net.repeats * stage.net.samples_per_frame / stage.sample_rate
    decode(stage, [c[:48] for c in codes], steps[0])  # warm-up
    rounds: dict[int, list[dict]] = {s: [] for s in steps}
    for r in range(args.repeats):
        for s in steps:
            rounds[s].append(decode(stage, codes, s))
            run = rounds[s][-1]
            print(
                f"round {r + 1} steps {s}: rtf {run['seconds'] / audio_s:.3f}, cpu {run['cpu_seconds'] / audio_s:.3f}"
            )
    ref = rounds[steps[0]][0]
    result = {"model": MODEL, "requests": args.requests, "codes": args.codes, "threads": args.threads}
    result |= {"audio_seconds": audio_s, "repeats": args.repeats, "settings": {}}
    for s in steps:
        runs = rounds[s]
        result["settings"][f"steps_{s}"] = {
            "num_steps": s,
            "rtf": summary([run["seconds"] / audio_s for run in runs]),
            "cpu_rtf": summary([run["cpu_seconds"] / audio_s for run in runs]),
            "dit_evals_per_ode_solve": runs[0]["evals_per_solve"],
            "samples": sum(a.numel() for a in runs[0]["audio"].values()),
            "wave_snr_db_vs_ref": min(snr_db(runs[0]["audio"][k], ref["audio"][k]) for k in ref["audio"]),
            "mel_snr_db_vs_ref": min(snr_db(runs[0]["mel"][k], ref["mel"][k]) for k in ref["mel"]),
        }
    ref = result["settings"][f"steps_{steps[0]}"]
    for entry in result["settings"].values():
        entry["speedup_vs_ref"] = round(ref["rtf"]["median"] / entry["rtf"]["median"], 2)
        entry["cpu_speedup_vs_ref"] = round(ref["cpu_rtf"]["median"] / entry["cpu_rtf"]["median"], 2)
    print(json.dumps(result["settings"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
