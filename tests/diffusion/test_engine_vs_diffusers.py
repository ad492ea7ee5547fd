"""The three diffusion engines, driven in-process, give diffusers' pixels for the same seed.

Reference: the diffusers StableDiffusion3Pipeline / FluxPipeline loaded from the same tiny
checkpoint (save_pretrained layout), output_type="np", a CPU generator seeded the same way.
Pixels are compared as [0,1] floats (output_type "float") within 1e-4: the measured agreement
is float32 rounding (~1e-6), and test_sensitivity_and_mixed.py shows a wrong step count, prompt,
guidance or single timestep moves the reference by more than 1e-3.
"""

from __future__ import annotations

import numpy as np
import pytest

TOL = 1e-4  # measured agreement ~1e-6; see test_sensitivity_and_mixed.py
SMALL = dict(height=32, width=32, max_sequence_length=24)
FAMILY_EXTRA = {"sd3": dict(guidance_scale=4.0), "flux": dict(guidance_scale=3.5)}


@pytest.fixture(params=["sd3", "flux"])
def family(request, sd3_dir, flux_dir):
    return request.param, {"sd3": sd3_dir, "flux": flux_dir}[request.param]


def assert_matches(out, ref):
    out = out.numpy() if hasattr(out, "numpy") else out
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == np.float32
    err = float(np.abs(out - ref).max())
    assert err <= TOL, f"max |omnistage - diffusers| = {err}"


def test_alone_matches_diffusers(family, local_graph, reference):
    name, model_dir = family
    g = local_graph(model_dir)
    params = dict(SMALL, num_inference_steps=4, seed=7, **FAMILY_EXTRA[name])
    g.submit("r", "a photo of a cat sitting on a red chair", **params)
    g.run()
    assert not g.errors
    assert g.progress["r"] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert_matches(g.results["r"], reference(model_dir, "a photo of a cat sitting on a red chair", **params))


def test_requests_joining_at_different_steps_share_forwards(family, local_graph, reference):
    name, model_dir = family
    g = local_graph(model_dir, max_batch_size=8)
    reqs = {
        "a": dict(seed=1, num_inference_steps=6, prompt="an astronaut riding a horse on the moon"),
        "b": dict(seed=2, num_inference_steps=3, prompt="a watercolor painting of a lighthouse at dawn"),
        "c": dict(seed=3, num_inference_steps=5, prompt="a bowl of fruit on a wooden table"),
        "d": dict(seed=4, num_inference_steps=4, prompt="a small house in a snowy forest"),
        "e": dict(seed=5, num_inference_steps=2, prompt="a city street at night in the rain"),
    }
    order = list(reqs)
    g.submit(
        order[0],
        reqs[order[0]]["prompt"],
        **SMALL,
        **FAMILY_EXTRA[name],
        **{k: v for k, v in reqs[order[0]].items() if k != "prompt"},
    )
    joined = 1
    while g.busy() or joined < len(order):
        g.tick()
        if joined < len(order):  # one more request joins after every engine tick
            rid = order[joined]
            g.submit(
                rid,
                reqs[rid]["prompt"],
                **SMALL,
                **FAMILY_EXTRA[name],
                **{k: v for k, v in reqs[rid].items() if k != "prompt"},
            )
            joined += 1
    assert not g.errors
    # proof from the batch record: forwards held several requests at different step indices
    log = g.dn.step_log
    mixed = [r for r in log if len(r.request_ids) >= 2 and len(set(r.extra["step_indices"])) >= 2]
    assert mixed, [(r.request_ids, r.extra["step_indices"]) for r in log]
    assert max(len(r.request_ids) for r in log) >= 4
    assert sum(len(r.request_ids) for r in log) == sum(v["num_inference_steps"] for v in reqs.values())
    assert len(log) < sum(v["num_inference_steps"] for v in reqs.values())
    for rid, r in reqs.items():
        params = dict(SMALL, **FAMILY_EXTRA[name], seed=r["seed"], num_inference_steps=r["num_inference_steps"])
        assert_matches(g.results[rid], reference(model_dir, r["prompt"], **params))


def test_beside_requests_of_other_sizes(family, local_graph, reference):
    name, model_dir = family
    g = local_graph(model_dir)
    sizes = {"big": (48, 48, 6), "small1": (32, 32, 3), "wide": (32, 48, 3), "small2": (32, 32, 2)}
    for i, (rid, (h, w, steps)) in enumerate(sizes.items()):
        g.submit(
            rid,
            "a photo of a cat",
            height=h,
            width=w,
            num_inference_steps=steps,
            seed=10 + i,
            max_sequence_length=24,
            **FAMILY_EXTRA[name],
        )
        g.tick()
    g.run()
    assert not g.errors
    for rec in g.dn.step_log:  # a forward never mixes latent shapes
        shapes = {tuple(g.params[r][k] for k in ("height", "width")) for r in rec.request_ids}
        assert len(shapes) == 1
    # the big request (first to arrive, most steps) did not hold the small ones behind it
    finish_index = {}
    for i, rec in enumerate(g.dn.step_log):
        for rid in rec.request_ids:
            finish_index[rid] = i
    assert finish_index["small1"] < finish_index["big"]
    for i, (rid, (h, w, steps)) in enumerate(sizes.items()):
        params = dict(
            height=h, width=w, num_inference_steps=steps, seed=10 + i, max_sequence_length=24, **FAMILY_EXTRA[name]
        )
        assert_matches(g.results[rid], reference(model_dir, "a photo of a cat", **params))


def test_num_images_per_prompt_two(family, local_graph, reference):
    name, model_dir = family
    g = local_graph(model_dir)
    params = dict(SMALL, num_inference_steps=3, seed=11, num_images_per_prompt=2, **FAMILY_EXTRA[name])
    g.submit("n2", "portrait of an old man with a beard", **params)
    g.submit("n1", "portrait of an old man with a beard", **dict(params, num_images_per_prompt=1, seed=12))
    g.run()
    assert not g.errors
    out = g.results["n2"]
    assert out.shape[0] == 2
    assert not np.allclose(out[0].numpy(), out[1].numpy())  # one generator drew two different latents
    assert_matches(out, reference(model_dir, "portrait of an old man with a beard", **params))
    assert_matches(
        g.results["n1"],
        reference(model_dir, "portrait of an old man with a beard", **dict(params, num_images_per_prompt=1, seed=12)),
    )


def test_cancel_mid_denoise_leaves_others_unchanged(family, local_graph, reference):
    name, model_dir = family
    g = local_graph(model_dir)
    for i, rid in enumerate(["keep1", "victim", "keep2"]):
        g.submit(rid, "a bowl of fruit", **SMALL, num_inference_steps=5, seed=20 + i, **FAMILY_EXTRA[name])
    while not (g.progress.get("victim") and g.progress["victim"][-1][0] >= 2):
        g.tick()
    g.abort("victim")
    assert g.dn.engine.state("victim") is None  # state freed at once (between steps)
    g.run()
    assert "victim" not in g.results and not g.errors
    assert g.progress["victim"][-1][0] == 2
    for i, rid in enumerate(["keep1", "victim", "keep2"]):
        if rid == "victim":
            continue
        params = dict(SMALL, num_inference_steps=5, seed=20 + i, **FAMILY_EXTRA[name])
        assert_matches(g.results[rid], reference(model_dir, "a bowl of fruit", **params))


@pytest.mark.parametrize(
    "bad, param",
    [
        (dict(height=30), "height"),  # not a multiple of VAE factor x patch (4 here)
        (dict(width=33), "width"),
        (dict(num_inference_steps=0), "num_inference_steps"),
        (dict(num_images_per_prompt=0), "num_images_per_prompt"),
        (dict(guidance_scale=-1.0), "guidance_scale"),
        (dict(num_inference_steps=1001), "num_inference_steps"),  # beyond the stage's limit
        (dict(seed="abc"), "seed"),
    ],
)
def test_bad_params_fail_alone(bad, param, sd3_dir, local_graph, reference):
    g = local_graph(sd3_dir)
    good = dict(SMALL, num_inference_steps=3, seed=5, guidance_scale=4.0)
    g.submit("good1", "a photo of a cat", **good)
    g.submit("bad", "a photo of a cat", **dict(good, **bad))
    g.submit("good2", "a photo of a cat", **dict(good, seed=6))
    g.run()
    stage, kind, message = g.errors["bad"]
    assert kind == "invalid_request"
    assert param in message
    assert set(g.errors) == {"bad"}
    assert_matches(g.results["good1"], reference(sd3_dir, "a photo of a cat", **good))
    assert_matches(g.results["good2"], reference(sd3_dir, "a photo of a cat", **dict(good, seed=6)))


def test_over_long_prompt_truncated_with_warning(family, local_graph, reference):
    name, model_dir = family
    g = local_graph(model_dir)
    prompt = " ".join(["a photo of a cat sitting on a red chair"] * 6)  # > 24 T5 tokens
    params = dict(SMALL, num_inference_steps=2, seed=3, **FAMILY_EXTRA[name])
    g.submit("long", prompt, **params)
    g.submit("short", "a cat", **params)
    g.run()
    assert any("truncated" in w and "24" in w for w in g.warnings["long"]), g.warnings["long"]
    assert g.warnings["short"] == []
    assert_matches(g.results["long"], reference(model_dir, prompt, **params))


def test_uint8_output_is_diffusers_pil_rounding(sd3_dir, local_graph, reference):
    g = local_graph(sd3_dir)
    params = dict(SMALL, num_inference_steps=2, seed=9, guidance_scale=4.0)
    g.submit("u8", "a cat", **dict(params, output_type="uint8"))
    g.run()
    out = g.results["u8"].numpy()
    assert out.dtype == np.uint8 and out.shape == (1, 32, 32, 3)
    ref = (reference(sd3_dir, "a cat", **params) * 255).round().astype(np.uint8)
    assert np.abs(out.astype(int) - ref.astype(int)).max() <= 1


def test_sd3_without_cfg_and_flux_true_cfg(sd3_dir, flux_dir, local_graph, reference):
    # SD3 with guidance_scale <= 1: no negative rows, one row per image
    g = local_graph(sd3_dir)
    no_cfg = dict(SMALL, num_inference_steps=3, seed=2, guidance_scale=1.0)
    cfg = dict(SMALL, num_inference_steps=3, seed=2, guidance_scale=5.0, negative_prompt="blurry, low quality")
    g.submit("nocfg", "a cat", **no_cfg)
    g.submit("cfg", "a cat", **cfg)
    g.run()
    rows = {r.request_ids: r.extra["rows"] for r in g.dn.step_log}
    assert rows.get(("nocfg", "cfg")) == 3  # both in one forward: 1 + 2 rows
    assert_matches(g.results["nocfg"], reference(sd3_dir, "a cat", **no_cfg))
    assert_matches(g.results["cfg"], reference(sd3_dir, "a cat", **cfg))
    # FLUX true CFG (true_cfg_scale > 1 with a negative prompt): negative rows in the same forward
    g = local_graph(flux_dir)
    true_cfg = dict(
        SMALL,
        num_inference_steps=3,
        seed=4,
        guidance_scale=3.5,
        true_cfg_scale=2.0,
        negative_prompt="blurry, low quality",
    )
    g.submit("tcfg", "a cat", **true_cfg)
    g.run()
    assert g.dn.step_log[0].extra["rows"] == 2
    assert_matches(g.results["tcfg"], reference(flux_dir, "a cat", **true_cfg))
