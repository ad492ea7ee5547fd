"""Spoken answers take prefix-cache hits: a second turn of a conversation reuses the first
turn's KV blocks (and the talker rows kept for them) under the same cache_salt, never under
another salt, and its text and codec tokens still equal transformers'."""

from __future__ import annotations

from transformers import AutoTokenizer

from omnistage.stages.base import StageRequest
from omnistage.stages.omni.talker import TalkerStage
from omnistage.stages.omni.thinker import ThinkerStage

from .conftest import make_ctx
from .test_speak import run_streaming_recording
from .test_talker import N_CODES, N_TEXT, reference_codes
from .test_thinker import _clip, _embeds, _messages, _reference


def _turn(thinker, talker, rid, messages, embeds, salt, voice="Ethan", speech=True):
    params = {"temperature": 0, "max_tokens": N_TEXT, "ignore_eos": True, "return_audio": speech}
    if salt is not None:
        params["cache_salt"] = salt
    thinker.add(StageRequest(rid, {"messages": messages, "audio_embeds": embeds}, params))
    if speech:
        talker.add(StageRequest(rid, {}, {"temperature": 0, "max_tokens": N_CODES, "voice": voice}))
    record = {}
    codes, _ = run_streaming_recording(thinker, talker, record)
    tokens = [t for e in record[rid] for t in e.outputs.get("tokens", [])]
    return tokens, codes.get(rid, []), record[rid][-1].outputs["info"]["usage"]["cached_tokens"]


def test_second_turn_hits_the_cache_with_its_salt_only_and_equals_transformers(omni_dir, omni_ref):
    tok = AutoTokenizer.from_pretrained(str(omni_dir))
    clip = _clip(1.2, 31)
    embeds = _embeds(omni_dir, [clip])
    thinker = ThinkerStage(make_ctx("thinker", omni_dir, max_num_batched_tokens=64))
    talker = TalkerStage(make_ctx("talker", omni_dir))

    first = _messages(1, "What do you hear?")
    tokens1, codes1, cached1 = _turn(thinker, talker, "t1", first, embeds, "session-a")
    assert cached1 == 0
    assert codes1 == reference_codes(omni_ref, omni_dir, first, [clip], "Ethan")[0]
    second = [
        *first,
        {"role": "assistant", "content": tok.decode(tokens1, skip_special_tokens=True)},
        {"role": "user", "content": "Say more."},
    ]
    want_tokens, _, _ = _reference(omni_ref, omni_dir, second, [clip], True, N_TEXT)
    want_codes, _ = reference_codes(omni_ref, omni_dir, second, [clip], "Ethan")

    results = {}
    for rid, salt in (("same", "session-a"), ("other", "session-b"), ("none", None)):
        results[rid] = _turn(thinker, talker, rid, second, embeds, salt)
    assert results["same"][2] >= 64  # the first turn's prompt blocks (system prompt, audio)
    assert results["other"][2] == 0 and results["none"][2] == 0
    for rid, (tokens, codes, _) in results.items():
        assert (tokens, codes) == (want_tokens, want_codes), rid
    assert len(set(want_codes)) >= 5
    assert thinker.engine.num_free_blocks == thinker.engine.num_total_blocks


def test_text_only_blocks_are_not_hit_by_a_spoken_request(omni_dir, omni_ref):
    """A text answer's blocks have no talker rows kept: a spoken request with the same salt and
    prompt computes its own (and then a second spoken one hits those)."""
    clip = _clip(0.9, 41)
    embeds = _embeds(omni_dir, [clip])
    thinker = ThinkerStage(make_ctx("thinker", omni_dir))
    talker = TalkerStage(make_ctx("talker", omni_dir))
    messages = _messages(1, "Listen.")
    want, _ = reference_codes(omni_ref, omni_dir, messages, [clip], "Chelsie")
    text = _turn(thinker, talker, "text", messages, embeds, "s", speech=False)
    assert text[1] == []
    hits = []
    for rid in ("spoken1", "spoken2"):
        _, codes, cached = _turn(thinker, talker, rid, messages, embeds, "s", voice="Chelsie")
        assert codes == want
        hits.append(cached)
    assert hits[0] == 0 and hits[1] > 0
