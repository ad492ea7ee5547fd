"""Speak mode (text-to-speech): the thinker is made to say a given text and the talker speaks
it; judged against transformers' Qwen2.5-Omni generate() with its thinker forced to write the
same tokens (a logits processor), whose talker inputs it builds itself."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from omnistage.stages.base import StageRequest
from omnistage.stages.omni.talker import TalkerStage
from omnistage.stages.omni.thinker import ThinkerStage

from .conftest import load_reference, make_ctx, run_stage
from .test_talker import N_CODES, reference_codes, run_streaming
from .test_thinker import _clip, _embeds, _messages

SAY = "The sea is calm tonight, and the moon lies fair."


def _speak_request(rid, say, voice, messages=None, embeds=None, salt=None):
    inputs = {"speak": say}
    if messages is not None:
        inputs["messages"] = messages
    if embeds is not None:
        inputs["audio_embeds"] = embeds
    thinker = {"max_tokens": 3, "temperature": 0.7, **({"cache_salt": salt} if salt else {})}
    return StageRequest(rid, inputs, thinker), StageRequest(
        rid, {}, {"temperature": 0, "max_tokens": N_CODES, "voice": voice}
    )


@pytest.mark.parametrize("variant", ["base", "gqa"])
def test_spoken_text_gives_transformers_codes_for_that_forced_reply(variant, omni_dir, omni_gqa_dir, omni_ref):
    model_dir = omni_dir if variant == "base" else omni_gqa_dir
    model = omni_ref if variant == "base" else load_reference(omni_gqa_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    thinker = ThinkerStage(make_ctx("thinker", model_dir, max_num_batched_tokens=48))
    talker = TalkerStage(make_ctx("talker", model_dir))
    clip = _clip(1.2, 5)
    conversation = _messages(1, "Say something about the sea.")
    cases = {  # request id: (text, voice, messages, audio clips)
        "plain": (SAY, "Chelsie", None, []),
        "in_context": ("Waves, and then silence.", "Ethan", conversation, [clip]),
    }
    expected, thinker_out = {}, {}
    for rid, (say, voice, messages, clips) in cases.items():
        forced = tok(say, add_special_tokens=False)["input_ids"]
        reference_messages = messages or [{"role": "user", "content": say}]
        expected[rid], _ = reference_codes(model, model_dir, reference_messages, clips, voice, forced=forced)
        embeds = _embeds(model_dir, clips) if clips else None
        t_req, k_req = _speak_request(rid, say, voice, messages, embeds)
        thinker.add(t_req)
        talker.add(k_req)
    assert all(len(c) >= 3 for c in expected.values()) and sum(map(len, expected.values())) >= 16, expected
    assert expected["plain"] != expected["in_context"]

    codes, _ = run_streaming_recording(thinker, talker, thinker_out)
    assert codes == expected
    for rid, (say, *_rest) in cases.items():
        text = "".join(e.outputs.get("text", "") for e in thinker_out[rid])
        tokens = [t for e in thinker_out[rid] for t in e.outputs.get("tokens", [])]
        assert text == say
        assert tokens == tok(say, add_special_tokens=False)["input_ids"]
        info = thinker_out[rid][-1].outputs["info"]
        assert info["usage"]["completion_tokens"] == len(tokens)
    assert thinker.engine.num_free_blocks == thinker.engine.num_total_blocks
    assert talker.engine.num_free_blocks == talker.engine.num_total_blocks


def run_streaming_recording(thinker, talker, record):
    """run_streaming with the thinker's emissions kept per request in `record`."""
    original = thinker.step

    def step():
        emissions = original()
        for e in emissions:
            record.setdefault(e.request_id, []).append(e)
        return emissions

    thinker.step = step
    try:
        return run_streaming(thinker, talker)
    finally:
        del thinker.step


def test_speak_needs_text_and_a_text_only_speak_request_makes_no_talker_rows(omni_dir):
    thinker = ThinkerStage(make_ctx("thinker", omni_dir))
    thinker.add(StageRequest("blank", {"speak": "  "}, {}))
    thinker.add(StageRequest("number", {"speak": 3}, {}))
    thinker.add(StageRequest("text", {"speak": SAY}, {"modalities": ["text"]}))
    out = run_stage(thinker)
    for rid in ("blank", "number"):
        assert out[rid][-1].error is not None and "speak must be a non-empty string" in str(out[rid][-1].error)
    text = out["text"]
    assert "".join(e.outputs.get("text", "") for e in text) == SAY
    assert not any("talker_embeds" in e.outputs for e in text)
    assert text[-1].absent_ports == ("talker_embeds",)
