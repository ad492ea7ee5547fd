"""The `thinker` stage against transformers' Qwen2.5-Omni on the same tiny checkpoints: greedy
tokens, the rows it streams to the talker, and prefix caching keyed by audio content."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.stages.base import StageRequest
from omnistage.stages.omni.audio_encoder import AudioEncoderStage
from omnistage.stages.omni.inputs import OmniProcessor
from omnistage.stages.omni.thinker import ThinkerStage

from .conftest import load_reference, make_ctx, reference_processor, run_stage

NEW = 10


def _clip(seconds: float, seed: int) -> np.ndarray:
    return (np.random.RandomState(seed).randn(int(seconds * 16000)) * 0.1).astype(np.float32)


def _messages(n_audio: int, text: str):
    parts = [{"type": "audio", "audio": f"clip{i}"} for i in range(n_audio)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _embeds(model_dir, clips):
    enc = AudioEncoderStage(make_ctx("audio_encoder", model_dir))
    enc.add(StageRequest("x", {"audio": [{"samples": c, "sampling_rate": 16000} for c in clips]}))
    return run_stage(enc)["x"][-1].outputs["audio_embeds"]


def _reference(model, model_dir, messages, clips, speech, new: int = NEW):
    """transformers: the processor's ids/features, Qwen2_5OmniForConditionalGeneration.generate
    (text mode) for the tokens, the thinker's own generate for the hidden states the talker gets."""
    text = OmniProcessor(model_dir).prompt_text(messages, speech=speech)
    kw = reference_processor(model_dir)(text=[text], audio=clips or None, return_tensors="pt")
    ids = kw["input_ids"]
    extra = (
        {"input_features": kw["input_features"], "feature_attention_mask": kw["feature_attention_mask"]}
        if clips
        else {}
    )
    with torch.no_grad():
        seq = model.generate(
            input_ids=ids, attention_mask=kw["attention_mask"], generation_mode="text", speaker="Chelsie",
            thinker_max_new_tokens=new, thinker_min_new_tokens=new, thinker_do_sample=False, **extra,
        )  # fmt: skip
        tokens = seq[0, ids.shape[1] :].tolist()
        out = model.thinker.generate(
            input_ids=ids, attention_mask=kw["attention_mask"], max_new_tokens=new, min_new_tokens=new,
            do_sample=False, output_hidden_states=True, return_dict_in_generate=True, **extra,
        )  # fmt: skip
    assert out.sequences[0, ids.shape[1] :].tolist() == tokens
    hs = out.hidden_states
    emb0 = hs[0][0][0].clone()
    emb0[ids[0] == model.config.thinker_config.audio_token_index] = 0  # as generate() masks it for the talker
    prompt_rows = emb0 + hs[0][-1][0]
    reply_rows = torch.cat([h[0][0] + h[-1][0] for h in hs[1:]])
    return tokens, prompt_rows, reply_rows


CASES = [  # (audio clip lengths in seconds, text, return_audio)
    ((), "Tell me a short story about the sea.", False),
    ((1.3,), "What do you hear?", True),
    ((0.7, 2.4), "Compare the two sounds.", False),
]


@pytest.mark.parametrize("variant", ["base", "gqa"])
def test_greedy_tokens_and_talker_rows_equal_transformers(variant, omni_dir, omni_gqa_dir, omni_ref):
    model_dir = omni_dir if variant == "base" else omni_gqa_dir
    model = omni_ref if variant == "base" else load_reference(omni_gqa_dir)
    stage = ThinkerStage(make_ctx("thinker", model_dir, max_num_batched_tokens=48))  # chunked prefill
    expected = {}
    for i, (lengths, text, speech) in enumerate(CASES):
        clips = [_clip(s, 10 * i + j) for j, s in enumerate(lengths)]
        messages = _messages(len(clips), text)
        expected[f"r{i}"] = _reference(model, model_dir, messages, clips, speech)
        inputs = {"messages": messages, **({"audio_embeds": _embeds(model_dir, clips)} if clips else {})}
        params = {"temperature": 0, "max_tokens": NEW, "ignore_eos": True, "return_audio": speech}
        stage.add(StageRequest(f"r{i}", inputs, params))
    got = run_stage(stage)
    assert len({t for toks, _, _ in expected.values() for t in toks}) >= 8  # a diverse reference
    for rid, (tokens, prompt_rows, reply_rows) in expected.items():
        ems = got[rid]
        assert not any(e.error for e in ems), [e.error for e in ems]
        assert [t for e in ems for t in e.outputs.get("tokens", [])] == tokens
        feed = [e.outputs["talker_embeds"] for e in ems if "talker_embeds" in e.outputs]
        if not CASES[int(rid[1:])][2]:
            assert not feed  # text-only answers stream nothing for a talker
            continue
        assert "prompt" in feed[0] and sum("prompt" in c for c in feed) == 1
        torch.testing.assert_close(feed[0]["prompt"], prompt_rows, rtol=1e-4, atol=1e-4)
        reply = torch.cat([c["reply"] for c in feed if "reply" in c])
        assert reply.shape[0] == NEW - 1  # the last token is never fed back
        torch.testing.assert_close(reply, reply_rows, rtol=1e-4, atol=1e-4)
    assert stage.engine.num_free_blocks == stage.engine.num_total_blocks


def _answer(stage, rid, model_dir, clip):
    inputs = {"messages": _messages(1, "What is it?"), "audio_embeds": _embeds(model_dir, [clip])}
    stage.add(StageRequest(rid, inputs, {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "return_audio": False}))
    ems = run_stage(stage)[rid]
    info = ems[-1].outputs["info"]
    return (
        [t for e in ems for t in e.outputs.get("tokens", [])],
        info["usage"]["cached_tokens"],
        info["usage"]["prompt_tokens"],
    )


def test_prefix_cache_is_keyed_by_audio_content(omni_dir):
    stage = ThinkerStage(make_ctx("thinker", omni_dir, params={"block_size": 8}))
    x, y = _clip(1.0, 1), _clip(1.0, 2)  # same length: identical token ids, different audio
    first_x, cached, n_prompt = _answer(stage, "x1", omni_dir, x)
    assert cached == 0
    ids = OmniProcessor(omni_dir).expand_audio(OmniProcessor(omni_dir).prompt_text(_messages(1, "")), [25])
    first_audio_row = ids.index(OmniProcessor(omni_dir).audio_token_id)

    got_y, cached_y, _ = _answer(stage, "y", omni_dir, y)
    alone_y, _, _ = _answer(ThinkerStage(make_ctx("thinker", omni_dir, params={"block_size": 8})), "y", omni_dir, y)
    assert got_y == alone_y and got_y != first_x
    assert 0 < cached_y <= first_audio_row  # only the text before the audio was shared

    again_x, cached_x, _ = _answer(stage, "x2", omni_dir, x)
    assert again_x == first_x
    assert cached_x >= n_prompt - 8  # the whole prompt but its last partial block came from the cache


def test_repetition_penalty_counts_the_prompt_as_transformers_does(omni_dir, omni_ref):
    """With audio the prompt is given as embeddings; its token ids (placeholders included) still
    count for the repetition penalty, as transformers' input_ids do."""
    stage = ThinkerStage(make_ctx("thinker", omni_dir))
    expected, plain = {}, {}
    for i, words in enumerate(["the the the", "a b c d e f", "Hello, hello!", "1 2 3 4 5 6 7"]):
        clip = _clip(0.5 + 0.2 * i, 40 + i)
        messages = _messages(1, f"Repeat after me: {words}")
        text = OmniProcessor(omni_dir).prompt_text(messages, speech=False)
        kw = reference_processor(omni_dir)(text=[text], audio=[clip], return_tensors="pt")
        kw.pop("num_audio_tokens", None)
        n = kw["input_ids"].shape[1]
        with torch.no_grad():
            for out, penalty in ((expected, 3.0), (plain, 1.0)):
                seq = omni_ref.thinker.generate(
                    **kw, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, repetition_penalty=penalty
                )
                out[f"p{i}"] = seq[0, n:].tolist()
        params = {
            "temperature": 0,
            "max_tokens": NEW,
            "ignore_eos": True,
            "return_audio": False,
            "repetition_penalty": 3.0,
        }
        stage.add(StageRequest(f"p{i}", {"messages": messages, "audio_embeds": _embeds(omni_dir, [clip])}, params))
    got = {rid: [t for e in ems for t in e.outputs.get("tokens", [])] for rid, ems in run_stage(stage).items()}
    assert got == expected
    assert expected != plain  # the penalty changes these answers


def test_output_modalities_choose_speech_rows_and_bad_values_are_the_requests_fault(omni_dir):
    stage = ThinkerStage(make_ctx("thinker", omni_dir))
    base = {"temperature": 0, "max_tokens": 3}
    stage.add(StageRequest("t", {"messages": _messages(0, "Hi")}, {**base, "modalities": ["text"]}))
    stage.add(
        StageRequest(
            "a", {"messages": _messages(0, "Hi")}, {**base, "modalities": ["text", "audio"], "return_audio": False}
        )
    )
    stage.add(StageRequest("bad", {"messages": _messages(0, "Hi")}, {**base, "modalities": ["video"]}))
    stage.add(StageRequest("bad2", {"messages": _messages(0, "Hi")}, {**base, "return_audio": "yes"}))
    got = run_stage(stage)
    assert not any("talker_embeds" in e.outputs for e in got["t"])
    assert any("talker_embeds" in e.outputs for e in got["a"])
    assert got["bad"][-1].error_kind == "invalid_request" and got["bad"][-1].param == "modalities"
    assert got["bad2"][-1].error_kind == "invalid_request" and got["bad2"][-1].param == "return_audio"
