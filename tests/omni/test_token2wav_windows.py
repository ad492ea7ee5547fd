"""token2wav window plan and noise: spans are block-aligned and wait for their future context,
the per-request noise stream equals one draw of the whole length, and the windowed mel of the
tiny Qwen2.5-Omni checkpoint is within 80 dB of the full decode at the default context."""

from __future__ import annotations

import pytest
import torch

from omnistage.stages.omni.token2wav_windows import (
    RequestNoise,
    Span,
    WindowSettings,
    plan_dit_window,
    plan_vocoder_window,
)

from .token2wav_checkpoint import snr_db


@pytest.mark.parametrize("chunk_rows", [1, 3, 240])
@pytest.mark.parametrize("seed", [0, 12345])
def test_noise_stream_equals_one_draw(seed, chunk_rows):
    want = torch.randn([1, 2 * 157, 80], generator=torch.Generator().manual_seed(seed))[0]
    noise = RequestNoise(seed, 80, chunk_rows=chunk_rows)
    # slices in the order windows ask for them (overlapping, growing): drawn in several pieces
    pieces = {(a, b): noise.slice(a, b).clone() for a, b in ((0, 48), (24, 120), (96, 97), (72, 314))}
    assert torch.equal(noise.slice(0, 314), want)
    assert all(torch.equal(piece, want[a:b]) for (a, b), piece in pieces.items())


def test_dit_windows_are_block_aligned_and_wait_for_future_context():
    w = WindowSettings(first_blocks=1, steady_blocks=3, past_blocks=2, future_blocks=1)
    assert plan_dit_window(0, 47, False, 24, w) is None  # 1 block + 1 block of future: 48 frames
    assert plan_dit_window(0, 48, False, 24, w) == Span(0, 24, 0, 48)
    # then each window twice the one before, up to the steady size: 1, 2, 3, 3 blocks
    assert plan_dit_window(24, 95, False, 24, w) is None
    assert plan_dit_window(24, 500, False, 24, w) == Span(24, 72, 0, 96)
    assert plan_dit_window(72, 500, False, 24, w) == Span(72, 144, 24, 168)
    assert plan_dit_window(144, 500, False, 24, w) == Span(144, 216, 96, 240)
    # the end of the stream: no future context to wait for, clipped to the codes
    assert plan_dit_window(72, 130, True, 24, w) == Span(72, 130, 24, 130)
    assert plan_dit_window(130, 130, True, 24, w) is None
    # first_count windows of the first size before the doubling: 1, 1, 2, 3 blocks
    twice = WindowSettings(first_blocks=1, first_count=2, steady_blocks=3, past_blocks=2, future_blocks=1)
    assert plan_dit_window(24, 500, False, 24, twice) == Span(24, 48, 0, 72)
    assert plan_dit_window(48, 500, False, 24, twice) == Span(48, 96, 0, 120)
    assert plan_dit_window(96, 500, False, 24, twice) == Span(96, 168, 48, 192)
    full = WindowSettings(full=True)
    assert plan_dit_window(0, 500, False, 24, full) is None
    assert plan_dit_window(0, 500, True, 24, full) == Span(0, 500, 0, 500)


def test_vocoder_windows_overlap_and_flush_at_the_end():
    assert plan_vocoder_window(0, 48, False, 24) == Span(0, 24, 0, 48)
    assert plan_vocoder_window(24, 40, False, 24) is None
    assert plan_vocoder_window(24, 144, False, 24) == Span(24, 120, 0, 144)
    assert plan_vocoder_window(120, 150, True, 24) == Span(120, 150, 96, 150)


def test_windowed_mel_at_default_context(omni_dir):
    from omnistage.bench.token2wav_context import windowed
    from omnistage.stages.omni.token2wav_model import DitWindow, OdeSettings, load_token2wav

    net = load_token2wav(str(omni_dir), torch.device("cpu"))
    codes = torch.randint(0, net.num_codes, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    voice = net.voices["Ethan"]
    noise = RequestNoise(8, net.mel_dim).slice(0, 240)
    full_mel = net.sample_mels([DitWindow(torch.tensor(codes), noise, voice)], OdeSettings())[0]
    full_wave = net.vocode([full_mel])[0]
    mel, wave = windowed(net, codes, voice, 8, WindowSettings())
    mel_db, wave_db = snr_db(mel, full_mel), snr_db(wave, full_wave)
    print(f"default context: mel {mel_db:.1f} dB, waveform {wave_db:.1f} dB")
    assert mel_db >= 80 and wave_db >= 80, (mel_db, wave_db)
    # more context moves it to float32 rounding
    mel_wide, _ = windowed(net, codes, voice, 8, WindowSettings(past_blocks=3, future_blocks=2))
    assert snr_db(mel_wide, full_mel) >= 120


def test_padded_window_batch_equals_solo_mels(omni_dir):
    """Windows of different lengths and voices in one forward: each mel is its solo mel (the
    waveform's input normalisation clips, so the mel is the sharper check)."""
    from omnistage.stages.omni.token2wav_model import DitWindow, OdeSettings, load_token2wav

    net = load_token2wav(str(omni_dir), torch.device("cpu"))
    g = torch.Generator().manual_seed(6)
    windows = [
        DitWindow(
            torch.randint(0, net.num_codes, (n,), generator=g), torch.randn(2 * n, 80, generator=g), net.voices[v]
        )
        for n, v in ((84, "Chelsie"), (30, "Ethan"), (61, "Ethan"))
    ]
    together = net.sample_mels(windows, OdeSettings())
    for window, mel in zip(windows, together):
        alone = net.sample_mels([window], OdeSettings())[0]
        assert mel.shape == alone.shape == (window.noise.shape[0], 80)
        assert (mel - alone).abs().max() <= 1e-4 * alone.abs().max()
