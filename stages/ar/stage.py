"""The `ar_lm` stage: an autoregressive LM behind the engine protocol.

It wraps the token-level `LLMEngine` (continuous batching over a paged KV cache) and adds
what a pipeline needs around it: prompt encoding (text or chat messages), per-request
sampling params with validation, incremental text with stop strings, streaming of tokens,
text and hidden states each step, and `info` (finish reason, usage, logprobs) at the end.

A request with n > 1 streams sequence 0 on `text` / `tokens` / `hidden_states`; every
sequence's text, tokens and finish reason are in `info["choices"]`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.ar.config import SAMPLING_PARAMS, SamplingParams
from omnistage.stages.ar.requests import embeddings_input, tokens_input
from omnistage.stages.ar.text import OutputText, TextTokenizer, check_text, normalize_stop
from omnistage.stages.base import Emission, Port, StageContext, StageEngine, StageRequest, StepRecord
from omnistage.stages.contracts import error_emission
from omnistage.stages.params import Param, ParamSet
from omnistage.stages.registry import register_stage


def _size_problem(value: int | str) -> str | None:
    try:
        return None if _parse_bytes(value) >= 1 else "must be a positive size"
    except ValueError:
        return "is not a size"


# Shared by every stage that runs an LLMEngine (ar_lm, thinker, talker).
CUDA_GRAPH_PARAMS = (
    Param(
        "enforce_eager",
        "boolean",
        False,
        "Never replay decode steps from CUDA graphs (they run on CUDA with the Triton kernels).",
    ),
    Param(
        "cuda_graph_max_batch",
        "integer",
        256,
        "Most sequences in a decode step replayed from a CUDA graph (capped by max_num_seqs).",
        minimum=1,
    ),
)

STAGE_PARAMS = ParamSet(
    "ar_lm",
    (
        Param("block_size", "integer", 16, "Tokens per KV-cache block.", minimum=1),
        Param(
            "num_kv_blocks",
            "integer",
            None,
            "KV pool size in blocks (wins over kv_cache_bytes).",
            minimum=1,
            nullable=True,
        ),
        Param(
            "kv_cache_bytes",
            "size",
            None,
            "KV pool size in bytes; default: pool.memory, else max_num_seqs full-length sequences (at most 1 GiB).",
            nullable=True,
            check=_size_problem,
        ),
        Param(
            "max_model_len",
            "integer",
            None,
            "Context length; default: the model's max_position_embeddings, capped by the pool.",
            minimum=1,
            nullable=True,
        ),
        Param(
            "hidden_state_layers",
            "integer_list",
            [],
            "HF hidden-state indices to emit (0 = embeddings, "
            "i = after layer i, num_layers or -1 = after the final norm).",
        ),
        Param("enable_prefix_caching", "boolean", True, "Share KV blocks of equal prompt prefixes."),
        Param(
            "weight_prefix",
            "string",
            None,
            "Decoder weights' prefix in a larger checkpoint (e.g. thinker.); default: the model's prefix.",
            nullable=True,
        ),
        Param("hf_config_key", "string", None, "Dotted path of the text config inside config.json.", nullable=True),
        *CUDA_GRAPH_PARAMS,
    ),
)

REQUEST_PARAMS = SAMPLING_PARAMS.extended(
    "ar_lm request",
    (
        Param("stop", "string_or_list", None, "Stop strings: the text ends before the first one.", nullable=True),
        Param(
            "cache_salt",
            "string",
            None,
            "Requests with different salts never share prefix-cache blocks.",
            nullable=True,
        ),
        Param("priority", "integer", 0, "Lower runs first among waiting requests."),
        Param("skip_special_tokens", "boolean", True, "Leave special tokens out of the text."),
    ),
)


@dataclass
class _Live:
    """What the stage tracks for one request between steps."""

    request_id: str
    n: int
    texts: list[OutputText] | None  # one per sequence; None without a tokenizer
    logprobs_wanted: bool
    logprobs_top: int  # how many top_logprobs each entry lists (OpenAI: exactly this many)
    tokens: list[list[int]]
    logprobs: list[list[dict[str, Any]]]
    finish_reasons: list[str | None]
    engine_finished: list[bool]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.finish_reasons)


@register_stage("ar_lm")
class ARLMStage(StageEngine):
    inputs = {
        "prompt": Port("text", optional=True),
        "messages": Port("json", optional=True),
        "tokens": Port("tokens", optional=True),
        "embeddings": Port("embeddings", optional=True),
        "position_ids": Port("tensor", optional=True),
    }
    outputs = {
        "text": Port("text", streaming=True),
        "tokens": Port("tokens", streaming=True),
        "hidden_states": Port("hidden_states", streaming=True),
        "info": Port("json"),
    }
    batching_policies = ("continuous",)
    needs_model = True
    stage_params = STAGE_PARAMS
    request_params = REQUEST_PARAMS

    @classmethod
    def ports(cls, params: dict[str, Any]) -> tuple[dict[str, Port], dict[str, Port]]:
        ins, outs = dict(cls.inputs), dict(cls.outputs)
        if not (params or {}).get("hidden_state_layers"):
            outs.pop("hidden_states")
        return ins, outs

    # -- construction ----------------------------------------------------------------------
    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        from omnistage.stages.ar import EngineConfig, LLMEngine

        problems = self.validate_params(ctx.params)
        if problems:
            raise ValueError("; ".join(problems))
        if ctx.model_path is None:
            raise ValueError("ar_lm needs a model")
        params = STAGE_PARAMS.validate(ctx.params)
        model_dir = str(ctx.model_path)  # already resolved, subfolder included
        self.hidden_state_layers = tuple(params["hidden_state_layers"])
        kv_bytes = params["kv_cache_bytes"]
        if kv_bytes is None and params["num_kv_blocks"] is None:
            kv_bytes = ctx.memory_bytes  # the pool's budget sizes the KV pool
        config = EngineConfig(
            model_path=model_dir,
            dtype=ctx.dtype,
            device=str(ctx.device),
            block_size=params["block_size"],
            num_kv_blocks=params["num_kv_blocks"],
            kv_cache_bytes=_parse_bytes(kv_bytes) if kv_bytes is not None else None,
            max_num_batched_tokens=ctx.batching.max_num_batched_tokens,
            max_num_seqs=ctx.batching.max_num_seqs,
            enable_prefix_caching=params["enable_prefix_caching"],
            max_model_len=params["max_model_len"],
            hidden_state_layers=self.hidden_state_layers,
            hf_config_key=params["hf_config_key"],
            weight_prefix=params["weight_prefix"] or ctx.model_prefix or "",
            enforce_eager=params["enforce_eager"],
            cuda_graph_max_batch=params["cuda_graph_max_batch"],
        )
        self.engine = LLMEngine(config)
        self.tokenizer = TextTokenizer.from_pretrained(model_dir) if TextTokenizer.available(model_dir) else None
        self._live: dict[str, _Live] = {}
        self._pending: list[Emission] = []  # rejected requests, reported on the next step

    # -- protocol --------------------------------------------------------------------------
    def add(self, request: StageRequest) -> None:
        try:
            self._admit(request)
        except InvalidRequestError as err:
            self._live.pop(request.request_id, None)
            self._pending.append(error_emission(request.request_id, err))

    def abort(self, request_id: str) -> None:
        self.paused.discard(request_id)
        if self._live.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
        self._pending = [e for e in self._pending if e.request_id != request_id]

    def has_work(self) -> bool:
        if self.paused:  # held requests alone give the loop nothing to do
            return bool(self._pending) or self.engine.has_runnable_requests()
        return bool(self._pending) or self.engine.has_unfinished_requests()

    def pause(self, request_id: str) -> None:
        super().pause(request_id)
        self.engine.hold_request(request_id, True)

    def resume(self, request_id: str) -> None:
        super().resume(request_id)
        self.engine.hold_request(request_id, False)

    def num_requests(self) -> int:
        return len(self._live) + len(self._pending)

    def step(self) -> list[Emission]:
        emissions, self._pending = self._pending, []
        if not self.engine.has_unfinished_requests():
            return emissions
        t0 = time.perf_counter()
        outputs = self.engine.step()
        by_request: dict[str, list] = {}
        for out in outputs:
            by_request.setdefault(out.request_id, []).append(out)
        for request_id, outs in by_request.items():
            live = self._live.get(request_id)
            if live is None:
                continue
            emission = self._emission(live, outs)
            if emission is not None:
                emissions.append(emission)
        self.step_log.append(StepRecord(tuple(by_request), len(by_request), time.perf_counter() - t0))
        return emissions

    def stats(self) -> dict[str, float]:
        stats = {
            k: float(v)
            for k, v in self.engine.stats().items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        stats.setdefault("kv_blocks_free", float(self.engine.num_free_blocks))
        stats.setdefault("kv_blocks_total", float(self.engine.num_total_blocks))
        stats["requests_live"] = float(len(self._live))
        return stats

    def close(self) -> None:
        for request_id in list(self._live):
            self.abort(request_id)

    # -- admission -------------------------------------------------------------------------
    def _admit(self, request: StageRequest) -> None:
        if request.request_id in self._live:
            raise InvalidRequestError(f"request {request.request_id!r} is already running")
        params = REQUEST_PARAMS.validate(request.params)  # the one check of every value
        stops = normalize_stop(params.pop("stop"))
        cache_salt = params.pop("cache_salt")
        priority = params.pop("priority")
        skip_special = params.pop("skip_special_tokens")
        sampling = SamplingParams.from_checked(params)
        if stops and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none", param="stop")

        prompt_ids, embeds, positions = self._prompt(request.inputs)
        self._live[request.request_id] = _Live(
            request_id=request.request_id,
            n=sampling.n,
            texts=[OutputText(self.tokenizer, stops, skip_special) for _ in range(sampling.n)]
            if self.tokenizer is not None
            else None,
            logprobs_wanted=sampling.logprobs is not None,
            logprobs_top=sampling.logprobs or 0,
            tokens=[[] for _ in range(sampling.n)],
            logprobs=[[] for _ in range(sampling.n)],
            finish_reasons=[None] * sampling.n,
            engine_finished=[False] * sampling.n,
        )
        self.engine.add_request(
            request.request_id,
            prompt_ids,
            sampling,
            inputs_embeds=embeds,
            position_ids=positions,
            priority=priority,
            cache_salt=cache_salt,
            options=self._sequence_options(),
        )

    def _sequence_options(self):
        """Engine options for the request being admitted (a subclass's hook; called right after
        `_prompt`). None: the defaults."""
        return None

    def _prompt(self, inputs: dict[str, Any]):
        given = [k for k in ("prompt", "messages", "tokens", "embeddings") if inputs.get(k) is not None]
        text_inputs = [k for k in given if k in ("prompt", "messages")]
        if not given:
            raise InvalidRequestError("ar_lm needs one of prompt, messages, tokens or embeddings")
        if len(text_inputs) > 1 or (text_inputs and len(given) > 1):
            raise InvalidRequestError(f"give only one prompt form, got {', '.join(given)}")
        if text_inputs and self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send tokens or embeddings")
        embeds = positions = None
        if text_inputs:
            ids = self._text_ids(text_inputs[0], inputs[text_inputs[0]])
        else:
            ids = tokens_input(inputs["tokens"]) if "tokens" in given else None
            if "embeddings" in given:
                embeds = embeddings_input(inputs["embeddings"])
                if ids is None:
                    ids = [0] * embeds.shape[0]  # placeholders; the model reads the embeddings
                elif len(ids) != embeds.shape[0]:
                    raise InvalidRequestError(
                        f"tokens ({len(ids)}) and embeddings ({embeds.shape[0]}) differ in length"
                    )
        if inputs.get("position_ids") is not None:
            positions = torch.as_tensor(inputs["position_ids"], dtype=torch.long)
        if not ids:
            port = text_inputs[0] if text_inputs else "tokens"
            raise InvalidRequestError("the prompt is empty", param=f"inputs.{port}")
        return ids, embeds, positions

    def _text_ids(self, form: str, value: Any) -> list[int]:
        """Token ids of a prompt or chat. A text too long for any tokenization of it to fit the
        context is refused before tokenizing: tokenizing megabytes would stall every request
        of this stage's batch."""
        if form == "prompt":
            if not isinstance(value, str):
                raise InvalidRequestError("prompt must be a string", param="prompt")
            chars = len(value)
        else:
            chars = _chat_chars(value)
        limit = self.tokenizer.max_chars(self.engine.max_model_len)
        if chars > limit:
            raise InvalidRequestError(
                f"{form} has {chars} characters: more than this model's context of "
                f"{self.engine.max_model_len} tokens can hold (at most {limit} characters)",
                param=form,
            )
        if form == "prompt":
            check_text(value, "prompt")
            return self.tokenizer.encode(value)
        return self.tokenizer.encode_chat(value)

    # -- output ----------------------------------------------------------------------------
    def _emission(self, live: _Live, outs: list) -> Emission | None:
        chunk_tokens: list[int] = []
        text_delta = ""
        hidden = None
        for out in outs:
            i = out.index
            live.num_prompt_tokens = out.num_prompt_tokens
            live.num_cached_tokens = max(live.num_cached_tokens, out.num_cached_tokens or 0)
            if out.finished:
                live.engine_finished[i] = True
            if live.finish_reasons[i] is not None:
                continue  # cut by a stop string earlier; the engine's late tokens are dropped
            new_ids = list(out.new_token_ids)
            live.tokens[i].extend(new_ids)
            if live.logprobs_wanted and out.new_logprobs:
                live.logprobs[i].extend(_logprob_entries(new_ids, out.new_logprobs, live.logprobs_top))
            if live.texts is not None:
                delta = live.texts[i].push(new_ids)
                text = delta.text
                if not delta.stopped and out.finished:
                    delta = live.texts[i].finish()
                    text += delta.text
                if delta.stopped:
                    live.finish_reasons[i] = "stop"
                if i == 0:
                    text_delta += text
            if out.finished and live.finish_reasons[i] is None:
                live.finish_reasons[i] = out.finish_reason or "stop"
            if i == 0:
                chunk_tokens.extend(new_ids)
                if out.hidden_states:
                    hidden = self._stack_hidden(out.hidden_states)

        outputs: dict[str, Any] = {}
        finished = live.done
        if chunk_tokens or finished:
            outputs["tokens"] = chunk_tokens
        if live.texts is not None and (text_delta or finished):
            outputs["text"] = text_delta
        if hidden is not None:
            outputs["hidden_states"] = hidden
        if finished:
            if not all(live.engine_finished):
                self.engine.abort_request(live.request_id)  # stop strings ended it early
            outputs["info"] = self._info(live)
            del self._live[live.request_id]
        if not outputs:
            return None
        return Emission(live.request_id, outputs=outputs, finished=finished)

    def _stack_hidden(self, states: dict[int, torch.Tensor]) -> torch.Tensor:
        layers = [states[k] for k in self.hidden_state_layers if k in states] or list(states.values())
        return layers[0] if len(layers) == 1 else torch.stack(layers, dim=1)

    def _info(self, live: _Live) -> dict[str, Any]:
        info: dict[str, Any] = {
            "finish_reason": live.finish_reasons[0],
            "usage": {
                "prompt_tokens": live.num_prompt_tokens,
                "completion_tokens": sum(len(t) for t in live.tokens),
                "cached_tokens": live.num_cached_tokens,
            },
        }
        if live.logprobs_wanted:
            info["logprobs"] = live.logprobs[0]
        if live.n > 1:
            info["choices"] = [
                {
                    "index": i,
                    "text": live.texts[i].text if live.texts is not None else None,
                    "tokens": live.tokens[i],
                    "finish_reason": live.finish_reasons[i],
                    **({"logprobs": live.logprobs[i]} if live.logprobs_wanted else {}),
                }
                for i in range(live.n)
            ]
        return info


def _logprob_entries(new_ids: list[int], new_logprobs: list[dict[int, float]], top_k: int) -> list[dict[str, Any]]:
    """One {token, logprob, top_logprobs} per new token. The engine's table holds the sampled
    token beside the top k; top_logprobs lists the top k only (as OpenAI's chat API does), the
    sampled token's own logprob is in "logprob"."""
    entries = []
    for token, table in zip(new_ids, new_logprobs):
        top = sorted(table.items(), key=lambda kv: -kv[1])[:top_k]
        entries.append(
            {
                "token": int(token),
                "logprob": float(table.get(token, float("nan"))),
                "top_logprobs": [{"token": int(t), "logprob": float(lp)} for t, lp in top],
            }
        )
    return entries


def _chat_chars(messages: Any) -> int:
    """Characters of the messages' text content (a cheap pass; validate_messages checks them)."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


def _parse_bytes(value: int | str) -> int:
    if isinstance(value, int):
        return value
    from omnistage.stages.contracts import memory_bytes

    return memory_bytes(value)
