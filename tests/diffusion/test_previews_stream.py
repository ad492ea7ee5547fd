"""configs/tiny-image-previews.yaml: each partial image leaves while the denoiser is still
working (between its progress events), not with the final image."""

from __future__ import annotations

import asyncio

from omnistage.stages.diffusion import stage_params


def test_each_preview_arrives_before_the_denoiser_finishes():
    from omnistage import Pipeline

    steps, previews = 12, 3
    order: list[tuple] = []  # ("progress", done) and ("preview", rows) in arrival order

    async def collect(pipe):
        g = {"width": 32, "height": 32, "num_inference_steps": steps, "seed": 3, "partial_images": previews}
        async for chunk in pipe.stream({"prompt": "a red cube"}, stage_params(pipe, g)):
            if chunk.progress is not None and chunk.stage == "denoiser":
                order.append(("progress", chunk.progress[0]))
            if chunk.port == "preview" and chunk.data is not None:
                order.append(("preview", chunk.data.shape[0]))

    with Pipeline.from_yaml("tiny-image-previews") as pipe:
        asyncio.run(collect(pipe))
    arrived = [i for i, (what, _) in enumerate(order) if what == "preview"]
    assert sum(order[i][1] for i in arrived) == previews, order
    for i in arrived:  # some denoising step came after it: it was not held back until the end
        assert any(what == "progress" for what, _ in order[i + 1 :]), order
