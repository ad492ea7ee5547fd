"""The two systems `omnistage bench omni` measures, one request list, the same fixed lengths.

omnistage: configs/tiny-omni.yaml pointed at the benchmark checkpoint, driven through
`Pipeline.stream` with a bounded number of requests in flight; every chunk is timestamped as it
reaches the caller. transformers: `Qwen2_5OmniForConditionalGeneration.generate` with audio
output, one request at a time, and optionally the whole batch in one `generate()` call.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from omnistage.stages.omni.inputs import OmniProcessor

SAMPLE_RATE_IN = 16000
STAGES = ("audio_encoder", "vision_encoder", "thinker", "talker", "token2wav")
VOICE = "Chelsie"


@dataclass
class BenchRequest:
    index: int
    messages: list[dict]
    clip: np.ndarray  # 16 kHz mono float32


@dataclass
class RequestRecord:
    """One request as a system served it; times in seconds from its submission."""

    ttft: float
    ttfa: float
    latency: float
    text_tokens: int
    codec_tokens: int
    audio_samples: int
    text: str = ""
    codes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Lengths:
    """What every system is made to produce per request (EOS and stop tokens ignored)."""

    text_tokens: int
    codec_tokens: int


def make_requests(n: int, seed: int = 0) -> list[BenchRequest]:
    """n audio-in chat requests with 1-3 s clips (a few tones plus noise, seeded)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        seconds = float(rng.uniform(1.0, 3.0))
        t = np.arange(int(seconds * SAMPLE_RATE_IN)) / SAMPLE_RATE_IN
        tones = sum(0.1 * np.sin(2 * np.pi * f * t) for f in rng.uniform(100, 2000, size=3))
        clip = (tones + 0.02 * rng.standard_normal(t.size)).astype(np.float32)
        question = ["What do you hear?", "Describe this sound.", "Who is speaking?", "Answer out loud."][i % 4]
        content = [{"type": "audio"}, {"type": "text", "text": question}]
        out.append(BenchRequest(i, [{"role": "user", "content": content}], clip))
    return out


# -- omnistage ---------------------------------------------------------------------------------
def start_omnistage(model_dir: Path, threads: int):
    """tiny-omni on the benchmark checkpoint. The talker runs with generate_compat (the prefill
    transformers' generate() runs on unpadded input), so codec tokens are comparable."""
    from omnistage.runtime.pipeline import Pipeline

    overrides = [f"stages.{s}.model={model_dir}" for s in STAGES]
    overrides += [f"stages.{s}.pool.threads={threads}" for s in ("thinker", "talker", "token2wav")]
    overrides.append("stages.talker.params.generate_compat=true")
    return Pipeline.from_yaml("tiny-omni", overrides, ready_timeout=900)


def omnistage_params(lengths: Lengths) -> dict[str, dict]:
    text, codes = lengths.text_tokens, lengths.codec_tokens
    return {
        "thinker": {"temperature": 0, "max_tokens": text, "min_tokens": text, "return_audio": True},
        "talker": {"temperature": 0, "max_tokens": codes, "min_tokens": codes, "voice": VOICE},
        "token2wav": {"voice": VOICE, "seed": 0},
    }


async def _one_omnistage(pipeline, req: BenchRequest, params: dict) -> RequestRecord:
    inputs = {"messages": req.messages, "audio": [{"samples": req.clip, "sampling_rate": SAMPLE_RATE_IN}]}
    t0 = time.perf_counter()
    first_text = first_audio = None
    text, codes, samples, info = [], [], 0, {}
    async for chunk in pipeline.stream(inputs, params):
        if chunk.data is None:
            continue
        now = time.perf_counter() - t0
        if chunk.port == "text" and chunk.data:
            first_text = now if first_text is None else first_text
            text.append(chunk.data)
        elif chunk.port == "audio" and (n := torch.as_tensor(chunk.data).numel()):
            first_audio = now if first_audio is None else first_audio
            samples += n
        elif chunk.port == "codes":
            codes.extend(int(c) for c in torch.as_tensor(chunk.data).reshape(-1))
        elif chunk.port == "info":
            info = chunk.data
    latency = time.perf_counter() - t0
    n_text = int(info.get("usage", {}).get("completion_tokens", 0))
    return RequestRecord(first_text or latency, first_audio or latency, latency, n_text, len(codes), samples,
                         "".join(text), codes)  # fmt: skip


def run_omnistage(pipeline, requests: list[BenchRequest], lengths: Lengths, concurrency: int):
    """Every request submitted at once, at most `concurrency` in flight. (records, wall seconds)"""
    params = omnistage_params(lengths)

    async def main():
        gate = asyncio.Semaphore(concurrency)

        async def bounded(req):
            async with gate:
                return await _one_omnistage(pipeline, req, params)

        t0 = time.perf_counter()
        records = await asyncio.gather(*(bounded(r) for r in requests))
        return list(records), time.perf_counter() - t0

    return asyncio.run(main())


# -- transformers ------------------------------------------------------------------------------
def hf_generate_kwargs(model, lengths: Lengths) -> dict:
    """Greedy thinker and talker, exactly the fixed lengths: min = max new tokens on both (the
    min-length processor masks every EOS id until then), the talker's EOS ids its pad / end."""
    talker = model.talker
    return dict(
        speaker=VOICE,
        thinker_max_new_tokens=lengths.text_tokens,
        thinker_min_new_tokens=lengths.text_tokens,
        thinker_do_sample=False,
        talker_max_new_tokens=lengths.codec_tokens,
        talker_min_new_tokens=lengths.codec_tokens,
        talker_do_sample=False,
        talker_eos_token_id=[talker.codec_pad_token, talker.config.tts_codec_end_token_id],
    )


def hf_inputs(processor: OmniProcessor, batch: list[BenchRequest]) -> dict[str, torch.Tensor]:
    """The model's inputs for a batch, left-padded (ids) and right-padded (log-mel frames) as
    the processor pads them."""
    feats = [processor.audio_features({"samples": r.clip, "sampling_rate": SAMPLE_RATE_IN}) for r in batch]
    ids = [
        processor.expand_audio(processor.prompt_text(r.messages, speech=True), [f.num_tokens])
        for r, f in zip(batch, feats)
    ]
    longest, frames = max(map(len, ids)), max(f.features.shape[1] for f in feats)
    pad = processor.tokenizer.pad_token_id
    input_ids = torch.full((len(batch), longest), pad, dtype=torch.long)
    attention = torch.zeros((len(batch), longest), dtype=torch.long)
    features = torch.zeros((len(batch), feats[0].features.shape[0], frames))
    feature_mask = torch.zeros((len(batch), frames), dtype=torch.long)
    for i, (row, f) in enumerate(zip(ids, feats)):
        input_ids[i, longest - len(row) :] = torch.tensor(row)
        attention[i, longest - len(row) :] = 1
        features[i, :, : f.features.shape[1]] = f.features
        feature_mask[i, : f.features.shape[1]] = 1
    return dict(
        input_ids=input_ids, attention_mask=attention, input_features=features, feature_attention_mask=feature_mask
    )


class _CodesObserver:
    """Keeps what the wrapped talker.generate returned (the codec tokens are not returned by
    the model's generate())."""

    def __init__(self, talker):
        self.talker, self.original, self.last = talker, talker.generate, None
        talker.generate = self

    def __call__(self, *args, **kwargs):
        self.last = self.original(*args, **kwargs)
        self.prompt_len = kwargs["input_ids"].shape[1]
        return self.last

    def restore(self) -> None:
        self.talker.generate = self.original

    def codes(self, row: int) -> list[int]:
        return self.last[row, self.prompt_len :].tolist()


def run_hf_serial(model, processor, requests, lengths: Lengths) -> tuple[list[RequestRecord], float]:
    """One request at a time; the whole answer (text and audio) arrives at once."""
    kwargs, observer, records = hf_generate_kwargs(model, lengths), _CodesObserver(model.talker), []
    t_all = time.perf_counter()
    for req in requests:
        t0 = time.perf_counter()
        inputs = hf_inputs(processor, [req])
        with torch.no_grad():
            seq, wav = model.generate(**inputs, **kwargs)
        latency = time.perf_counter() - t0
        tokens = seq[0, inputs["input_ids"].shape[1] :].tolist()
        text = processor.tokenizer.decode(tokens, skip_special_tokens=True)
        codes = observer.codes(0)
        records.append(RequestRecord(latency, latency, latency, len(tokens), len(codes), wav.numel(), text, codes))
    wall = time.perf_counter() - t_all
    observer.restore()
    return records, wall


def run_hf_batch(model, processor, requests, lengths: Lengths) -> tuple[list[RequestRecord], float]:
    """All requests in one batched generate() call (transformers decodes their audio one by one)."""
    kwargs, observer = hf_generate_kwargs(model, lengths), _CodesObserver(model.talker)
    t0 = time.perf_counter()
    inputs = hf_inputs(processor, requests)
    with torch.no_grad():
        seq, wavs = model.generate(**inputs, **kwargs)
    wall = time.perf_counter() - t0
    observer.restore()
    prompt = inputs["input_ids"].shape[1]
    records = []
    for i, wav in enumerate(wavs):
        tokens, codes = seq[i, prompt:].tolist(), observer.codes(i)
        text = processor.tokenizer.decode(tokens, skip_special_tokens=True)
        records.append(RequestRecord(wall, wall, wall, len(tokens), len(codes), wav.numel(), text, codes))
    return records, wall
