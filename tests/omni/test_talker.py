"""The `talker` stage, fed by the `thinker` stage as it writes, against transformers'
Qwen2_5OmniForConditionalGeneration.generate: greedy codec tokens identical."""

from __future__ import annotations

import pytest
import torch

from omnistage.stages.base import StageRequest
from omnistage.stages.omni.inputs import OmniProcessor
from omnistage.stages.omni.talker import TalkerStage
from omnistage.stages.omni.thinker import ThinkerStage

from .conftest import load_reference, make_ctx, reference_processor, run_stage
from .test_thinker import _clip, _embeds, _messages

N_TEXT = 12
N_CODES = 40


class _Captured(Exception):
    pass


def reference_codes(model, model_dir, messages, clips, voice, images=None, forced=None):
    """transformers' codec tokens (up to the end token) two ways: (defined, generated).

    Both start from the talker inputs `Qwen2_5OmniForConditionalGeneration.generate()` builds
    (observed at its talker.generate call; the run stops there, token2wav is not needed).
    generated: that talker.generate() itself. transformers 5.x drops an all-ones attention mask
    before the forward, and the talker's forward only adds the codec pad / bos embeddings to
    the prompt when it gets the mask; defined: a greedy loop over the talker's forward given
    the mask (the model as defined), with generate()'s own logits processors. `forced`: token
    ids the thinker is made to write (then its end token) instead of its greedy choice."""
    text = OmniProcessor(model_dir).prompt_text(messages, speech=True)
    kw = reference_processor(model_dir)(text=[text], audio=clips or None, images=images or None, return_tensors="pt")
    extra = (
        {"input_features": kw["input_features"], "feature_attention_mask": kw["feature_attention_mask"]}
        if clips
        else {}
    )
    if images:
        extra.update(pixel_values=kw["pixel_values"], image_grid_thw=kw["image_grid_thw"])
    talker = model.talker
    eos = [talker.codec_pad_token, talker.config.tts_codec_end_token_id]
    captured = {}
    original = talker.generate

    def observe(*args, **kwargs):
        captured.update(kwargs)
        raise _Captured

    if forced is not None:
        end = _im_end(model_dir)
        extra["thinker_logits_processor"] = [_Forced(kw["input_ids"].shape[1], [*forced, end])]
    n_text = N_TEXT if forced is None else len(forced) + 1
    talker.generate = observe
    try:
        with torch.no_grad():
            model.generate(
                input_ids=kw["input_ids"], attention_mask=kw["attention_mask"], speaker=voice,
                thinker_max_new_tokens=n_text, thinker_min_new_tokens=n_text, thinker_do_sample=False,
                talker_do_sample=False, talker_max_new_tokens=N_CODES, talker_eos_token_id=eos, **extra,
            )  # fmt: skip
    except _Captured:
        pass
    finally:
        del talker.generate
    assert captured["attention_mask"] is not None and bool((captured["attention_mask"] == 1).all())
    defined = _greedy_forward_loop(talker, captured, eos)
    if images:  # transformers 5.24's generate() passes pixel_values on to the talker, which rejects them
        with pytest.raises(ValueError, match="pixel_values"), torch.no_grad():
            original(**{**captured, "inputs_embeds": captured["inputs_embeds"].clone()})
        return defined, None
    with torch.no_grad():
        out = original(**{**captured, "inputs_embeds": captured["inputs_embeds"].clone()})
    return defined, _until_end(out[0, captured["input_ids"].shape[1] :].tolist(), eos)


class _Forced:
    """A logits processor that makes generate() write the given ids, one per step."""

    def __init__(self, prompt_len, ids):
        self.prompt_len, self.ids = prompt_len, ids

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.ids[input_ids.shape[1] - self.prompt_len]] = 0
        return forced


def _im_end(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir)).convert_tokens_to_ids("<|im_end|>")


def _until_end(codes, eos):
    ends = [i for i, c in enumerate(codes) if c in eos]
    return codes[: ends[0]] if ends else codes


def _greedy_forward_loop(talker, kw, eos):
    from transformers import DynamicCache, LogitsProcessorList, RepetitionPenaltyLogitsProcessor
    from transformers.generation.logits_process import SuppressTokensLogitsProcessor

    processors = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"]),
            SuppressTokensLogitsProcessor(kw["suppress_tokens"]),
        ]
    )
    ids = kw["input_ids"].clone()
    mask = kw["attention_mask"]
    cache = DynamicCache(config=talker.config)
    with torch.no_grad():
        out = talker(
            inputs_embeds=kw["inputs_embeds"].clone(), input_text_ids=kw["input_text_ids"], attention_mask=mask,
            image_grid_thw=kw.get("image_grid_thw"), thinker_reply_part=kw["thinker_reply_part"], cache=cache,
            use_cache=True,
        )  # fmt: skip
        codes = []
        for _ in range(N_CODES):
            token = int(processors(ids, out.logits[:, -1]).argmax(-1))
            codes.append(token)
            if token in eos:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
            out = talker(
                input_ids=torch.tensor([[token]]), input_text_ids=kw["input_text_ids"], attention_mask=mask,
                thinker_reply_part=out.thinker_reply_part, cache=out.cache, use_cache=True,
            )  # fmt: skip
    return _until_end(codes, eos)


def _thinker_params():
    return {"temperature": 0, "max_tokens": N_TEXT, "ignore_eos": True, "return_audio": True}


def _talker_params(voice):
    return {"temperature": 0, "max_tokens": N_CODES, "voice": voice}


def run_streaming(thinker, talker):
    """Step both stages in turn, the thinker's talker_embeds fed to the talker as they come:
    {request_id: codes}, and how many talker steps found every live request waiting for rows."""
    codes, waits = {}, 0
    while thinker.has_work() or talker.has_work() or talker.num_requests():
        for e in thinker.step():
            assert not e.error, e.error
            chunk = e.outputs.get("talker_embeds")
            if chunk is not None or e.finished:
                talker.feed(e.request_id, "talker_embeds", chunk, e.finished)
        if talker.has_work():
            for e in talker.step():
                assert not e.error, e.error
                codes.setdefault(e.request_id, []).extend(e.outputs.get("codes", []))
        elif talker.num_requests():
            waits += 1
            assert thinker.has_work(), "the talker waits although the thinker has finished"
    return codes, waits


CASES = [((), "Say something nice.", "Chelsie"), ((1.6,), "What do you hear?", "Ethan")]


@pytest.mark.parametrize(
    "variant,mode", [("base", "defined"), ("gqa", "defined"), ("base", "generated"), ("gqa", "generated")]
)
def test_streamed_talker_codes_equal_transformers(variant, mode, omni_dir, omni_gqa_dir, omni_ref):
    model_dir = omni_dir if variant == "base" else omni_gqa_dir
    model = omni_ref if variant == "base" else load_reference(omni_gqa_dir)
    thinker = ThinkerStage(make_ctx("thinker", model_dir, max_num_batched_tokens=48))
    talker = TalkerStage(make_ctx("talker", model_dir, params={"generate_compat": mode == "generated"}))
    expected = {}
    for i, (lengths, text, voice) in enumerate(CASES):
        clips = [_clip(s, 7 + i + j) for j, s in enumerate(lengths)]
        messages = _messages(len(clips), text)
        defined, generated = reference_codes(model, model_dir, messages, clips, voice)
        expected[f"s{i}"] = defined if mode == "defined" else generated
        inputs = {"messages": messages, **({"audio_embeds": _embeds(model_dir, clips)} if clips else {})}
        thinker.add(StageRequest(f"s{i}", inputs, _thinker_params()))
        talker.add(StageRequest(f"s{i}", {}, _talker_params(voice)))
    assert all(len(c) >= 8 for c in expected.values()), expected
    assert len({c for codes in expected.values() for c in codes}) >= 8  # a diverse reference
    codes, waits = run_streaming(thinker, talker)
    assert codes == expected
    assert waits > 0  # it caught up with the thinker and waited for rows
    assert talker.engine.num_free_blocks == talker.engine.num_total_blocks


def test_a_waiting_talker_sequence_does_not_stall_its_batch(omni_dir, omni_ref):
    """Request A has its whole thinker stream; B gets only its first rows. A runs to the end
    while B waits; then B's remaining rows arrive and B finishes with transformers' codes."""
    thinker = ThinkerStage(make_ctx("thinker", omni_dir))
    streams = {}
    expected = {}
    for rid, (lengths, text, voice) in zip("AB", CASES):
        clips = [_clip(s, 3) for s in lengths]
        messages = _messages(len(clips), text)
        expected[rid] = reference_codes(omni_ref, omni_dir, messages, clips, voice)[0]
        inputs = {"messages": messages, **({"audio_embeds": _embeds(omni_dir, clips)} if clips else {})}
        thinker.add(StageRequest(rid, inputs, _thinker_params()))
    for rid, ems in run_stage(thinker).items():
        streams[rid] = [e.outputs["talker_embeds"] for e in ems if "talker_embeds" in e.outputs]

    talker = TalkerStage(make_ctx("talker", omni_dir))
    for rid, (_, _, voice) in zip("AB", CASES):
        talker.add(StageRequest(rid, {}, _talker_params(voice)))
    for chunk in streams["A"]:
        talker.feed("A", "talker_embeds", chunk, False)
    talker.feed("A", "talker_embeds", None, True)
    for chunk in streams["B"][:3]:  # prompt + 2 reply rows
        talker.feed("B", "talker_embeds", chunk, False)
    got = run_stage(talker)
    assert "info" in got["A"][-1].outputs  # A finished while B waited for rows
    assert talker.num_requests() == 1 and not talker.has_work()
    codes_a = [c for e in got["A"] for c in e.outputs.get("codes", [])]
    assert codes_a == expected["A"]
    steps_b = sum("B" in r.request_ids for r in talker.step_log)
    assert 0 < steps_b < len(expected["B"])  # B ran until its rows ran out, then waited

    for chunk in streams["B"][3:]:
        talker.feed("B", "talker_embeds", chunk, False)
    talker.feed("B", "talker_embeds", None, True)
    codes_b = [c for e in got["B"] for c in e.outputs.get("codes", [])]
    codes_b += [c for e in run_stage(talker)["B"] for c in e.outputs.get("codes", [])]
    assert codes_b == expected["B"]
    assert talker.engine.num_free_blocks == talker.engine.num_total_blocks


def test_eight_concurrent_requests_get_what_they_get_alone_and_cancel_frees_kv(omni_dir, omni_ref):
    """Eight requests with different prompts, audio and voices run together through thinker and
    talker; each gets transformers' codes for it alone. Two more are cancelled mid-answer in
    both stages: the others are unaffected and both KV pools end full."""
    texts = ["Hello there.", "What do you hear?", "Sing a song.", "Describe the noise.", "Count to five.",
             "Is it music?", "Tell me more.", "Why?"]  # fmt: skip
    thinker = ThinkerStage(make_ctx("thinker", omni_dir, max_num_batched_tokens=128))
    talker = TalkerStage(make_ctx("talker", omni_dir))
    expected = {}
    for i, text in enumerate(texts):
        clips = [_clip(0.4 + 0.3 * i, 100 + i)] if i % 2 else []
        voice = ("Chelsie", "Ethan")[i % 3 % 2]
        messages = _messages(len(clips), text)
        expected[f"c{i}"] = reference_codes(omni_ref, omni_dir, messages, clips, voice)[0]
        inputs = {"messages": messages, **({"audio_embeds": _embeds(omni_dir, clips)} if clips else {})}
        thinker.add(StageRequest(f"c{i}", inputs, _thinker_params()))
        talker.add(StageRequest(f"c{i}", {}, _talker_params(voice)))
    for rid in ("x0", "x1"):  # to be cancelled
        thinker.add(StageRequest(rid, {"messages": _messages(0, "A long answer, please.")}, _thinker_params()))
        talker.add(StageRequest(rid, {}, _talker_params("Ethan")))
    codes, steps, cancelled = {}, 0, False
    while thinker.has_work() or talker.has_work() or talker.num_requests():
        for e in thinker.step():
            chunk = e.outputs.get("talker_embeds")
            if chunk is not None or e.finished:
                talker.feed(e.request_id, "talker_embeds", chunk, e.finished)
        if talker.has_work():
            for e in talker.step():
                codes.setdefault(e.request_id, []).extend(e.outputs.get("codes", []))
        steps += 1
        if not cancelled and {"x0", "x1"} <= set(codes):  # both are decoding in both stages now
            assert thinker.engine.requests.keys() >= {"x0", "x1"}
            for stage in (thinker, talker):
                stage.abort("x0")
                stage.abort("x1")
            cancelled = True
    assert cancelled
    assert {rid: codes[rid] for rid in expected} == expected
    assert len(codes["x0"]) < N_CODES and len(codes["x1"]) < N_CODES
    assert max(r.batch_size for r in talker.step_log) >= 8  # they really ran together
    for stage in (thinker, talker):
        assert stage.num_requests() == 0
        assert stage.engine.num_free_blocks == stage.engine.num_total_blocks


def test_queued_voice_check_refuses_only_voices_the_checkpoint_lacks(omni_dir):
    """What the jobs API and realtime session.update ask before queueing: a voice the
    checkpoint's spk_dict.pt lacks is refused naming the voices; none or "" is the default."""
    from omnistage.errors import InvalidRequestError
    from omnistage.graph.inputs import check_params
    from omnistage.graph.loader import load_pipeline

    spec = load_pipeline("tiny-omni")
    for ok in ({}, {"voice": None}, {"voice": ""}, {"voice": "Ethan"}, {"voice": "Chelsie"}):
        check_params(spec, {"talker": ok}, queued=True)
    with pytest.raises(InvalidRequestError) as err:
        check_params(spec, {"talker": {"voice": "alloy"}}, queued=True)
    assert err.value.param == "voice" and "Chelsie" in str(err.value) and "Ethan" in str(err.value)
