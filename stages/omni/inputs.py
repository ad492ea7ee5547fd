"""Qwen2.5-Omni input processing without torchvision: audio decoding, log-mel features, prompts.

transformers' `Qwen2_5OmniProcessor` cannot be constructed without torchvision (it insists on
its video processor). We do not add torchvision to the environment: every stage process would
import it through transformers, it switches transformers' image processors to their torchvision
variants for the other pipelines too, and its compiled ops must match the pinned torch build
exactly. The parts the pipeline needs are small and taken from the well-kept pieces directly:
`WhisperFeatureExtractor` (the log-mel the model was trained on), the checkpoint's tokenizer
and chat template, and the placeholder expansion (one `<|AUDIO|>` / `<|IMAGE|>` per encoder row),
checked token for token against the real processor in tests/omni/test_inputs.py.

Audio arrives in any container soundfile reads (WAV, FLAC, OGG/Vorbis, ...) or, failing that,
PyAV decodes (MP3, AAC/M4A, Opus, video files' audio), at any rate and channel count, and is
mixed to mono and resampled to the feature extractor's rate with torchaudio.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.media_limits import MAX_AUDIO_BYTES, check_audio_size, read_bounded

# The system prompt Qwen2.5-Omni was trained with for spoken answers (the model card: other
# system prompts may leave the talker without a usable voice).
SPEECH_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)


def audio_output_length(num_frames: int) -> int:
    """Encoder output frames (= `<|AUDIO|>` tokens) for `num_frames` log-mel frames: the conv
    stem halves once and the pooling halves again (the model's own formula)."""
    after_conv = (num_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def decode_audio(data: bytes | str | Path, target_rate: int) -> np.ndarray:
    """Mono float32 samples at `target_rate` from an encoded file (bytes or a path), within the
    rate and length bounds of stages/media_limits.py."""
    raw = data if isinstance(data, bytes) else read_bounded(data, MAX_AUDIO_BYTES, "audio")
    if not raw:
        raise InvalidRequestError("the audio input is empty", param="audio")
    try:
        samples, rate = _decode_soundfile(raw)
    except InvalidRequestError:
        raise
    except Exception:  # noqa: BLE001 - not a format libsndfile knows: try FFmpeg's decoders
        samples, rate = _decode_pyav(raw)
    return resample(samples, rate, target_rate)


def _decode_soundfile(raw: bytes) -> tuple[np.ndarray, int]:
    import soundfile

    info = soundfile.info(io.BytesIO(raw))  # the header: refuse before decoding
    check_audio_size(info.samplerate, info.duration, "audio")
    samples, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    return samples.mean(axis=1), int(rate)


def _decode_pyav(raw: bytes) -> tuple[np.ndarray, int]:
    import av

    try:
        with av.open(io.BytesIO(raw)) as container:
            if not container.streams.audio:
                raise InvalidRequestError("the input has no audio stream", param="audio")
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate
            check_audio_size(rate, 0.0, "audio")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            chunks, samples = [], 0
            for frame in container.decode(stream):
                samples += frame.samples
                check_audio_size(rate, samples / rate, "audio")
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except InvalidRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the input's fault here
        raise InvalidRequestError(f"could not decode the audio ({exc.__class__.__name__})", param="audio") from None
    if not chunks:
        raise InvalidRequestError("the audio stream holds no samples", param="audio")
    return np.concatenate(chunks).astype(np.float32), int(rate)


def resample(samples: np.ndarray | torch.Tensor, rate: int, target_rate: int) -> np.ndarray:
    """Mono float32 at target_rate (torchaudio's band-limited sinc resampler)."""
    x = torch.as_tensor(np.asarray(samples, dtype=np.float32))
    if x.dim() != 1:
        raise InvalidRequestError("audio samples must be mono (1-D)", param="audio")
    if x.numel() == 0:
        raise InvalidRequestError("the audio input is empty", param="audio")
    check_audio_size(rate, x.numel() / rate if rate > 0 else 0.0, "audio")
    if rate != target_rate:
        import torchaudio.functional as AF

        x = AF.resample(x, rate, target_rate)
    return x.numpy()


@dataclass
class AudioFeatures:
    """One audio's log-mel frames [num_mel_bins, frames] (padding removed) and its token count."""

    features: torch.Tensor
    num_tokens: int


class OmniProcessor:
    """Feature extraction and prompt building for one Qwen2.5-Omni checkpoint directory."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer, WhisperFeatureExtractor

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        self.sampling_rate = int(self.feature_extractor.sampling_rate)
        self.max_samples = int(self.feature_extractor.n_samples)
        tok = self.tokenizer
        self.audio_token = tok.audio_token
        self.audio_token_id = tok.convert_tokens_to_ids(tok.audio_token)
        self.image_token = tok.image_token
        self.image_token_id = tok.convert_tokens_to_ids(tok.image_token)
        self.video_token = tok.video_token
        self.video_token_id = tok.convert_tokens_to_ids(tok.video_token)
        self.audio_bos_token, self.audio_eos_token = tok.audio_bos_token, tok.audio_eos_token

    # -- audio -------------------------------------------------------------------------------
    def audio_features(self, audio: Any) -> AudioFeatures:
        """Log-mel of one audio: encoded bytes / a path, or a dict {"samples", "sampling_rate"}.

        The frames of the model's processor, which pads the waveform to the extractor's 30 s
        window (so the last frames see zeros, not a reflection) and keeps the frames of real
        samples; longer audio is cut to 30 s. The padding here stops one FFT window past the
        audio (at least 1 s), a multiple of the hop: every kept frame reads the same samples,
        and the zeros are never the loudest frame, so the log-mel's floor (its maximum - 8) is
        the same. A 3 s clip costs a ninth of the 30 s extraction."""
        samples = self.load_audio(audio)[: self.max_samples]
        fe = self.feature_extractor
        # at least 1 s: the mel filter product over fewer than ~10 frames sums in another order
        padded = -(-(len(samples) + fe.n_fft) // fe.hop_length) * fe.hop_length
        padded = min(max(padded, fe.sampling_rate), self.max_samples)
        out = fe(
            samples,
            sampling_rate=self.sampling_rate,
            padding="max_length",
            max_length=padded,
            return_attention_mask=True,
            return_tensors="pt",
        )
        frames = int(out["attention_mask"][0].sum())
        feats = out["input_features"][0, :, :frames].contiguous()
        return AudioFeatures(feats, audio_output_length(frames))

    def load_audio(self, audio: Any) -> np.ndarray:
        if isinstance(audio, dict):
            if "samples" not in audio or "sampling_rate" not in audio:
                raise InvalidRequestError("raw audio needs 'samples' and 'sampling_rate'", param="audio")
            return resample(audio["samples"], int(audio["sampling_rate"]), self.sampling_rate)
        if isinstance(audio, (bytes, str, Path)):
            return decode_audio(audio, self.sampling_rate)
        raise InvalidRequestError("audio must be encoded bytes, a path or {samples, sampling_rate}", param="audio")

    # -- prompts -----------------------------------------------------------------------------
    def prompt_text(self, messages: list[dict[str, Any]], speech: bool = False) -> str:
        """The chat template's text (one placeholder per media part). With `speech`, a
        conversation without a system message gets the system prompt the talker needs."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        if speech and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": SPEECH_SYSTEM_PROMPT}, *messages]
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template error is a malformed conversation
            raise InvalidRequestError(f"messages do not fit the chat template: {exc}", param="messages") from None

    def expand_audio(self, text: str, audio_tokens: list[int]) -> list[int]:
        """Token ids of `text` with its i-th `<|AUDIO|>` repeated audio_tokens[i] times."""
        return self.expand_media(text, audio_tokens, [])

    def expand_media(self, text: str, audio_tokens: list[int], image_tokens: list[int]) -> list[int]:
        """Token ids of `text` with its i-th `<|AUDIO|>` / `<|IMAGE|>` repeated as many times as
        that audio / image has encoder rows."""
        text = _expand(text, self.audio_token, audio_tokens, "audio")
        text = _expand(text, self.image_token, image_tokens, "images")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def placeholders(self, text: str) -> list[str]:
        """The kinds of the prompt's media placeholders in order: "audio", "image", "video"."""
        kinds = {self.audio_token: "audio", self.image_token: "image", self.video_token: "video"}
        return [kinds[m] for m in re.findall("|".join(re.escape(t) for t in kinds), text)]

    def expand_in_order(self, text: str, replacements: list[str]) -> list[int]:
        """Token ids of `text` with its i-th media placeholder replaced by replacements[i]."""
        pattern = "|".join(re.escape(t) for t in (self.audio_token, self.image_token, self.video_token))
        pieces = re.split(pattern, text)
        expanded = pieces[0] + "".join(r + piece for r, piece in zip(replacements, pieces[1:]))
        return self.tokenizer(expanded, add_special_tokens=False)["input_ids"]

    def video_with_audio(self, parts: list[tuple[str, int]]) -> str:
        """A video's placeholder text with its audio interleaved (parts: (kind, rows) in order)."""
        rows = "".join((self.video_token if kind == "video" else self.audio_token) * n for kind, n in parts)
        return self.audio_bos_token + rows + self.audio_eos_token


def _expand(text: str, placeholder: str, counts: list[int], what: str) -> str:
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(counts):
        raise InvalidRequestError(
            f"the prompt has {len(pieces) - 1} {what} parts but {len(counts)} {what} inputs", param=what
        )
    expanded = pieces[0]
    for n, piece in zip(counts, pieces[1:]):
        expanded += placeholder * n + piece
    return expanded
