"""The `audio_encoder` stage against transformers' thinker.get_audio_features, one audio at a time."""

from __future__ import annotations

import io

import numpy as np
import torch

from omnistage.stages.base import StageRequest
from omnistage.stages.omni.audio_encoder import AudioEncoderStage

from .conftest import make_ctx


def _wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def _reference_embeds(model, fe, samples: np.ndarray) -> torch.Tensor:
    feats = fe(samples, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="pt")
    with torch.no_grad():
        out = model.thinker.get_audio_features(feats["input_features"], feature_attention_mask=feats["attention_mask"])
    return out.last_hidden_state


def test_batched_audio_embeddings_equal_transformers_alone(omni_dir, omni_ref):
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor.from_pretrained(str(omni_dir))
    rng = np.random.RandomState(5)
    # 0.3 s .. 4.7 s: several audios span more than one 2 s attention window of the tower.
    clips = [(rng.randn(int(s * 16000)) * 0.1).astype(np.float32) for s in (0.3, 2.5, 4.7, 1.1, 3.3)]
    stage = AudioEncoderStage(make_ctx("audio_encoder", omni_dir, max_batch_size=8))
    stage.add(StageRequest("a", {"audio": {"samples": clips[0], "sampling_rate": 16000}}))
    stage.add(
        StageRequest("b", {"audio": [_wav_bytes(clips[1], 16000), {"samples": clips[2], "sampling_rate": 16000}]})
    )
    stage.add(StageRequest("bad", {"audio": b"garbage" * 40}))
    stage.add(
        StageRequest(
            "c",
            {"audio": [{"samples": clips[3], "sampling_rate": 16000}, {"samples": clips[4], "sampling_rate": 16000}]},
        )
    )
    emissions = {}
    while stage.has_work():
        emissions.update({e.request_id: e for e in stage.step()})
    assert max(r.batch_size for r in stage.step_log) == 3  # one forward for the good ones
    assert emissions["bad"].error_kind == "invalid_request" and emissions["bad"].param == "audio"
    got = {rid: e.outputs["audio_embeds"] for rid, e in emissions.items() if rid != "bad"}
    assert [len(got[r]) for r in "abc"] == [1, 2, 2]
    flat = [got["a"][0], *got["b"], *got["c"]]
    for clip, emb in zip(clips, flat):
        ref = _reference_embeds(omni_ref, fe, clip)
        assert emb.shape == ref.shape
        torch.testing.assert_close(emb, ref, rtol=1e-5, atol=1e-5)
    assert not stage.has_work() and stage.num_requests() == 0 and not stage._parsed
