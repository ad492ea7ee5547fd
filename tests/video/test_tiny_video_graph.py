"""configs/tiny-video.yaml through the real runtime (worker processes) against diffusers' WanPipeline."""

from __future__ import annotations

import asyncio
import io
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.diffusion import stage_params

from .conftest import reference_frames

MSL = 64
# decoded MP4 frames vs the float frames they were encoded from (per frame, clip mean)
CODEC_PSNR_MIN_DB, CODEC_PSNR_MEAN_DB = 27.0, 30.0


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a - b) ** 2).mean().item()
    return 10 * math.log10(1.0 / max(mse, 1e-12))


REQUESTS = [
    dict(prompt="a cat walks on the grass", seed=11, num_inference_steps=4, height=32, width=32, num_frames=9),
    dict(
        prompt="a dog runs along the beach",
        seed=12,
        num_inference_steps=6,
        height=32,
        width=32,
        num_frames=9,
        negative_prompt="blurry, low quality",
    ),
    dict(prompt="snow falls on a quiet forest", seed=13, num_inference_steps=3, height=48, width=32, num_frames=5),
]


@pytest.fixture(scope="module")
def video_pipeline(tiny_wan_dir):
    from omnistage import Pipeline

    with Pipeline.from_yaml("tiny-video") as pipe:
        yield pipe


def _params(pipe, raw):
    return stage_params(pipe, dict(raw, max_sequence_length=MSL, output_type="float"))


def test_concurrent_requests_equal_diffusers(video_pipeline, wan_reference):
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        futures = [
            pool.submit(video_pipeline.run, {"prompt": r["prompt"]}, _params(video_pipeline, r), timeout=300)
            for r in REQUESTS
        ]
        outputs = [f.result() for f in futures]
    for raw, out in zip(REQUESTS, outputs):
        frames = out["video"]
        assert frames.shape == (raw["num_frames"], raw["height"], raw["width"], 3)
        ref = reference_frames(
            wan_reference,
            prompt=raw["prompt"],
            negative_prompt=raw.get("negative_prompt"),
            height=raw["height"],
            width=raw["width"],
            num_frames=raw["num_frames"],
            steps=raw["num_inference_steps"],
            seed=raw["seed"],
            max_sequence_length=MSL,
        )[0]
        assert (frames - ref).abs().max().item() < 1e-4  # float32 rounding; see test_wan_sensitivity.py


def test_frames_stream_in_temporal_chunks_and_mp4_decodes(video_pipeline, wan_reference):
    import av

    from omnistage.streaming.video import encode_mp4

    raw = dict(
        prompt="waves crash against the rocks", seed=21, num_inference_steps=3, height=32, width=32, num_frames=13
    )

    async def collect():
        events = []
        async for chunk in video_pipeline.stream({"prompt": raw["prompt"]}, _params(video_pipeline, raw)):
            events.append((chunk.port, chunk.progress, chunk.data, chunk.final))
        return events

    events = asyncio.run(collect())
    progress = [p for port, p, _, _ in events if p is not None]
    assert progress[-1] == (3, 3)
    video_chunks = [data for port, _, data, _ in events if port == "video" and data is not None]
    assert [c.shape[0] for c in video_chunks] == [1, 4, 4, 4]  # first frame leaves first
    frames = torch.cat(video_chunks)
    ref = reference_frames(
        wan_reference,
        prompt=raw["prompt"],
        height=32,
        width=32,
        num_frames=13,
        steps=3,
        seed=21,
        max_sequence_length=MSL,
    )[0]
    assert (frames - ref).abs().max().item() < 1e-4

    mp4 = encode_mp4(frames, fps=16)
    with av.open(io.BytesIO(mp4)) as container:
        decoded = torch.stack([torch.from_numpy(f.to_ndarray(format="rgb24")) for f in container.decode(video=0)])
    assert decoded.shape == (13, 32, 32, 3)
    # H.264 (crf 18, 4:2:0 chroma at 32x32) is lossy: each decoded frame is within the codec's
    # tolerance of its reference frame, and nearer to it than to any other frame of the clip
    # (frames in order, none dropped or repeated)
    decoded = decoded.float() / 255.0
    psnr = [[_psnr(decoded[i], ref[j]) for j in range(13)] for i in range(13)]
    own = [psnr[i][i] for i in range(13)]
    assert min(own) >= CODEC_PSNR_MIN_DB and sum(own) / 13 >= CODEC_PSNR_MEAN_DB, own
    assert [max(range(13), key=lambda j, i=i: psnr[i][j]) for i in range(13)] == list(range(13))


def test_bad_size_fails_alone(video_pipeline, wan_reference):
    good = dict(prompt="a bird flies", seed=5, num_inference_steps=4, height=32, width=32, num_frames=5)
    bad = dict(good, height=40)
    with ThreadPoolExecutor(2) as pool:
        f_bad = pool.submit(video_pipeline.run, {"prompt": bad["prompt"]}, _params(video_pipeline, bad), timeout=120)
        f_good = pool.submit(video_pipeline.run, {"prompt": good["prompt"]}, _params(video_pipeline, good), timeout=120)
        with pytest.raises(InvalidRequestError):
            f_bad.result()
        frames = f_good.result()["video"]
    ref = reference_frames(
        wan_reference,
        prompt=good["prompt"],
        height=32,
        width=32,
        num_frames=5,
        steps=4,
        seed=5,
        max_sequence_length=MSL,
    )[0]
    assert frames.shape == ref.shape == (5, 32, 32, 3)
    assert (frames - ref).abs().max().item() < 1e-4
