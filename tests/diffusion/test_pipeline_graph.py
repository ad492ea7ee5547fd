"""configs/sd3.yaml and configs/flux.yaml on the tiny checkpoints, through omnistage.Pipeline
(real worker processes), against the diffusers pipeline with the same seed."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from omnistage.errors import InvalidRequestError
from omnistage.stages.diffusion import stage_params

TOL = 1e-4  # measured agreement ~1e-6; see test_sensitivity_and_mixed.py
BASE = dict(height=32, width=32, max_sequence_length=24, output_type="float")
EXTRA = {"sd3": dict(guidance_scale=4.0), "flux": dict(guidance_scale=3.5)}


@pytest.fixture(scope="module", params=["sd3", "flux"])
def graph(request, sd3_dir, flux_dir):
    from omnistage import Pipeline

    family = request.param
    var = f"{family.upper()}_MODEL"
    old = os.environ.get(var)
    os.environ[var] = f"tiny:tiny-{family}"
    try:
        pipe = Pipeline.from_yaml(
            family, overrides=[f"stages.{s}.pool.threads=1" for s in ("text_encoder", "denoiser", "vae")]
        )
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old
    with pipe:
        yield family, {"sd3": sd3_dir, "flux": flux_dir}[family], pipe


def gen(family, **kw):
    return dict(BASE, **EXTRA[family], **kw)


async def stream_one(pipe, prompt, g, request_id=None, on_progress=None):
    """(outputs, progress list) of one request through Pipeline.stream."""
    outputs: dict[str, list] = {}
    progress = []
    async for chunk in pipe.stream({"prompt": prompt}, stage_params(pipe, g), request_id=request_id):
        if chunk.progress is not None:
            progress.append(tuple(chunk.progress))
            if on_progress is not None:
                on_progress(chunk.progress)
        if chunk.port is not None and chunk.data is not None:
            outputs.setdefault(chunk.port, []).append(chunk.data)
    return outputs, progress


def check(model_dir, reference, image, prompt, g):
    ref = reference(model_dir, prompt, **g)
    image = image.numpy()
    assert image.shape == ref.shape
    err = float(np.abs(image - ref).max())
    assert err <= TOL, f"max |omnistage - diffusers| = {err}"


def test_alone(graph, reference):
    family, model_dir, pipe = graph
    g = gen(family, num_inference_steps=4, seed=7)
    out = pipe.run({"prompt": "a photo of a cat"}, stage_params(pipe, g), timeout=120)
    assert out["warnings"] in ([], None)
    check(model_dir, reference, out["image"], "a photo of a cat", g)


def test_joining_requests_share_forwards_beside_other_sizes(graph, reference):
    family, model_dir, pipe = graph
    before = pipe.stage_stats()["denoiser"]
    first = ("an astronaut riding a horse on the moon", gen(family, num_inference_steps=120, seed=1))
    later = [
        ("a watercolor painting of a lighthouse", gen(family, num_inference_steps=5, seed=2)),
        ("a bowl of fruit on a wooden table", gen(family, num_inference_steps=8, seed=3)),
        ("a small house in a snowy forest", gen(family, num_inference_steps=6, seed=4)),
        ("a city street at night in the rain", gen(family, num_inference_steps=7, seed=5, height=48, width=48)),
        ("portrait of an old man with a beard", gen(family, num_inference_steps=5, seed=6, num_images_per_prompt=2)),
    ]

    async def scenario():
        started = asyncio.Event()
        tasks = []

        def on_progress(progress):
            if progress[0] >= 2:
                started.set()

        tasks.append(asyncio.create_task(stream_one(pipe, *first, on_progress=on_progress)))
        await asyncio.wait_for(started.wait(), 120)  # the first request is denoising: the rest join
        tasks += [asyncio.create_task(stream_one(pipe, p, g)) for p, g in later]
        return await asyncio.wait_for(asyncio.gather(*tasks), 240)

    results = asyncio.run(scenario())
    after = pipe.stage_stats()["denoiser"]
    # the batch record (kept in the denoiser's worker): forwards carried several requests,
    # some of them at different step indices
    forwards = after["forwards_total"] - before["forwards_total"]
    request_steps = after["request_steps_total"] - before["request_steps_total"]
    assert request_steps == sum(g["num_inference_steps"] for _, g in [first, *later])
    assert forwards < request_steps
    assert after["mixed_step_forwards"] > before["mixed_step_forwards"]
    assert after["max_requests_per_forward"] >= 4
    for (prompt, g), (outputs, progress) in zip([first, *later], results):
        steps = g["num_inference_steps"]
        assert [p for p in progress] == [(i, steps) for i in range(1, steps + 1)]
        image = outputs["image"][0]
        assert image.shape[0] == g.get("num_images_per_prompt", 1)
        check(model_dir, reference, image, prompt, g)


def test_cancel_mid_denoise(graph, reference):
    family, model_dir, pipe = graph
    before = pipe.stage_stats()["denoiser"]
    keep = [("a photo of a cat", gen(family, num_inference_steps=12, seed=30 + i)) for i in range(2)]

    async def victim():
        agen = pipe.stream(
            {"prompt": "a bowl of fruit"}, stage_params(pipe, gen(family, num_inference_steps=200, seed=9))
        )
        async for chunk in agen:
            if chunk.progress is not None and chunk.progress[0] >= 2:
                break  # closing the stream cancels the request in every stage
        await agen.aclose()

    async def scenario():
        return await asyncio.wait_for(asyncio.gather(victim(), *[stream_one(pipe, p, g) for p, g in keep]), 240)

    _, *results = asyncio.run(scenario())
    for (prompt, g), (outputs, _) in zip(keep, results):
        check(model_dir, reference, outputs["image"][0], prompt, g)
    deadline = asyncio.run(_wait_for(lambda: pipe.stage_stats()["denoiser"]["aborted"] > before["aborted"]))
    assert deadline, "the denoiser never dropped the cancelled request"
    assert pipe.stage_stats()["denoiser"]["requests"] == 0


async def _wait_for(pred, timeout=20.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if pred():
            return True
        await asyncio.sleep(0.1)
    return pred()


@pytest.mark.parametrize(
    "bad", [dict(height=30), dict(num_inference_steps=0), dict(num_images_per_prompt=0), dict(guidance_scale=-2.0)]
)
def test_bad_params_fail_alone(graph, reference, bad):
    family, model_dir, pipe = graph
    good = gen(family, num_inference_steps=3, seed=41)

    async def scenario():
        bad_task = asyncio.create_task(pipe.generate({"prompt": "a cat"}, stage_params(pipe, dict(good, **bad))))
        good_task = asyncio.create_task(pipe.generate({"prompt": "a cat"}, stage_params(pipe, good)))
        return await asyncio.gather(bad_task, good_task, return_exceptions=True)

    bad_result, good_result = asyncio.run(scenario())
    assert isinstance(bad_result, InvalidRequestError), bad_result
    assert next(iter(bad)) in str(bad_result)
    check(model_dir, reference, good_result["image"], "a cat", good)
