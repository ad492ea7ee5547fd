"""What chat and text completions share: the sampling fields (OpenAI's plus vLLM-style extras),
their mapping onto the AR stage's declared params, token strings for logprobs, and `usage`."""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import BaseModel, Field

from omnistage.serving.routes.request_base import OpenAIRequest
from omnistage.serving.routes.served import Served, UnsupportedError, invalid

MAX_N = 16


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIRequest):
    """Sampling fields of chat and text completions; the extras (top_k, min_p,
    repetition_penalty, ...) are what vLLM accepts beside OpenAI's."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None

    def sampling_fields(self, max_tokens: int | None, top_logprobs: int | None) -> dict[str, Any]:
        """The stage-side names and values of every field the request set."""
        fields: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": max_tokens,
            "stop": self.stop,
            "seed": self.seed,
            "n": self.n if self.n != 1 else None,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "logprobs": top_logprobs,
        }
        return {k: v for k, v in fields.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def check_stream_options(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")


@functools.lru_cache(maxsize=8)
def _tokenizer(model_source: str, subfolder: str | None):
    from omnistage.models.recipes import resolve_model
    from omnistage.stages.ar.text import TextTokenizer

    return TextTokenizer.from_pretrained(resolve_model(model_source, subfolder))


def tokenizer_for(served: Served) -> Any:
    """The tokenizer of the first `params:` stage with a model (for logprob token strings)."""
    for stage in served.serve.params:
        model = served.spec.stages[stage].model
        if model is not None:
            try:
                return _tokenizer(model.source, model.subfolder)
            except (OSError, ValueError) as exc:
                raise UnsupportedError(f"logprobs need the model's tokenizer: {exc}", param="logprobs") from exc
    raise UnsupportedError(f"the pipeline {served.name!r} has no tokenizer for logprobs", param="logprobs")


def _token_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The stage's [{token, logprob, top_logprobs}] as chat's `logprobs.content`."""
    content = []
    for e in entries:
        item = _token_entry(tokenizer, e["token"], e["logprob"])
        item["top_logprobs"] = [_token_entry(tokenizer, t["token"], t["logprob"]) for t in e["top_logprobs"]]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Any, entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """The stage's entries in the legacy completions shape (tokens, token_logprobs, ...)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        text = tokenizer.decode([e["token"]], skip_special_tokens=False)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        token_logprobs.append(e["logprob"])
        # the legacy API lists the sampled token beside the top k (up to k + 1 entries)
        listed = {tokenizer.decode([t["token"]], skip_special_tokens=False): t["logprob"] for t in e["top_logprobs"]}
        listed.setdefault(text, e["logprob"])
        top.append(listed)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def usage(info: dict[str, Any] | None, speech_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's usage from the text stage's info; a spoken reply (`speech_info`, the speech
    stages' info) adds its codec tokens to the completion, as audio_tokens. The prompt's
    audio_tokens are the audio-encoder positions the text stage counted in its prompt."""
    raw = (info or {}).get("usage") or {}
    prompt, completion = int(raw.get("prompt_tokens", 0)), int(raw.get("completion_tokens", 0))
    details = {k: int(raw[k]) for k in ("cached_tokens", "audio_tokens") if raw.get(k) is not None}
    out: dict[str, Any] = {}
    if speech_info is not None:
        audio = int(((speech_info or {}).get("usage") or {}).get("codec_tokens", 0))
        completion += audio
        out["completion_tokens_details"] = {"audio_tokens": audio}
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, **out}
    if details:
        out["prompt_tokens_details"] = details
    return out


def choices_of(text: str, info: dict[str, Any] | None, n: int) -> list[dict[str, Any]]:
    """[{index, text, finish_reason, logprobs}] for n sequences; the stage reports n > 1
    sequences in info["choices"], a single one as the text port plus info."""
    info = info or {}
    if n > 1 and info.get("choices"):
        return info["choices"]
    return [{"index": 0, "text": text, "finish_reason": info.get("finish_reason"), "logprobs": info.get("logprobs")}]


FinishReason = Literal["stop", "length", "content_filter", "tool_calls"]


def finish_reason(value: str | None) -> str:
    """The stage's reason in OpenAI's vocabulary (aborts and errors never get here)."""
    return "length" if value == "length" else "stop"
