"""Chat with audio in and spoken replies on tiny-omni, through the official `openai` client
against a live server, judged by the same request through the Python API; audio decoded by
soundfile."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import soundfile
import torch

from omnistage.streaming.audio import to_pcm16_array

SR_OUT = 24_000


def _wav_b64() -> str:
    t = np.arange(16000) / 16000
    clip = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, clip, 16000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


WAV = _wav_b64()
MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}},
            {"type": "text", "text": "What is this?"},
        ],
    }
]
SAMPLING = dict(temperature=0, max_tokens=8, seed=0)


@pytest.fixture(scope="module")
def python_reply(omni_pipeline):
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is this?"}]}]
    params = {
        "thinker": {"temperature": 0.0, "max_tokens": 8, "seed": 0, "modalities": ["text", "audio"]},
        "talker": {"voice": "Ethan", "seed": 0},
        "token2wav": {"seed": 0},  # the route sends the seed to every speech_params stage
    }
    return omni_pipeline.run({"messages": messages, "audio": [base64.b64decode(WAV)]}, params, timeout=300)


def test_spoken_reply_equals_the_python_api(omni, python_reply):
    reply = omni.chat.completions.create(
        model="tiny-omni",
        messages=MESSAGES,
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "wav"},
        **SAMPLING,
    )
    audio = reply.choices[0].message.audio
    assert audio.transcript == python_reply["text"]
    assert audio.id and audio.expires_at > reply.created
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(audio.data)), dtype="int16")
    assert rate == SR_OUT
    ours = np.asarray(python_reply["audio"], dtype=np.float32).reshape(-1)
    assert samples.shape[0] == ours.shape[0] > 0
    # the same seed reaches the talker and token2wav's ODE noise: bit for bit after PCM16
    assert np.array_equal(samples.reshape(-1), to_pcm16_array(ours).reshape(-1))
    _check_audio_usage(reply.usage, python_reply)


def _audio_positions() -> int:
    """<|AUDIO|> positions of the message's clip, by transformers' own feature extractor and
    Qwen2.5-Omni audio encoder length formula."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    from omnistage.models.recipes import build_recipe

    clip, rate = soundfile.read(io.BytesIO(base64.b64decode(WAV)), dtype="float32")
    extractor = WhisperFeatureExtractor.from_pretrained(build_recipe("qwen2_5_omni"))
    frames = extractor(clip, sampling_rate=rate, return_attention_mask=True)["attention_mask"].sum()
    return int(Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(None, torch.tensor(frames))[1])


def _check_audio_usage(usage, python_reply) -> None:
    """Prompt audio tokens are the clip's encoder positions; completion audio tokens are the
    talker's codec tokens, counted into completion_tokens as OpenAI counts spoken output."""
    codes = len(list(python_reply["codes"]))
    assert codes > 0
    assert usage.prompt_tokens_details.audio_tokens == _audio_positions() > 0
    assert usage.completion_tokens_details.audio_tokens == codes
    assert usage.completion_tokens == python_reply["info"]["usage"]["completion_tokens"] + codes
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_spoken_reply_carries_pcm_and_transcript(omni, python_reply):
    chunks = list(
        omni.chat.completions.create(
            model="tiny-omni",
            messages=MESSAGES,
            modalities=["text", "audio"],
            audio={"voice": "Ethan", "format": "pcm16"},
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLING,
        )
    )
    transcript, pcm, audio_chunks, ids, expires = "", b"", 0, set(), []
    for c in chunks:
        for choice in c.choices:
            audio = choice.delta.audio
            if audio is not None:
                transcript += audio.transcript or ""
                pcm += base64.b64decode(audio.data or "")
                audio_chunks += bool(audio.data)
                ids.add(audio.id)
                expires.append(getattr(audio, "expires_at", None))
    assert transcript == python_reply["text"]
    # one id throughout; the last audio delta says until when it can be sent back
    assert len(ids) == 1 and expires[-1] is not None and expires[-1] > chunks[0].created
    assert all(e is None for e in expires[:-1])
    turn = [*MESSAGES, {"role": "assistant", "audio": {"id": ids.pop()}}, {"role": "user", "content": "Go on."}]
    assert omni.chat.completions.create(model="tiny-omni", messages=turn, **SAMPLING).choices[0].message.content
    samples = np.frombuffer(pcm, dtype="<i2")
    ours = np.asarray(python_reply["audio"], dtype=np.float32).reshape(-1)
    assert np.array_equal(samples, to_pcm16_array(ours).reshape(-1))
    assert audio_chunks >= 2, audio_chunks  # streamed in pieces, not one clip at the end
    _check_audio_usage(chunks[-1].usage, python_reply)


def test_a_spoken_reply_goes_back_by_its_audio_id(omni, omni_pipeline):
    """OpenAI's multi-turn audio: the next turn refers to the reply by `audio: {id}` (or sends
    the client's whole message back), and the thinker reads the reply's transcript there."""
    spoken = omni.chat.completions.create(
        model="tiny-omni", messages=MESSAGES, modalities=["text", "audio"], audio={"voice": "Ethan"}, **SAMPLING
    )
    reply = spoken.choices[0].message
    question = {"role": "user", "content": "And then?"}
    by_id = [*MESSAGES, {"role": "assistant", "audio": {"id": reply.audio.id}}, question]
    answer = omni.chat.completions.create(model="tiny-omni", messages=by_id, **SAMPLING).choices[0].message.content
    echoed = omni.chat.completions.create(model="tiny-omni", messages=[*MESSAGES, reply, question], **SAMPLING)
    assert echoed.choices[0].message.content == answer

    judge = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": reply.audio.transcript},
        question,
    ]
    params = {"thinker": {"temperature": 0.0, "max_tokens": 8, "seed": 0, "modalities": ["text"]}}
    ours = omni_pipeline.run({"messages": judge, "audio": [base64.b64decode(WAV)]}, params, timeout=300)
    assert answer == ours["text"]

    unknown = [*MESSAGES, {"role": "assistant", "audio": {"id": "audio-unknown"}}, question]
    with pytest.raises(openai.BadRequestError) as info:
        omni.chat.completions.create(model="tiny-omni", messages=unknown, **SAMPLING)
    assert info.value.body["param"] == "messages[1].audio.id"
    both = [*MESSAGES, {"role": "assistant", "content": "hi", "audio": {"id": reply.audio.id}}, question]
    with pytest.raises(openai.BadRequestError) as info:
        omni.chat.completions.create(model="tiny-omni", messages=both, **SAMPLING)
    assert info.value.body["param"] == "messages[1].content"


def test_text_only_reply_on_the_omni_pipeline(omni):
    reply = omni.chat.completions.create(model="tiny-omni", messages=MESSAGES, **SAMPLING)
    assert reply.choices[0].message.audio is None
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.usage.completion_tokens_details is None  # nothing spoken
    assert reply.usage.prompt_tokens_details.audio_tokens == _audio_positions()
    with pytest.raises(openai.BadRequestError) as info:
        omni.chat.completions.create(model="tiny-omni", messages=MESSAGES, modalities=["text", "audio"], **SAMPLING)
    assert info.value.body["param"] == "audio"
