"""How much DiT context a token2wav window needs: mel and waveform SNR of windowed decodes
against the full decode (same codes, voice and noise), per past/future context in blocks.

    python -m omnistage.bench.token2wav_context [--model tiny:qwen2_5_omni] [--codes 150] [--json FILE]

Each configuration decodes the same request through the stage's own window plan
(`Token2WavRequest`) and network (`Token2WavNet`); the vocoder overlap is swept separately on
the full decode's mel.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from omnistage.models.recipes import resolve_model
from omnistage.stages.omni.token2wav_model import DitWindow, OdeSettings, load_token2wav
from omnistage.stages.omni.token2wav_windows import RequestNoise, Token2WavRequest, WindowSettings

CONTEXTS = [(0, 0), (1, 0), (1, 1), (2, 1), (3, 1), (2, 2), (3, 2), (4, 2), (6, 3)]
OVERLAPS = [0, 4, 8, 12, 16, 24, 34]


def snr_db(signal: torch.Tensor, reference: torch.Tensor) -> float:
    err = ((signal.double() - reference.double()) ** 2).sum().clamp_min(1e-300)
    return round(float(10 * torch.log10((reference.double() ** 2).sum() / err)), 1)


def windowed(net, codes: list[int], voice, seed: int, windows: WindowSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """(mel, waveform) of one request decoded window by window as the stage does."""
    req = Token2WavRequest(
        "r", voice, OdeSettings(), windows, RequestNoise(seed, net.mel_dim), len(codes), net.repeats, 0.0
    )
    req.codes, req.ended = list(codes), True
    wave = []
    while not req.done:
        nxt = req.next_window(net.block_frames)
        if nxt is not None:
            req.take_mel(nxt[0], net.sample_mels([nxt[1]], req.ode)[0])
        voc = req.vocoder_window()
        if voc is not None:
            span, mel = voc
            w = net.vocode([mel])[0]
            wave.append(
                w[
                    (span.start - span.read_start) * net.samples_per_frame : (span.end - span.read_start)
                    * net.samples_per_frame
                ]
            )
            req.vocoded = span.end
    return torch.cat(req.mel), torch.cat(wave)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:qwen2_5_omni")
    ap.add_argument("--codes", type=int, default=150)
    ap.add_argument("--voice", default="Chelsie")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    net = load_token2wav(str(resolve_model(args.model)), torch.device("cpu"))
    codes = torch.randint(0, net.num_codes, (args.codes,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    voice = net.voices[args.voice]
    noise = RequestNoise(args.seed, net.mel_dim).slice(0, len(codes) * net.repeats)
    t0 = time.perf_counter()
    full_mel = net.sample_mels([DitWindow(torch.tensor(codes), noise, voice)], OdeSettings())[0]
    full_wave = net.vocode([full_mel])[0]
    rows = [{"past_blocks": "full", "seconds": round(time.perf_counter() - t0, 2)}]
    print(f"{'past':>4} {'future':>6} {'mel dB':>7} {'wave dB':>8} {'s':>6}")
    for past, future in CONTEXTS:
        t0 = time.perf_counter()
        # windows of 2 then 4 blocks: more window edges than the stage's defaults, the harder case
        settings = WindowSettings(
            first_blocks=2, steady_blocks=4, past_blocks=past, future_blocks=future, vocoder_overlap=34
        )
        mel, wave = windowed(net, codes, voice, args.seed, settings)
        row = {"past_blocks": past, "future_blocks": future, "mel_snr_db": snr_db(mel, full_mel)}
        row |= {"wave_snr_db": snr_db(wave, full_wave), "seconds": round(time.perf_counter() - t0, 2)}
        rows.append(row)
        print(f"{past:>4} {future:>6} {row['mel_snr_db']:>7} {row['wave_snr_db']:>8} {row['seconds']:>6}", flush=True)
    overlaps = []
    per = net.samples_per_frame
    for ov in OVERLAPS:
        pieces, start, frames = [], 0, full_mel.shape[0]
        while start < frames:
            end = min(frames, start + 48)
            lo, hi = max(0, start - ov), min(frames, end + ov)
            pieces.append(net.vocode([full_mel[lo:hi]])[0][(start - lo) * per : (end - lo) * per])
            start = end
        overlaps.append({"vocoder_overlap": ov, "wave_snr_db": snr_db(torch.cat(pieces), full_wave)})
        print(f"vocoder overlap {ov:>3} frames: {overlaps[-1]['wave_snr_db']} dB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "codes": args.codes, "contexts": rows, "vocoder": overlaps}, f, indent=1)


if __name__ == "__main__":
    main()
