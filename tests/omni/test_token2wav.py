"""token2wav stage vs transformers' Qwen2_5OmniToken2WavModel on a tiny checkpoint: the exact
full-sequence mode, streaming windows against the full decode, windows of several requests
in one forward, waiting for codes, bad input."""

from __future__ import annotations

import pytest
import torch

from .token2wav_checkpoint import CODEC_VOCAB, build_token2wav_checkpoint, decode, make_stage, snr_db


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A standalone token2wav directory whose two voices have reference mels of different lengths."""
    return build_token2wav_checkpoint(tmp_path_factory.mktemp("token2wav"))


@pytest.fixture(scope="module")
def standalone_reference(ckpt):
    from transformers import Qwen2_5OmniToken2WavModel

    model = Qwen2_5OmniToken2WavModel.from_pretrained(str(ckpt)).eval()
    return model, torch.load(ckpt / "spk_dict.pt", weights_only=True)


def codes_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, CODEC_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_waveform(token2wav, voice: dict, codes: list[int], seed: int, **ode) -> torch.Tensor:
    torch.manual_seed(seed)  # transformers draws the ODE's noise from the global generator
    with torch.no_grad():
        wav = token2wav(torch.tensor([codes]), conditioning=voice["cond"], reference_mel=voice["ref_mel"], **ode)
    return wav.reshape(-1)


def check_full_mode(stage, token2wav, voices, voice: str, n: int) -> None:
    codes = codes_of(n, seed=n)
    want = hf_waveform(token2wav, voices[voice], codes, seed=5)
    assert want.abs().max() > 0.05  # a waveform that would show a wrong window or noise
    got, errors = decode(stage, {"r": (codes, {"mode": "full", "voice": voice, "seed": 5})})
    assert not errors
    assert got["r"].shape == want.shape == (n * 2 * 240,)
    assert (got["r"] - want).abs().max() <= 1e-5


def test_full_mode_equals_transformers_omni_checkpoint(omni_dir, omni_ref):
    """The tiny Qwen2.5-Omni recipe: token2wav weights under the `token2wav.` prefix."""
    stage = make_stage(omni_dir)
    for voice, n in (("Chelsie", 61), ("Ethan", 100)):
        check_full_mode(stage, omni_ref.token2wav, omni_ref.speaker_map, voice, n)


def test_full_mode_equals_transformers_standalone_directory(ckpt, standalone_reference):
    model, voices = standalone_reference
    check_full_mode(make_stage(ckpt), model, voices, "Ethan", 57)


def test_fewer_ode_steps_equal_transformers_and_stay_near_the_default_grid(ckpt, standalone_reference):
    """`num_steps` below the model's 10 is the speed option (12 DiT evaluations at 4 steps
    instead of 36): exact against transformers' ODE at the same step count, and its mel within
    a stated distance of the default grid's (docs/omni-token2wav.md, "Fewer ODE steps")."""
    from omnistage.stages.omni.token2wav_model import DitWindow, OdeSettings
    from omnistage.stages.omni.token2wav_windows import RequestNoise

    model, voices = standalone_reference
    codes = codes_of(57, seed=4)
    stage = make_stage(ckpt, {"num_steps": 4})
    want = hf_waveform(model, voices["Ethan"], codes, seed=5, num_steps=4)
    got, errors = decode(stage, {"r": (codes, {"mode": "full", "voice": "Ethan", "seed": 5})})
    assert not errors
    assert (got["r"] - want).abs().max() <= 1e-5
    net = stage.net
    window = DitWindow(torch.tensor(codes), RequestNoise(5, net.mel_dim).slice(0, 114), net.voices["Ethan"])
    default, fewer = (net.sample_mels([window], OdeSettings(num_steps=n))[0] for n in (10, 4))
    snr = snr_db(fewer, default)
    print(f"4 ODE steps vs 10: mel SNR {snr:.1f} dB")
    assert 30 <= snr < 100, snr  # near the default grid's mel, yet a different solve


def test_streaming_default_context_against_full_decode(omni_dir):
    codes = codes_of(150, seed=1)
    stage = make_stage(omni_dir)
    full, _ = decode(stage, {"f": (codes, {"mode": "full", "seed": 9, "voice": "Ethan"})})
    streamed, errors = decode(stage, {"s": (codes, {"seed": 9, "voice": "Ethan"})}, chunk=7)
    assert not errors
    assert streamed["s"].shape == full["f"].shape
    snr = snr_db(streamed["s"], full["f"])
    print(f"streamed (chunks of 7 codes) vs full decode: waveform {snr:.1f} dB")
    assert snr >= 80, snr
    # windows, not one decode: 2, 4 and 8 blocks for 12.5 blocks of codes (the full decode is one)
    assert stage.totals["windows"] == 1 + 3


def test_output_independent_of_input_chunking(ckpt):
    codes = codes_of(90, seed=2)
    results = [decode(make_stage(ckpt), {"r": (codes, {"seed": 3})}, chunk=c)[0]["r"] for c in (1, 13, None)]
    for other in results[1:]:
        assert (other - results[0]).abs().max() <= 1e-6


def test_windows_of_several_requests_share_forwards_and_equal_solo(ckpt):
    requests = {
        "a": (codes_of(70, 11), {"voice": "Chelsie", "seed": 1}),
        "b": (codes_of(131, 12), {"voice": "Ethan", "seed": 2, "first_window_blocks": 1}),
        "c": (codes_of(45, 13), {"voice": "Ethan", "seed": 3, "mode": "full"}),
        "d": (codes_of(100, 14), {"speaker": "Chelsie", "seed": 4, "past_blocks": 3, "future_blocks": 2}),
    }
    stage = make_stage(ckpt, params={"windows_per_request": 3, "vocoder_batch_size": 4}, max_batch_size=8)
    together, errors = decode(stage, requests)  # all codes at once: every request has windows ready
    assert not errors
    shared = [rec for rec in stage.step_log if len(set(rec.request_ids)) == 4]
    assert shared, [rec.request_ids for rec in stage.step_log]
    # first forward: each request's first window; second: the other 6 (a 1, b 3, d 2; c is done)
    assert [len(rec.request_ids) for rec in stage.step_log] == [4, 6]
    # several windows of one request in a forward, but never before its first audio
    assert any(len(set(rec.request_ids)) < len(rec.request_ids) for rec in stage.step_log)
    for rid, req in requests.items():
        alone, _ = decode(make_stage(ckpt), {rid: req}, chunk=9)
        assert together[rid].shape == alone[rid].shape == (len(req[0]) * 480,)
        # float32 rounding of other batch shapes, carried through the ODE's 36 forwards
        assert (together[rid] - alone[rid]).abs().max() <= 5e-5, rid


def test_waiting_request_holds_nobody_up(ckpt):
    from omnistage.stages.base import StageRequest

    stage = make_stage(ckpt, params={"first_window_blocks": 2, "future_blocks": 1})
    stage.add(StageRequest("slow", inputs={}, params={"seed": 1}))
    stage.feed("slow", "codes", codes_of(35, 1), last=False)  # a 2-block window + 1 block needs 36
    assert not stage.has_work()
    stage.add(StageRequest("fast", inputs={"codes": codes_of(30, 2)}, params={"seed": 2}))
    done = {}
    while stage.has_work():
        for em in stage.step():
            done.setdefault(em.request_id, []).append(em)
    assert done["fast"][-1].finished and "slow" not in done
    stage.feed("slow", "codes", [5], last=False)  # now 36 codes: the first window is ready
    ems = stage.step()
    assert [e.request_id for e in ems] == ["slow"] and ems[0].outputs["audio"].numel() > 0
    assert not ems[0].finished and not stage.has_work()


def test_first_audio_goes_out_before_other_requests_are_vocoded(ckpt):
    """A step whose forward made one request's first window and another's later window sends
    the first audio alone; the next step vocodes the rest without a DiT forward first."""
    from omnistage.stages.base import StageRequest

    stage = make_stage(ckpt, params={"first_window_blocks": 2, "future_blocks": 1})
    stage.add(StageRequest("old", inputs={}, params={"seed": 1}))
    stage.feed("old", "codes", codes_of(36, 1), last=False)  # first window: 2 blocks + 1 of future
    assert [e.request_id for e in stage.step()] == ["old"]
    stage.feed("old", "codes", codes_of(84, 1)[36:], last=False)  # its second window: 4 blocks + 1
    stage.add(StageRequest("new", inputs={}, params={"seed": 2}))
    stage.feed("new", "codes", codes_of(36, 2), last=False)
    first = stage.step()
    forwards = stage.totals["forwards"]
    assert [e.request_id for e in first] == ["new"] and first[0].outputs["audio"].numel() > 0
    rest = stage.step()
    assert [e.request_id for e in rest] == ["old"] and rest[0].outputs["audio"].numel() > 0
    assert stage.totals["forwards"] == forwards == 2
    assert not stage.has_work()


def test_bad_input_fails_only_its_request(ckpt):
    stage = make_stage(ckpt)
    good = codes_of(20, 3)
    out, errors = decode(
        stage,
        {
            "voice": (good, {"voice": "Nobody"}),
            "code": (good[:5] + [CODEC_VOCAB + 3] + good[5:], {}),
            "param": (good, {"num_steps": "ten"}),
            "unknown": (good, {"temperature": 0.5}),
            "ok": (good, {"seed": 1}),
        },
        chunk=8,
    )
    assert set(errors) == {"voice", "code", "param", "unknown"}
    assert all(kind == "invalid_request" for kind, _ in errors.values())
    assert "Nobody" in errors["voice"][1] and "Chelsie" in errors["voice"][1]
    assert out["ok"].numel() == 20 * 480
    assert stage.num_requests() == 0


def test_end_code_ends_the_stream(ckpt):
    codes = codes_of(40, 4)
    stage = make_stage(ckpt, params={"end_codes": [CODEC_VOCAB + 2]})
    cut, _ = decode(stage, {"r": (codes + [CODEC_VOCAB + 2, 1, 2, 3], {"seed": 1})}, chunk=6)
    plain, _ = decode(stage, {"r": (codes, {"seed": 1})}, chunk=6)
    assert cut["r"].shape == (40 * 480,)
    assert (cut["r"] - plain["r"]).abs().max() <= 1e-6
