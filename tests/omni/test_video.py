"""Video and audio-in-video inputs against transformers on the same tiny checkpoints.

Judges: transformers' PIL Qwen2-VL image processor for the resize / normalisation / patch
layout (a video's frame pair is laid out like a still image's tiled pair); PyAV's own
encoder for the decoding; transformers' Qwen2_5OmniProcessor for the token layout (its
video processor needs torchvision, so it is handed our patches) and its `get_rope_index` for
the 3-D positions; `Qwen2_5OmniForConditionalGeneration.generate` for the greedy tokens."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from omnistage.stages.base import StageRequest
from omnistage.stages.omni.inputs import OmniProcessor, decode_audio
from omnistage.stages.omni.thinker import ThinkerStage
from omnistage.stages.omni.video import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, VideoPatcher, load_frames
from omnistage.stages.omni.vision_encoder import VisionEncoderStage

from .conftest import make_ctx, reference_processor, run_stage
from .test_thinker import _clip, _embeds

NEW = 10


def _frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    return (np.random.RandomState(seed).rand(n, h, w, 3) * 255).astype(np.uint8)


def _vision_config(model_dir):
    import json

    return json.loads((model_dir / "config.json").read_text())["thinker_config"]["vision_config"]


def test_frame_patches_equal_the_image_processor_per_frame(omni_dir):
    """Two different frames: the first temporal half of each patch row is frame 0 as the image
    processor cuts a still image, the second half frame 1; grid and resize agree."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    frames = _frames(2, 97, 131, 3)
    video = VideoPatcher(_vision_config(omni_dir), VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)({"frames": frames, "fps": 2.0})
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS})
    n = video.patches.shape[0]
    assert video.second_per_grid == 1.0
    for t in range(2):
        ref = images(images=[frames[t]], return_tensors="pt")
        assert ref["image_grid_thw"][0].tolist() == video.grid_thw
        want = ref["pixel_values"].view(n, 3, 2, 14, 14)[:, :, 0]
        torch.testing.assert_close(video.patches.view(n, 3, 2, 14, 14)[:, :, t], want, rtol=0, atol=1e-5)


def _mp4(frames: np.ndarray, fps: int, clip: np.ndarray) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        vs = out.add_stream("mpeg4", rate=fps)
        vs.height, vs.width, vs.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        vs.options = {"qscale": "1"}
        aus = out.add_stream("aac", rate=16000, layout="mono")
        for f in frames:
            out.mux(vs.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(vs.encode())
        samples = clip.reshape(1, -1)
        for i in range(0, samples.shape[1], 1024):
            af = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, i : i + 1024]), format="flt", layout="mono")
            af.sample_rate = 16000
            out.mux(aus.encode(af))
        out.mux(aus.encode())
    return buf.getvalue()


def test_an_mp4_decodes_to_its_frames_and_its_sound(tmp_path):
    frames = np.repeat(np.repeat(_frames(10, 12, 16, 5), 4, axis=1), 4, axis=2)  # smooth 48 x 64 blocks
    clip = (0.3 * np.sin(np.linspace(0, 2 * np.pi * 300, 16000 * 2))).astype(np.float32)
    raw = _mp4(frames, 5, clip)
    got, fps = load_frames(raw)
    assert fps == 5.0 and got.shape == frames.shape
    error = np.abs(got.astype(float) - frames).mean()
    shifted = np.abs(got.astype(float) - np.roll(frames, 1, axis=0)).mean()
    assert error < 0.3 * shifted  # each frame is itself (lossy), in order
    path = tmp_path / "clip.mp4"
    path.write_bytes(raw)
    assert load_frames(str(path))[0].shape == frames.shape
    sound = decode_audio(raw, 16000)
    assert abs(len(sound) - len(clip)) < 2048 and np.abs(sound).max() > 0.1


def _video_embeds(model_dir, videos, params=None):
    enc = VisionEncoderStage(make_ctx("vision_encoder", model_dir, params))
    enc.add(StageRequest("x", {"videos": videos}))
    return run_stage(enc)["x"][-1].outputs["video_embeds"]


def _reference(model, model_dir, messages, video, patches, clip, audio_in_video, fps=2.0):
    """transformers: the processor's ids (given our patches), get_rope_index, generate()."""

    class OurPatches:
        temporal_patch_size, merge_size = 2, 2

        def __call__(self, videos, **kwargs):
            return {"pixel_values_videos": patches.patches, "video_grid_thw": torch.tensor([patches.grid_thw])}

    proc = reference_processor(model_dir)
    proc.video_processor = OurPatches()
    text = OmniProcessor(model_dir).prompt_text(messages, speech=False)
    extra = dict(load_audio_from_video=True, audio=[clip], audio_from_video_indices=[0]) if audio_in_video else {}
    kw = proc(text=[text], videos=[video["frames"]], return_tensors="pt", videos_kwargs={"fps": fps}, **extra)
    media = {k: kw[k] for k in ("pixel_values_videos", "video_grid_thw", "video_second_per_grid")}
    if audio_in_video:
        media.update(input_features=kw["input_features"], feature_attention_mask=kw["feature_attention_mask"])
    audio_lens = kw["feature_attention_mask"].sum(-1) if audio_in_video else None
    positions, _ = model.thinker.get_rope_index(
        kw["input_ids"], None, kw["video_grid_thw"], kw["attention_mask"], audio_in_video, audio_lens,
        kw["video_second_per_grid"],
    )  # fmt: skip
    with torch.no_grad():
        seq = model.generate(
            input_ids=kw["input_ids"], attention_mask=kw["attention_mask"], generation_mode="text",
            speaker="Chelsie", use_audio_in_video=audio_in_video, thinker_max_new_tokens=NEW,
            thinker_min_new_tokens=NEW, thinker_do_sample=False, **media,
        )  # fmt: skip
    return kw["input_ids"][0].tolist(), positions[:, 0], seq[0, kw["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize(
    "audio_in_video,fps", [(False, 2.0), (True, 2.0), (True, 1.0)], ids=["video", "audio_in_video", "at_1_fps"]
)
def test_video_prompt_greedy_tokens_and_positions_equal_transformers(omni_dir, omni_ref, audio_in_video, fps):
    video = {"frames": _frames(16, 56, 84, 11), "fps": 4.0}  # 4 s: 8 frames at 2 fps, grid t = 4
    clip = _clip(4.4, 12)  # 4.4 s of sound: 3 chunks of 2 s beside the frames' 2
    patches = VideoPatcher(_vision_config(omni_dir), VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, fps)(video)
    assert patches.grid_thw[0] == {2.0: 4, 1.0: 2}[fps]  # 8 or 4 frames sampled, in pairs
    assert patches.second_per_grid == 2 / fps
    parts = [{"type": "text", "text": "Watch."}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
    messages = [{"role": "user", "content": parts}]
    ids, positions, tokens = _reference(omni_ref, omni_dir, messages, video, patches, clip, audio_in_video, fps)

    embeds = _video_embeds(omni_dir, [video], {"video_fps": fps})
    assert embeds[0]["grid_thw"] == patches.grid_thw
    inputs = {"messages": messages, "video_embeds": embeds}
    if audio_in_video:
        inputs["audio_embeds"] = _embeds(omni_dir, [clip])
    stage = ThinkerStage(make_ctx("thinker", omni_dir, max_num_batched_tokens=128))
    prompt = stage.build_prompt(messages, inputs, False, audio_in_video)
    assert prompt.token_ids == ids
    assert torch.equal(prompt.positions, positions)
    params = {"temperature": 0, "max_tokens": NEW, "ignore_eos": True, "return_audio": False}
    stage.add(StageRequest("v", inputs, {**params, "use_audio_in_video": audio_in_video}))
    got = [t for e in run_stage(stage)["v"] for t in e.outputs.get("tokens", [])]
    assert got == tokens
    assert len(set(tokens)) >= 3


def test_a_missing_video_audio_is_the_requests_fault(omni_dir):
    video = {"frames": _frames(4, 56, 56, 1), "fps": 2.0}
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hm?"}]}]
    stage = ThinkerStage(make_ctx("thinker", omni_dir))
    inputs = {"messages": messages, "video_embeds": _video_embeds(omni_dir, [video])}
    stage.add(StageRequest("v", inputs, {"use_audio_in_video": True}))
    err = run_stage(stage)["v"][-1]
    assert err.error_kind == "invalid_request" and "0 audio inputs" in err.error
