"""The text_encoder stage batches prompts of several requests in one call and gives, row for
row, what diffusers' encode_prompt gives for each prompt alone."""

from __future__ import annotations

import torch

from omnistage.stages.base import StageRequest


def encode_batch(make_ctx_fn, model_dir, requests):
    from omnistage.stages.diffusion.text_encoder import TextEncoderStage

    stage = TextEncoderStage(make_ctx_fn("text_encoder", model_dir))
    for rid, prompt, params in requests:
        stage.add(StageRequest(rid, {"prompt": prompt}, params))
    out = {}
    while stage.num_requests():
        for em in stage.step():
            assert em.error is None, em.error
            out[em.request_id] = em.outputs
    return stage, out


def test_sd3_rows_equal_diffusers_encode_prompt(sd3_dir, make_ctx_fn):
    from diffusers import DiffusionPipeline

    reqs = [
        ("a", "a photo of a cat", {"max_sequence_length": 24, "guidance_scale": 5.0}),
        ("b", "a lighthouse at dawn", {"max_sequence_length": 24, "negative_prompt": "blurry"}),
        ("c", "a red chair", {"max_sequence_length": 24, "guidance_scale": 1.0}),  # no CFG: one row
    ]
    stage, out = encode_batch(make_ctx_fn, sd3_dir, reqs)
    assert [r.request_ids for r in stage.step_log] == [("a", "b", "c")]  # one batched call
    pipe = DiffusionPipeline.from_pretrained(sd3_dir, dtype=torch.float32)
    for rid, prompt, params in reqs:
        do_cfg = params.get("guidance_scale", 7.0) > 1
        pe, npe, pp, npp = pipe.encode_prompt(
            prompt,
            None,
            None,
            do_classifier_free_guidance=do_cfg,
            negative_prompt=params.get("negative_prompt"),
            max_sequence_length=24,
            device=torch.device("cpu"),
        )
        got = out[rid]
        assert got["prompt_embeds"].shape[0] == (2 if do_cfg else 1)
        torch.testing.assert_close(got["prompt_embeds"][0:1], pe, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["pooled_prompt_embeds"][0:1], pp, atol=1e-5, rtol=1e-5)
        if do_cfg:
            torch.testing.assert_close(got["prompt_embeds"][1:2], npe, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got["pooled_prompt_embeds"][1:2], npp, atol=1e-5, rtol=1e-5)


def test_flux_rows_equal_diffusers_encode_prompt(flux_dir, make_ctx_fn):
    from diffusers import DiffusionPipeline

    reqs = [
        ("a", "a photo of a cat", {"max_sequence_length": 32}),
        ("b", " ".join(["a lighthouse at dawn"] * 20), {"max_sequence_length": 32}),  # truncated
    ]
    stage, out = encode_batch(make_ctx_fn, flux_dir, reqs)
    pipe = DiffusionPipeline.from_pretrained(flux_dir, dtype=torch.float32)
    for rid, prompt, _ in reqs:
        pe, pp, _ids = pipe.encode_prompt(prompt, None, max_sequence_length=32, device=torch.device("cpu"))
        torch.testing.assert_close(out[rid]["prompt_embeds"], pe, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[rid]["pooled_prompt_embeds"], pp, atol=1e-5, rtol=1e-5)
    assert out["a"]["warnings"] == []
    assert len(out["b"]["warnings"]) == 2  # CLIP (77 tokens) and T5 (32) both cut it
