"""Request and response models of POST /v1/chat/completions (OpenAI's shapes)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator

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


_PART_MODELS = {"text": "TextPart", "image_url": "ImagePart", "input_audio": "AudioPart", "video_url": "VideoPart"}


def _part_model(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _PART_MODELS.get(kind) if isinstance(kind, str) else None


# chosen by `type` (an unknown one is one error naming those there are); tagged with the
# models' names, which error locations drop (serving/errors.py: loc_to_param)
ContentPart = Annotated[
    Annotated[TextPart, Tag("TextPart")]
    | Annotated[ImagePart, Tag("ImagePart")]
    | Annotated[AudioPart, Tag("AudioPart")]
    | Annotated[VideoPart, Tag("VideoPart")],
    Discriminator(
        _part_model,
        custom_error_type="invalid_content_part",
        custom_error_message=f"a content part's type must be one of {', '.join(_PART_MODELS)}",
    ),
]


class AudioReference(BaseModel):
    """An earlier spoken reply, sent back in an assistant turn: `{id}`, or the whole
    `message.audio` as the `openai` client sends a reply's message back."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="the `audio.id` of a spoken reply this key was given, before its expires_at")
    transcript: str | None = Field(default=None, description="used when the id is no longer known")
    data: str | None = Field(default=None, description="ignored: the turn is taken as its transcript")
    expires_at: int | None = Field(default=None, description="ignored")


_ASSISTANT_ONLY = {
    "audio": "only an assistant message refers to an earlier spoken reply",
    "refusal": "only an assistant message carries a refusal",
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # required but for an assistant's turn (which may carry tool_calls instead), as OpenAI has it
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    refusal: str | None = None  # an earlier reply's, as the `openai` client sends it back
    audio: AudioReference | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"a {info.data['role']} message needs content")
        return content

    @field_validator("audio", "refusal")
    @classmethod
    def _of_assistant(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError(_ASSISTANT_ONLY[info.field_name])
        return value


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
