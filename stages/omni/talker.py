"""The `talker` stage: Qwen2.5-Omni's codec LM, fed by the thinker's stream as it is written.

Input: the thinker's `talker_embeds` stream (stages/omni/thinker.py): {"prompt": [P, H]} rows,
then {"reply": [k, H]} rows, one per thinker token fed back. As transformers'
`Qwen2_5OmniForConditionalGeneration.generate` builds the talker's input:
- prefill (starts once the prompt and the first reply row are in): the P prompt rows, the
  voice's text-side bos embedding, the first reply row; the codec pad / bos embeddings are
  added to the last two rows; positions 0..P+1 on all axes, or, with an image in the prompt,
  the thinker's 3-D prompt positions followed by the next two (its rope index over the same
  ids). The codec prompt ids (mask * P, pad, bos) count for the repetition penalty.
- decode step t adds reply row t + 1 to the fed-back codec token's embedding. Rows arrive
  while the talker runs (`extend_decode_embeds`); a sequence whose next row is not there yet
  waits in the engine (its batch mates keep stepping). When the thinker's stream ends, the
  text end and pad embeddings follow and the pad row is reused from then on, so the talker
  never sees the thinker's last token, as in transformers.
Output `codes`: codec tokens as they are sampled (the end token excluded), `info` at the end.
A stream that ends without prompt rows (the thinker answered in text only) finishes at once
with no codes (finish_reason "no_speech").

Sampling defaults are transformers' for Qwen2.5-Omni's talker (sampled, top-k 40, top-p 0.8,
temperature 0.9, repetition penalty 1.05 also when greedy, stop at codec pad / end, the codec
bos never sampled); every one can be overridden per request.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from omnistage.errors import InvalidRequestError
from omnistage.stages.ar.config import SAMPLING_PARAMS, SamplingParams
from omnistage.stages.ar.loader import checkpoint_files
from omnistage.stages.ar.sequence import SequenceOptions
from omnistage.stages.ar.stage import CUDA_GRAPH_PARAMS
from omnistage.stages.base import Emission, Port, StageContext, StageEngine, StageRequest, StepRecord
from omnistage.stages.omni.checkpoint import read_config
from omnistage.stages.params import Param, ParamSet
from omnistage.stages.registry import register_stage

STAGE_PARAMS = ParamSet(
    "talker",
    (
        Param("block_size", "integer", 16, "Tokens per KV-cache block.", minimum=1),
        Param("num_kv_blocks", "integer", None, "KV pool size in blocks.", minimum=1, nullable=True),
        Param("max_model_len", "integer", None, "Context length (default: the model's).", minimum=1, nullable=True),
        Param("weight_prefix", "string", "talker.", "The talker's weights' prefix in the Omni checkpoint."),
        Param("voices_file", "string", None, "Voices file (default: spk_dict.pt beside the weights).", nullable=True),
        Param(
            "generate_compat",
            "boolean",
            False,
            "Reproduce transformers 5.x generate() on unpadded input: it drops an all-ones attention "
            "mask, and without one the talker's forward skips the codec pad / start embeddings of the "
            "last two prompt rows and uses 1-D positions. false: the prefill as the forward defines it.",
        ),
        *CUDA_GRAPH_PARAMS,
    ),
)
TALKER_DEFAULTS = dict(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05, max_tokens=4096)
REQUEST_PARAMS = ParamSet(
    "talker request",
    tuple(dataclasses.replace(p, default=TALKER_DEFAULTS.get(p.name, p.default)) for p in SAMPLING_PARAMS.params)
    + (
        Param(
            "voice", "string", None, "Voice name from the checkpoint's spk_dict.pt (default: the first).", nullable=True
        ),
    ),
    SAMPLING_PARAMS.rules,
)


@dataclass
class TalkerSetup:
    """The checkpoint facts the talker's input needs (codec ids, thinker text embeddings)."""

    codec_pad: int
    codec_bos: int
    codec_end: int
    codec_mask: int
    voice_bos_embeds: dict[str, torch.Tensor]  # voice -> thinker embedding of its text bos token
    text_end_embed: torch.Tensor
    text_pad_embed: torch.Tensor

    @classmethod
    def load(cls, model_dir: str, voices_file: str | None) -> TalkerSetup:
        cfg = read_config(model_dir)["talker_config"]
        voices = read_voices(model_dir, voices_file)
        if not voices:
            raise ValueError(f"{model_dir}: no voices in spk_dict.pt")
        names = list(voices)
        ids = [int(voices[n]["bos_token"]) for n in names]
        ids += [cfg["tts_text_end_token_id"], cfg["tts_text_pad_token_id"]]
        rows = _thinker_embedding_rows(model_dir, ids)
        return cls(
            codec_pad=cfg["tts_codec_pad_token_id"],
            codec_bos=cfg["tts_codec_start_token_id"],
            codec_end=cfg["tts_codec_end_token_id"],
            codec_mask=cfg["tts_codec_mask_token_id"],
            voice_bos_embeds={n: rows[i] for i, n in enumerate(names)},
            text_end_embed=rows[-2],
            text_pad_embed=rows[-1],
        )


def _thinker_embedding_rows(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """Rows of the thinker's token embedding table, read without loading the table."""
    name = "thinker.model.embed_tokens.weight"
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            if name in f.keys():
                table = f.get_slice(name)
                return torch.stack([table[i : i + 1][0] for i in token_ids]).float()
    raise ValueError(f"{model_dir}: no {name}")


@dataclass
class _Request:
    request_id: str
    voice: str
    sampling: SamplingParams
    prompt: torch.Tensor | None = None
    positions: torch.Tensor | None = None  # (3, P) when the thinker's prompt had an image
    reply: list[torch.Tensor] = field(default_factory=list)  # rows not yet handed to the engine
    thinker_done: bool = False
    started: bool = False
    codes: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@register_stage("talker")
class TalkerStage(StageEngine):
    inputs = {"talker_embeds": Port("hidden_states", streaming=True)}
    # voice: the request's voice, sent once before its first codes (token2wav takes it as its own)
    outputs = {"voice": Port("json", streaming=True), "codes": Port("tokens", streaming=True), "info": Port("json")}
    batching_policies = ("continuous",)
    needs_model = True
    stage_params = STAGE_PARAMS
    request_params = REQUEST_PARAMS

    @classmethod
    def check_queued(cls, stage: Any, params: dict[str, Any]) -> None:
        voice = params.get("voice")
        if not voice:  # none or "": the checkpoint's first
            return
        known = _voice_names(stage)
        if known and voice not in known:
            raise InvalidRequestError(f"unknown voice {voice!r}; known: {', '.join(known)}", param="voice")

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        from omnistage.stages.ar import EngineConfig, LLMEngine

        if ctx.model_path is None:
            raise ValueError("talker needs a Qwen2.5-Omni model")
        params = STAGE_PARAMS.validate(ctx.params)
        self.setup = TalkerSetup.load(str(ctx.model_path), params["voices_file"])
        self.generate_compat = params["generate_compat"]
        self.engine = LLMEngine(
            EngineConfig(
                model_path=str(ctx.model_path),
                dtype=ctx.dtype,
                device=str(ctx.device),
                block_size=params["block_size"],
                num_kv_blocks=params["num_kv_blocks"],
                max_num_batched_tokens=ctx.batching.max_num_batched_tokens,
                max_num_seqs=ctx.batching.max_num_seqs,
                enable_prefix_caching=False,  # every prompt carries its own thinker states
                max_model_len=params["max_model_len"],
                weight_prefix=params["weight_prefix"],
                # transformers' talker_eos_token_id: codec pad and end (config.json's ids are the thinker's)
                eos_token_ids=(self.setup.codec_pad, self.setup.codec_end),
                enforce_eager=params["enforce_eager"],
                cuda_graph_max_batch=params["cuda_graph_max_batch"],
            )
        )
        self._requests: dict[str, _Request] = {}
        self._pending: list[Emission] = []

    # -- protocol ----------------------------------------------------------------------------
    def add(self, request: StageRequest) -> None:
        try:
            params = REQUEST_PARAMS.validate(request.params)
            voice = params.pop("voice") or next(iter(self.setup.voice_bos_embeds))
            if voice not in self.setup.voice_bos_embeds:
                known = ", ".join(self.setup.voice_bos_embeds)
                raise InvalidRequestError(f"unknown voice {voice!r}; known: {known}", param="voice")
            sampling = SamplingParams.from_checked(params)
        except InvalidRequestError as err:
            self._pending.append(
                Emission(
                    request.request_id, finished=True, error=str(err), error_kind="invalid_request", param=err.param
                )
            )
            return
        self._requests[request.request_id] = _Request(request.request_id, voice, sampling)
        chunk = request.inputs.get("talker_embeds")
        if chunk is not None:  # the whole stream given at once (a non-streaming edge)
            self.feed(request.request_id, "talker_embeds", chunk, True)

    def feed(self, request_id: str, port: str, chunk: Any, last: bool) -> None:
        req = self._requests.get(request_id)
        if req is None or req.finish_reason is not None:
            return
        if chunk:
            if "prompt" in chunk:
                req.prompt = chunk["prompt"].float()
                req.positions = chunk.get("positions")
            if "reply" in chunk:
                req.reply.append(chunk["reply"].float())
        if last:
            req.thinker_done = True
            req.reply.append(torch.stack([self.setup.text_end_embed, self.setup.text_pad_embed]))
        self._hand_over(req)

    def abort(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
        self._pending = [e for e in self._pending if e.request_id != request_id]

    def has_work(self) -> bool:
        return bool(self._pending) or self.engine.scheduler.has_runnable()

    def num_requests(self) -> int:
        return len(self._requests) + len(self._pending)

    def step(self) -> list[Emission]:
        emissions, self._pending = self._pending, []
        if not self.engine.scheduler.has_runnable():
            return emissions
        t0 = time.perf_counter()
        outputs = self.engine.step()
        seen = []
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None:
                continue
            seen.append(out.request_id)
            emissions.append(self._emission(req, out))
        self.step_log.append(StepRecord(tuple(seen), len(seen), time.perf_counter() - t0))
        return emissions

    def stats(self) -> dict[str, float]:
        stats = {k: float(v) for k, v in self.engine.stats().items() if isinstance(v, (int, float))}
        stats["requests_live"] = float(len(self._requests))
        return stats

    def close(self) -> None:
        for request_id in list(self._requests):
            self.abort(request_id)

    # -- internals ---------------------------------------------------------------------------
    def _hand_over(self, req: _Request) -> None:
        """Start the request once its prefill is known; pass new reply rows to the engine."""
        if not req.started:
            if req.thinker_done and req.prompt is None:  # a text-only answer: nothing to say
                self._requests.pop(req.request_id, None)
                info = {"finish_reason": "no_speech", "voice": req.voice, "usage": {"codec_tokens": 0}}
                self._pending.append(Emission(req.request_id, {"codes": [], "info": info}, finished=True))
                return
            if req.prompt is None or not req.reply:
                return
            rows = torch.cat(req.reply)
            self._start(req, rows[0])
            req.reply = [rows[1:]] if rows.shape[0] > 1 else []
        if req.reply:
            rows = torch.cat(req.reply)
            req.reply = []
            self.engine.extend_decode_embeds(req.request_id, rows)
        self.engine.set_decode_embeds_open(req.request_id, not req.thinker_done)

    def _start(self, req: _Request, first_reply: torch.Tensor) -> None:
        s = self.setup
        prompt = torch.cat([req.prompt, s.voice_bos_embeds[req.voice][None], first_reply[None]])
        codec = self.engine.model.embed_tokens
        with torch.no_grad():
            extra = codec(torch.tensor([s.codec_pad, s.codec_bos], device=codec.weight.device)).float().cpu()
        positions = None
        if not self.generate_compat:
            prompt[-2:] += extra
            if req.positions is not None:  # an image in the prompt: the thinker's 3-D positions
                nxt = int(req.positions.max()) + 1
                positions = torch.cat([req.positions, torch.tensor([[nxt, nxt + 1]]).expand(3, 2)], dim=1)
        n = prompt.shape[0]
        try:
            options = SequenceOptions(
                suppress_token_ids=(s.codec_bos,),
                prompt_penalty_ids=[s.codec_mask] * (n - 2) + [s.codec_pad, s.codec_bos],
            )
            self.engine.add_request(
                req.request_id, None, req.sampling, inputs_embeds=prompt, position_ids=positions, options=options
            )
        except InvalidRequestError as err:
            self._fail(req, str(err), err.param)
            return
        req.started = True

    def _fail(self, req: _Request, message: str, param: str | None = None) -> None:
        self._requests.pop(req.request_id, None)
        req.finish_reason = "error"
        self._pending.append(
            Emission(req.request_id, finished=True, error=message, error_kind="invalid_request", param=param)
        )

    def _emission(self, req: _Request, out) -> Emission:
        new = [t for t in out.new_token_ids if t not in (self.setup.codec_pad, self.setup.codec_end)]
        outputs: dict[str, Any] = {"codes": new}
        if not req.codes:  # the first codes: the voice goes first, so token2wav has it before them
            outputs = {"voice": req.voice, "codes": new}
        req.codes.extend(new)
        if not out.finished:
            return Emission(req.request_id, outputs=outputs)
        req.finish_reason = out.finish_reason
        del self._requests[req.request_id]
        info = {
            "finish_reason": out.finish_reason,
            "voice": req.voice,
            "usage": {"prompt_tokens": out.num_prompt_tokens, "codec_tokens": len(req.codes)},
        }
        return Emission(req.request_id, outputs={**outputs, "info": info}, finished=True)


def read_voices(model_dir: str, voices_file: str | None) -> dict[str, Any]:
    """The checkpoint's voices (spk_dict.pt beside the weights, or `voices_file`)."""
    from pathlib import Path

    return torch.load(Path(voices_file or Path(model_dir) / "spk_dict.pt"), map_location="cpu", weights_only=True)


@functools.cache
def _voice_names_of(model_dir: str, voices_file: str | None) -> tuple[str, ...]:
    return tuple(read_voices(model_dir, voices_file))


def _voice_names(stage: Any) -> tuple[str, ...]:
    """The voices of a talker stage (a StageSpec) whose checkpoint is on disk; () when it
    cannot be read here (the stage checks when the request reaches it)."""
    from omnistage.models.recipes import resolve_model

    if stage.model is None:
        return ()
    try:
        model_dir = str(resolve_model(stage.model.source, stage.model.subfolder))
        return _voice_names_of(model_dir, (stage.params or {}).get("voices_file"))
    except (OSError, ValueError, KeyError, RuntimeError, InvalidRequestError):  # e.g. not in this host's cache
        return ()
