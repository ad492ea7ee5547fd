"""The `thinker` stage: Qwen2.5-Omni's text model on the `ar_lm` engine, with audio and images merged in.

A request gives chat `messages` (typed parts: text, audio, image) and, from the encoders,
`audio_embeds` (one tensor per audio part, in order) and `image_embeds` (one {"embeds",
"grid_thw"} per image part). The stage renders the chat template (with the speech system
prompt when the answer is spoken), expands each `<|AUDIO|>` / `<|IMAGE|>` to its encoder
length, embeds the text tokens with the thinker's own table and puts the encoder rows at the
placeholders. Positions follow transformers' `get_rope_index` (stages/omni/positions.py): one
id on all three M-RoPE axes for text and audio, the patch grid for an image; without an image
that is what the engine does for a prompt without explicit positions, so none are passed.

Prefix caching covers the media content: each prompt position is keyed by its token id, or
for an audio / image row by a 64-bit digest of that item's embeddings (and grid), so two
requests with equal token ids but different audio never share KV blocks and the same audio
twice does.

Per generated token it streams `talker_embeds`, what the talker conditions on: a chunk
{"prompt": [P, hidden]} once the prompt has run (input embeddings with the multimodal rows
zeroed, as transformers hands them to the talker, plus the last layer's hidden states), then
{"reply": [k, hidden]} rows (token embedding + last hidden state) for each generated token as
it is fed back. With an image the prompt chunk also carries "positions" (3, P), which the
talker's prefill continues. With a `speak` text the reply is forced: that text's tokens are
prefilled after the prompt and streamed as reply rows (stages/omni/speak.py). Positions
served from the prefix cache are not run; their rows come from the talker rows kept per
cached block (stages/omni/talker_rows.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.stages.ar.sequence import SequenceOptions
from omnistage.stages.ar.stage import REQUEST_PARAMS as AR_REQUEST_PARAMS
from omnistage.stages.ar.stage import STAGE_PARAMS as AR_STAGE_PARAMS
from omnistage.stages.ar.stage import ARLMStage
from omnistage.stages.base import Emission, Port, StageContext
from omnistage.stages.omni.checkpoint import read_config
from omnistage.stages.omni.inputs import OmniProcessor
from omnistage.stages.omni.prompt import MediaInputs, OmniPrompt, PromptBuilder
from omnistage.stages.omni.speak import (
    ForcedReply,
    append_embeds,
    extend_positions,
    speak_messages,
    speak_params,
    speak_text,
)
from omnistage.stages.omni.talker_rows import BlockRows, TalkerRowStore, spoken_salt
from omnistage.stages.params import Param, ParamSet
from omnistage.stages.registry import register_stage

STAGE_PARAMS = ParamSet(
    "thinker",
    # hidden_state_layers stays declared (the ar_lm code reads it) but the stage sets it itself.
    tuple(p for p in AR_STAGE_PARAMS.params if p.name != "weight_prefix")
    + (
        Param("weight_prefix", "string", "thinker.", "The thinker's weights' prefix in the Omni checkpoint."),
        Param("talker_output", "boolean", True, "Stream talker_embeds for spoken answers."),
    ),
)
REQUEST_PARAMS = AR_REQUEST_PARAMS.extended(
    "thinker request",
    (
        Param("return_audio", "boolean", True, "The answer will be spoken: speech system prompt, talker_embeds."),
        Param(
            "modalities",
            "string_list",
            None,
            'OpenAI-style output modalities: ["text"] or ["text", "audio"]; wins over return_audio.',
            nullable=True,
            check=lambda v: (
                None if set(v) <= {"text", "audio"} and "text" in v else 'must be ["text"] or ["text", "audio"]'
            ),
        ),
        Param(
            "use_audio_in_video",
            "boolean",
            False,
            "Each video's sound is the next audio input, interleaved with its frames in 2 s chunks.",
        ),
    ),
)
OWN_PARAMS = ("return_audio", "modalities", "use_audio_in_video")
_LAST_LAYER = -1


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass
class _TalkerFeed:
    """Per request: how many of its prompt rows arrived, and those rows until all did."""

    num_prompt: int
    media_mask: torch.Tensor | None
    positions: torch.Tensor | None
    blocks: BlockRows | None = None  # None: prefix caching off
    prompt_rows: list[torch.Tensor] = field(default_factory=list)
    rows_seen: int = 0


@register_stage("thinker")
class ThinkerStage(ARLMStage):
    inputs = {
        "messages": Port("json", optional=True),
        "speak": Port("text", optional=True),
        "audio_embeds": Port("embeddings", optional=True),
        "image_embeds": Port("embeddings", optional=True),
        "video_embeds": Port("embeddings", optional=True),
    }
    outputs = {
        "text": Port("text", streaming=True),
        "tokens": Port("tokens", streaming=True),
        "talker_embeds": Port("hidden_states", streaming=True),
        "info": Port("json"),
    }
    stage_params = STAGE_PARAMS
    request_params = REQUEST_PARAMS

    @classmethod
    def ports(cls, params: dict[str, Any]) -> tuple[dict[str, Port], dict[str, Port]]:
        ins, outs = dict(cls.inputs), dict(cls.outputs)
        if not (params or {}).get("talker_output", True):
            outs.pop("talker_embeds")
        return ins, outs

    def __init__(self, ctx: StageContext):
        params = STAGE_PARAMS.validate(ctx.params)
        self.talker_output = params.pop("talker_output")
        params["hidden_state_layers"] = [0, _LAST_LAYER] if self.talker_output else []
        super().__init__(dataclasses.replace(ctx, params=params))
        self.processor = OmniProcessor(ctx.model_path)
        thinker_cfg = read_config(ctx.model_path)["thinker_config"]
        self.prompts = PromptBuilder(self.processor, self.engine.model.embed_tokens, thinker_cfg)
        self._feeds: dict[str, _TalkerFeed] = {}
        self._block_size = params["block_size"]
        caching = params["enable_prefix_caching"]
        self._talker_rows = TalkerRowStore(self.engine.num_total_blocks) if caching else None
        self._admitting: OmniPrompt | None = None
        self._speech = False
        self._audio_in_video = False
        self._forcing: ForcedReply | None = None  # the speak request being admitted
        self._forced: dict[str, ForcedReply] = {}
        self._audio_positions: dict[str, int] = {}  # per request: audio-encoder rows in its prompt

    # -- admission -------------------------------------------------------------------------
    def _admit(self, request) -> None:
        params = dict(request.params)
        speak = request.inputs.get("speak")
        self._forcing = None
        if speak is not None:
            text = speak_text(speak)
            params = speak_params(params)
            self._forcing = ForcedReply(text, self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        own = REQUEST_PARAMS.validate({k: params.pop(k) for k in OWN_PARAMS if k in params})
        speech = own["return_audio"] if own["modalities"] is None else "audio" in own["modalities"]
        wants_rows = speech and self.talker_output
        if wants_rows:  # hits only blocks a spoken request computed: their talker rows are kept
            params["cache_salt"] = spoken_salt(params.get("cache_salt"))
        self._speech = speech
        self._audio_in_video = own["use_audio_in_video"]
        super()._admit(dataclasses.replace(request, params=params))
        prompt = self._admitting
        forced = self._forcing
        num_prompt = forced.num_prompt if forced is not None else len(prompt.token_ids)
        if forced is not None:
            self._forced[request.request_id] = forced
        audio_id = self.processor.audio_token_id
        self._audio_positions[request.request_id] = sum(t == audio_id for t in prompt.token_ids[:num_prompt])
        if wants_rows:
            positions = prompt.positions[:, :num_prompt] if prompt.positions is not None else None
            feed = _TalkerFeed(num_prompt, prompt.media_mask, positions)
            if self._talker_rows is not None:
                keys = list(prompt.cache_keys or prompt.token_ids)
                feed.blocks = BlockRows(keys, params["cache_salt"], self._block_size)
            self._feeds[request.request_id] = feed

    def _sequence_options(self) -> SequenceOptions | None:
        prompt = self._admitting
        if prompt is None or prompt.cache_keys is None:
            return None
        # transformers penalises the placeholder ids too
        return SequenceOptions(prompt_cache_keys=prompt.cache_keys, prompt_penalty_ids=prompt.token_ids)

    def _prompt(self, inputs: dict[str, Any]):
        messages = inputs.get("messages")
        if self._forcing is not None:
            messages = speak_messages(messages, self._forcing.text)
        prompt = self.build_prompt(messages, inputs, self._speech, self._audio_in_video)
        if self._forcing is not None:
            prompt = self._with_reply(prompt, self._forcing)
        self._admitting = prompt
        return prompt.token_ids, prompt.embeds, prompt.positions

    def build_prompt(self, messages: Any, inputs: dict[str, Any], speech: bool, audio_in_video: bool) -> OmniPrompt:
        media = MediaInputs(
            _as_list(inputs.get("audio_embeds")),
            _as_list(inputs.get("image_embeds")),
            _as_list(inputs.get("video_embeds")),
            audio_in_video,
        )
        return self.prompts.build(messages, media, speech)

    def _with_reply(self, prompt: OmniPrompt, forced: ForcedReply) -> OmniPrompt:
        """The prompt followed by the forced reply's tokens (prefilled like the prompt)."""
        forced.num_prompt = len(prompt.token_ids)
        ids = prompt.token_ids + forced.ids
        if prompt.embeds is None:
            return OmniPrompt(ids, None, None, None)
        mask = torch.cat([prompt.media_mask, torch.zeros(len(forced.ids), dtype=torch.bool)])
        embeds = append_embeds(prompt.embeds, self.engine.model.embed_tokens, forced.ids)
        positions = extend_positions(prompt.positions, len(forced.ids)) if prompt.positions is not None else None
        return OmniPrompt(ids, embeds, mask, prompt.cache_keys + forced.ids, positions)

    def abort(self, request_id: str) -> None:
        self._feeds.pop(request_id, None)
        self._forced.pop(request_id, None)
        self._audio_positions.pop(request_id, None)
        super().abort(request_id)

    # -- output ----------------------------------------------------------------------------
    def _emission(self, live, outs: list) -> Emission | None:
        emission = super()._emission(live, outs)
        if emission is None:
            return None
        hidden = emission.outputs.pop("hidden_states", None)
        feed = self._feeds.get(live.request_id)
        if feed is not None and hidden is not None:
            chunk = self._talker_chunk(feed, hidden, live)
            if chunk is not None:
                emission.outputs["talker_embeds"] = chunk
        if live.request_id in self._forced:
            self._report_forced(live.request_id, emission)
        if emission.finished and "info" in emission.outputs:  # usage.audio_tokens: OpenAI's prompt audio
            audio = self._audio_positions.pop(live.request_id, 0)
            emission.outputs["info"].setdefault("usage", {})["audio_tokens"] = audio
        if emission.finished and self._feeds.pop(live.request_id, None) is None:
            emission.absent_ports = ("talker_embeds",)  # a text answer: talker and token2wav never see it
        if not emission.outputs and not emission.finished:
            return None
        return emission

    def _report_forced(self, request_id: str, emission: Emission) -> None:
        """A speak request reports the forced reply as its text and tokens; the one token the
        engine sampled after it is dropped."""
        out = emission.outputs
        out.pop("text", None)
        out.pop("tokens", None)
        if emission.finished:
            forced = self._forced.pop(request_id)
            out["text"], out["tokens"] = forced.text, list(forced.ids)
            usage = out["info"]["usage"]
            usage["prompt_tokens"], usage["completion_tokens"] = forced.num_prompt, len(forced.ids)
            out["info"]["finish_reason"] = "stop"

    def _talker_chunk(self, feed: _TalkerFeed, hidden: torch.Tensor, live) -> dict[str, torch.Tensor] | None:
        """hidden [rows, 2, H] (layer 0, last layer) of the rows run this step -> the talker's
        input rows: embedding (multimodal rows zeroed in the prompt) + last hidden state; the
        rows of prefix-cached positions come from the row store (stages/omni/talker_rows.py)."""
        start = feed.rows_seen
        cached = None
        if start == 0 and live.num_cached_tokens and feed.blocks is not None:
            cached = feed.blocks.cached(self._talker_rows, live.num_cached_tokens)
            start = live.num_cached_tokens
        embed = hidden[:, 0].clone()
        n_prompt = max(0, min(feed.num_prompt, start + hidden.shape[0]) - start)
        if n_prompt and feed.media_mask is not None:
            embed[:n_prompt][feed.media_mask[start : start + n_prompt]] = 0
        rows = embed + hidden[:, 1]
        if feed.blocks is not None:
            hashes_held = self.engine.block_manager.hash_to_block
            feed.blocks.record(self._talker_rows, rows, live.tokens[0], hashes_held)
        if cached is not None:
            rows, start = torch.cat([cached, rows]), 0
        feed.rows_seen = start + rows.shape[0]
        n_prompt = max(0, min(feed.num_prompt, feed.rows_seen) - start)
        chunk: dict[str, torch.Tensor] = {}
        if n_prompt:
            feed.prompt_rows.append(rows[:n_prompt])
            if start + n_prompt == feed.num_prompt:
                chunk["prompt"] = torch.cat(feed.prompt_rows)
                feed.prompt_rows = []
                if feed.positions is not None:
                    chunk["positions"] = feed.positions
        if n_prompt < rows.shape[0]:
            chunk["reply"] = rows[n_prompt:]
        return chunk or None

    def close(self) -> None:
        self._feeds.clear()
        self._forced.clear()
        super().close()
