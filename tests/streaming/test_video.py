"""MP4 encoders, judged by decoding the bytes back with PyAV."""

import io

import av
import numpy as np
import pytest
import torch

from omnistage.streaming.video import FragmentedMP4Muxer, encode_mp4, stream_mp4


def _clip(t=12, h=32, w=48, seed=0) -> np.ndarray:
    # Moving smooth gradients: realistic for a lossy codec, different per frame.
    yy, xx = np.mgrid[0:h, 0:w]
    frames = []
    for i in range(t):
        r = (xx + 2 * i) / (w + 2 * t)
        g = yy / h
        b = 0.5 + 0.4 * np.sin((xx + yy + 3 * i) / 9.0)
        frames.append(np.stack([r, g, b], -1))
    return np.round(np.clip(np.stack(frames), 0, 1) * 255).astype(np.uint8)


def _decode(data: bytes) -> tuple[list[np.ndarray], av.video.stream.VideoStream]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        codec = stream.codec_context.name
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        return frames, codec


def _psnr(a, b) -> float:
    mse = np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_encode_mp4_is_h264_with_every_frame_close():
    clip = _clip()
    frames, codec = _decode(encode_mp4(clip, fps=8))
    assert codec == "h264"
    assert len(frames) == len(clip)
    assert frames[0].shape == clip[0].shape
    for got, want in zip(frames, clip):
        assert _psnr(got, want) >= 30.0


def test_float_tensor_frames_and_fps():
    clip = torch.from_numpy(_clip(t=6)).float() / 255.0
    data = encode_mp4(clip, fps=12)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 12
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 6
    assert _psnr(np.stack(frames), _clip(t=6)) >= 30.0


def test_odd_sizes_pad_or_error():
    clip = _clip(h=31, w=45)
    frames, _ = _decode(encode_mp4(clip, odd_size="pad"))
    assert frames[0].shape == (32, 46, 3)
    assert _psnr(np.stack(frames)[:, :31, :45], clip) >= 30.0
    with pytest.raises(ValueError, match="even"):
        encode_mp4(clip, odd_size="error")


def test_fragmented_muxer_yields_playable_prefixes():
    clip = _clip(t=12)
    muxer = FragmentedMP4Muxer(fps=8)
    parts = [muxer.push(clip[i : i + 4]) for i in range(0, 12, 4)]
    parts.append(muxer.close())
    assert all(parts), [len(p) for p in parts]
    # After chunk k+1 was pushed, the bytes so far decode to at least the first k chunks.
    for k in (1, 2):
        prefix_frames, _ = _decode(b"".join(parts[: k + 1]))
        assert len(prefix_frames) >= 4 * k
        assert _psnr(np.stack(prefix_frames[: 4 * k]), clip[: 4 * k]) >= 30.0
    frames, codec = _decode(b"".join(parts))
    assert codec == "h264" and len(frames) == 12
    assert _psnr(np.stack(frames), clip) >= 30.0


def test_stream_mp4_generator_and_size_change():
    clip = _clip(t=8)
    data = b"".join(stream_mp4((clip[i : i + 2] for i in range(0, 8, 2)), fps=4))
    frames, _ = _decode(data)
    assert len(frames) == 8
    muxer = FragmentedMP4Muxer()
    muxer.push(clip[:2])
    with pytest.raises(ValueError, match="size changed"):
        muxer.push(_clip(t=2, h=16, w=16))
