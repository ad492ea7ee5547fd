"""Images: the `vision_encoder` stage and image prompts in the thinker, against transformers."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.stages.base import StageRequest
from omnistage.stages.omni.inputs import OmniProcessor
from omnistage.stages.omni.thinker import ThinkerStage
from omnistage.stages.omni.vision_encoder import VisionEncoderStage

from .conftest import load_reference, make_ctx, reference_processor, run_stage
from .test_thinker import _clip, _embeds

NEW = 10


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8))


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _image_embeds(model_dir, images):
    enc = VisionEncoderStage(make_ctx("vision_encoder", model_dir))
    enc.add(StageRequest("x", {"images": images}))
    return run_stage(enc)["x"][-1].outputs["image_embeds"]


def test_batched_image_embeddings_equal_transformers_alone(omni_dir, omni_ref):
    imgs = [_image(60, 90, 0), _image(120, 64, 1), _image(33, 47, 2)]
    stage = VisionEncoderStage(make_ctx("vision_encoder", omni_dir, max_batch_size=8))
    stage.add(StageRequest("a", {"images": imgs[0]}))
    stage.add(StageRequest("b", {"images": [_png(imgs[1]), np.asarray(imgs[2])]}))
    stage.add(StageRequest("bad", {"images": b"\x89PNG broken"}))
    got = {}
    while stage.has_work():
        got.update({e.request_id: e for e in stage.step()})
    assert got["bad"].error_kind == "invalid_request" and got["bad"].param == "images"
    assert max(r.batch_size for r in stage.step_log) == 2
    flat = [*got["a"].outputs["image_embeds"], *got["b"].outputs["image_embeds"]]
    ref_proc = reference_processor(omni_dir).image_processor
    for img, item in zip(imgs, flat):
        px = ref_proc(images=[img], return_tensors="pt")
        assert item["grid_thw"] == px["image_grid_thw"][0].tolist()
        with torch.no_grad():
            ref = omni_ref.thinker.get_image_features(px["pixel_values"], px["image_grid_thw"]).pooler_output[0]
        torch.testing.assert_close(item["embeds"], ref, rtol=1e-5, atol=1e-5)


def _messages(parts, text):
    return [{"role": "user", "content": [*({"type": t} for t in parts), {"type": "text", "text": text}]}]


def reference_tokens(model, model_dir, messages, imgs, clips, speech, new=NEW):
    """transformers with images: greedy tokens of Qwen2_5OmniForConditionalGeneration.generate
    (text mode) and the talker's prompt rows from the thinker's generate(output_hidden_states)."""
    prompt = OmniProcessor(model_dir).prompt_text(messages, speech=speech)
    kw = reference_processor(model_dir)(text=[prompt], images=imgs, audio=clips or None, return_tensors="pt")
    kw.pop("num_audio_tokens", None)
    with torch.no_grad():
        out = model.thinker.generate(
            **kw, max_new_tokens=new, min_new_tokens=new, do_sample=False,
            output_hidden_states=True, return_dict_in_generate=True,
        )  # fmt: skip
        seq = model.generate(
            **kw, generation_mode="text", speaker="Chelsie",
            thinker_max_new_tokens=new, thinker_min_new_tokens=new, thinker_do_sample=False,
        )  # fmt: skip
    ids = kw["input_ids"]
    tokens = seq[0, ids.shape[1] :].tolist()
    assert out.sequences[0, ids.shape[1] :].tolist() == tokens
    hs = out.hidden_states
    emb0 = hs[0][0][0].clone()
    cfg = model.config.thinker_config
    emb0[(ids[0] == cfg.image_token_index) | (ids[0] == cfg.audio_token_index)] = 0
    return tokens, emb0 + hs[0][-1][0]


CASES = [  # (parts in order, text, image sizes, audio seconds, return_audio)
    (("image",), "What is in the picture?", [(60, 90)], [], True),
    (("audio", "image", "image"), "Compare them.", [(56, 56), (100, 70)], [0.9], False),
]


@pytest.mark.parametrize("variant", ["base", "gqa"])
def test_image_prompts_equal_transformers(variant, omni_dir, omni_gqa_dir, omni_ref):
    model_dir = omni_dir if variant == "base" else omni_gqa_dir
    model = omni_ref if variant == "base" else load_reference(omni_gqa_dir)
    stage = ThinkerStage(make_ctx("thinker", model_dir, max_num_batched_tokens=40))
    expected = {}
    for i, (parts, text, sizes, seconds, speech) in enumerate(CASES):
        imgs = [_image(h, w, 10 + i + k) for k, (h, w) in enumerate(sizes)]
        clips = [_clip(s, 30 + i) for s in seconds]
        messages = _messages(parts, text)
        tokens, prompt_rows = reference_tokens(model, model_dir, messages, imgs, clips, speech)
        expected[f"m{i}"] = (tokens, prompt_rows, speech)
        inputs = {"messages": messages, "image_embeds": _image_embeds(model_dir, imgs)}
        if clips:
            inputs["audio_embeds"] = _embeds(model_dir, clips)
        params = {"temperature": 0, "max_tokens": NEW, "ignore_eos": True, "return_audio": speech}
        stage.add(StageRequest(f"m{i}", inputs, params))
    got = run_stage(stage)
    for rid, (tokens, prompt_rows, speech) in expected.items():
        ems = got[rid]
        assert not any(e.error for e in ems), [e.error for e in ems]
        assert [t for e in ems for t in e.outputs.get("tokens", [])] == tokens
        if speech:
            first = next(e.outputs["talker_embeds"] for e in ems if "talker_embeds" in e.outputs)
            torch.testing.assert_close(first["prompt"], prompt_rows, rtol=1e-4, atol=1e-4)
            assert first["positions"].shape == (3, prompt_rows.shape[0])
            assert (first["positions"][1] != first["positions"][2]).any()  # genuinely 3-D


def test_talker_codes_for_an_image_prompt_equal_transformers(omni_dir, omni_ref):
    """An image in the prompt: the talker prefill takes the thinker's 3-D positions."""
    from omnistage.stages.omni.talker import TalkerStage

    from .test_talker import _talker_params, _thinker_params, reference_codes, run_streaming

    img = _image(84, 112, 5)
    messages = _messages(("image",), "What is in the picture?")
    expected, _ = reference_codes(omni_ref, omni_dir, messages, [], "Ethan", images=[img])
    assert len(set(expected)) >= 5
    thinker = ThinkerStage(make_ctx("thinker", omni_dir))
    talker = TalkerStage(make_ctx("talker", omni_dir))
    thinker.add(
        StageRequest("v", {"messages": messages, "image_embeds": _image_embeds(omni_dir, [img])}, _thinker_params())
    )
    talker.add(StageRequest("v", {}, _talker_params("Ethan")))
    codes, _ = run_streaming(thinker, talker)
    assert codes["v"] == expected
