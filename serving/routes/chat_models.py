"""Request and response models of POST /v1/chat/completions (OpenAI's shapes)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omnistage.serving.routes.textgen import SamplingFields


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(BaseModel):
    data: str = Field(description="base64 of the encoded audio")
    format: Literal["wav", "mp3", "flac", "ogg"]


class AudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoURL(BaseModel):
    url: str = Field(description="a data:video/...;base64,... URL (MP4, WebM, MKV, ...)")


class VideoPart(BaseModel):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = TextPart | ImagePart | AudioPart | VideoPart


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class MMProcessorKwargs(BaseModel):
    """vLLM's per-request multimodal processor options (the ones these pipelines honour)."""

    model_config = ConfigDict(extra="forbid")

    use_audio_in_video: bool = Field(default=False, description="each video's sound track is heard with it")


class AudioOutput(BaseModel):
    voice: str
    format: Literal["wav", "pcm16", "flac", "mp3", "opus", "aac"] = "wav"


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOutput | None = None
    mm_processor_kwargs: MMProcessorKwargs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class MessageAudio(BaseModel):
    id: str
    data: str = Field(description="base64 of the audio in the asked format")
    transcript: str
    expires_at: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    audio: MessageAudio | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "content_filter", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    audio_tokens: int | None = None


class CompletionTokensDetails(BaseModel):
    audio_tokens: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    audio: dict[str, Any] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "content_filter", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat completion (`data: {...}`; the stream ends `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
