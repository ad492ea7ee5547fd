"""The token2wav stage in a real pipeline (worker process, shared-memory transport): codes
stream in through a re-chunked edge, audio streams out in several chunks per request, three
concurrent requests each get their in-process decode, a bad request fails alone."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from omnistage.errors import InvalidRequestError

from .token2wav_checkpoint import CODEC_VOCAB, decode, make_stage

YAML = """
name: token2wav-test
inputs:
  codes: tokens
outputs:
  audio: audio
stages:
  t2w:
    kind: token2wav
    model: tiny:qwen2_5_omni
    pool: {threads: 1}
    batching: {policy: dynamic, max_batch_size: 8}
edges:
  - {from: inputs.codes, to: t2w.codes, stream: {chunk: 10}}
  - {from: t2w.audio, to: outputs.audio, stream: true}
"""

REQUESTS = {
    "a": (80, {"voice": "Chelsie", "seed": 1}),
    "b": (130, {"voice": "Ethan", "seed": 2, "first_window_blocks": 1, "vocoder_overlap": 12}),
    "c": (50, {"voice": "Ethan", "seed": 3, "mode": "full"}),
}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, omni_dir):
    from omnistage.runtime.pipeline import Pipeline

    path = tmp_path_factory.mktemp("t2w") / "token2wav.yaml"
    path.write_text(YAML)
    p = Pipeline.from_yaml(str(path))
    yield p
    p.close()


def codes_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, CODEC_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _collect(pipeline, rid: str, codes: list[int], params: dict):
    pieces, stamps = [], []
    async for chunk in pipeline.stream({"codes": codes}, {"t2w": params}, request_id=rid):
        if chunk.port == "audio" and chunk.data is not None and chunk.data.numel():
            pieces.append(chunk.data)
            stamps.append(time.monotonic())
    return pieces, stamps


def test_concurrent_requests_stream_audio_equal_to_in_process(pipeline, omni_dir):
    inputs = {rid: codes_of(n, seed=i) for i, (rid, (n, _)) in enumerate(REQUESTS.items())}

    async def run_all():
        jobs = [_collect(pipeline, rid, inputs[rid], params) for rid, (_, params) in REQUESTS.items()]
        return dict(zip(REQUESTS, await asyncio.gather(*jobs)))

    results = asyncio.run(run_all())
    local = make_stage(omni_dir)
    for rid, (n, params) in REQUESTS.items():
        pieces, stamps = results[rid]
        audio = torch.cat(pieces)
        want, _ = decode(local, {rid: (inputs[rid], params)}, chunk=10)
        assert audio.shape == want[rid].shape == (n * 480,)
        # float32 rounding of other batch shapes, carried through the ODE's 36 forwards
        assert (audio - want[rid]).abs().max() <= 5e-5, rid
        if params.get("mode") != "full":
            assert len(pieces) >= 2 and stamps[0] < stamps[-1]  # audio left in windows
        else:
            assert len(pieces) == 1


def test_bad_request_fails_alone(pipeline):
    with pytest.raises(InvalidRequestError, match="unknown voice"):
        pipeline.run({"codes": codes_of(30, 1)}, {"t2w": {"voice": "Nobody"}}, timeout=120)
    with pytest.raises(InvalidRequestError, match="codec ids"):
        pipeline.run({"codes": [1, 2, CODEC_VOCAB + 5]}, {"t2w": {}}, timeout=120)
    out = pipeline.run({"codes": codes_of(30, 2)}, {"t2w": {"seed": 4}}, timeout=120)
    assert out["audio"].shape == (30 * 480,)


def test_bad_stage_params_fail_validation_with_positions(tmp_path):
    from omnistage.graph.loader import PipelineValidationError, load_pipeline

    path = tmp_path / "bad.yaml"
    path.write_text(
        YAML.replace(
            "    pool: {threads: 1}\n",
            "    pool: {threads: 1}\n    params: {past_blocks: -1, mode: fast, colour: red}\n",
        )
    )
    with pytest.raises(PipelineValidationError) as info:
        load_pipeline(str(path))
    text = str(info.value)
    for expected in (
        "past_blocks must be an integer >= 0",
        "mode must be one of stream, full",
        "unknown token2wav stage parameter 'colour'",
    ):
        assert expected in text
    assert f"{path}:" in text
