"""Configuration dataclasses of the AR engine: sampling, engine, and the decoder's model config."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from omnistage.stages.params import MAX_SEED, MIN_SEED, Param, ParamSet


def _min_tokens_le_max(values: dict[str, Any]) -> tuple[str, str] | None:
    if values["min_tokens"] > values["max_tokens"]:
        return "min_tokens", f"min_tokens must be <= max_tokens ({values['max_tokens']}), got {values['min_tokens']}"
    return None


SAMPLING_PARAMS = ParamSet(
    "sampling",
    (
        Param("temperature", "number", 1.0, "Softmax temperature; 0 = greedy.", minimum=0),
        Param("top_k", "integer", 0, "Keep the k most likely tokens; 0 or -1 = off.", minimum=-1),
        Param("top_p", "number", 1.0, "Nucleus sampling mass.", minimum=0, maximum=1, exclusive_minimum=True),
        Param("min_p", "number", 0.0, "Drop tokens below min_p x the top probability.", minimum=0, maximum=1),
        Param(
            "repetition_penalty",
            "number",
            1.0,
            "Divide logits of seen tokens (HF rule).",
            minimum=0,
            exclusive_minimum=True,
        ),
        Param("presence_penalty", "number", 0.0, "Subtract once per generated token seen.", minimum=-2, maximum=2),
        Param("frequency_penalty", "number", 0.0, "Subtract per occurrence in the output.", minimum=-2, maximum=2),
        Param(
            "seed",
            "integer",
            None,
            "Seed of this request's own generator (sequence i uses seed + i).",
            minimum=MIN_SEED,
            maximum=MAX_SEED,
            nullable=True,
        ),
        Param("max_tokens", "integer", 16, "Most tokens to generate.", minimum=1),
        Param("min_tokens", "integer", 0, "EOS and stop tokens are ignored before this many.", minimum=0),
        Param("stop_token_ids", "integer_list", [], "Token ids that end a sequence.", minimum=0),
        Param("ignore_eos", "boolean", False, "Keep generating past EOS."),
        Param("n", "integer", 1, "Sequences per request (they share the prompt's KV blocks).", minimum=1),
        Param(
            "logprobs",
            "integer",
            None,
            "Report this many top logprobs per token (and the sampled one's).",
            minimum=0,
            maximum=20,
            nullable=True,
        ),
    ),
    rules=(_min_tokens_le_max,),
)


@dataclass
class SamplingParams:
    """Per-request sampling options (declared in SAMPLING_PARAMS). temperature == 0 means greedy.

    An instance is checked once, when it is built; `from_dict` checks a request's dict."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top-k count; the sampled token's logprob is always reported when set

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        SAMPLING_PARAMS.check_values(self.__dict__)
        self.stop_token_ids = list(self.stop_token_ids)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Checked against SAMPLING_PARAMS (unknown keys included) once, then built."""
        return cls.from_checked(SAMPLING_PARAMS.validate(d))

    @classmethod
    def from_checked(cls, values: dict[str, Any]) -> SamplingParams:
        """An instance from values SAMPLING_PARAMS already validated (no second check)."""
        obj = cls.__new__(cls)
        obj.__dict__.update(values)
        obj.stop_token_ids = list(obj.stop_token_ids)
        return obj

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class EngineConfig:
    """How one LLMEngine is built.

    model_path: a Hugging Face directory (config.json + safetensors).
    weight_prefix: prefix of the decoder's parameter names inside a nested checkpoint, e.g.
        "thinker." for the Qwen2.5-Omni thinker ("thinker.model.layers.0..." / "thinker.lm_head").
    hf_config_key: dotted path to the text config inside config.json (e.g.
        "thinker_config.text_config"); guessed from weight_prefix when None.
    num_kv_blocks / kv_cache_bytes: pool size (block count wins); default: enough blocks for
        max_num_seqs sequences of max_model_len tokens, capped at 1 GiB.
    hidden_state_layers: HF-style hidden-state indices to emit per processed token
        (0 = input embeddings, i = output of decoder layer i, num_layers (or -1) = after final norm).
    """

    model_path: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    hidden_state_layers: tuple[int, ...] = ()
    weight_prefix: str = ""
    hf_config_key: str | None = None
    eos_token_ids: tuple[int, ...] | None = None  # None: read from generation_config.json / config.json
    show_progress: bool | None = None  # None: tqdm only for loads over 256 MB
    # Contiguous copy of the decoding sequences' K/V kept across steps (saves a gather per layer
    # per step); 0 disables it. Above the cap, decode attention gathers from the paged cache.
    decode_buffer_bytes: int = 1 << 30
    # Decode-only steps replay CUDA graphs on CUDA with the Triton kernels (decode_graphs.py)
    # unless enforce_eager; batches above cuda_graph_max_batch sequences run eagerly.
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            self.dtype = getattr(torch, self.dtype)
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.cuda_graph_max_batch < 1:
            raise ValueError("cuda_graph_max_batch must be >= 1")
        self.hidden_state_layers = tuple(int(i) for i in self.hidden_state_layers)


@dataclass
class ModelConfig:
    """The decoder's architecture, read from a Hugging Face config.json."""

    architecture: str  # "qwen2" | "qwen3" | "qwen2_5_omni_text"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    mrope_section: tuple[int, ...] | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Qwen2.5-Omni talker: token / prompt embeddings live in a wider space (the thinker's) and
    # pass through `input_projection` (a biased Linear, HF name) before the first layer; the
    # LM head is called `lm_head_name`.
    embedding_size: int = 0  # 0: hidden_size
    input_projection: str | None = None
    lm_head_name: str = "lm_head"

    def __post_init__(self) -> None:
        if not self.embedding_size:
            self.embedding_size = self.hidden_size

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], tie_default: bool | None = None) -> ModelConfig:
        model_type = cfg.get("model_type", "qwen2")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        mrope = rope.get("mrope_section")
        if rope_type not in ("default", "mrope", None) and mrope is None:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if model_type.startswith("qwen3"):
            arch, qkv_bias, qk_norm = "qwen3", bool(cfg.get("attention_bias", False)), True
        else:
            arch, qkv_bias, qk_norm = ("qwen2_5_omni_text" if mrope else "qwen2"), True, False
            if model_type == "qwen2_5_omni_talker":
                arch = "qwen2_5_omni_talker"
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        tie = cfg.get("tie_word_embeddings")
        if tie is None:
            tie = bool(tie_default)
        talker = model_type == "qwen2_5_omni_talker"
        return cls(
            embedding_size=cfg.get("embedding_size") or cfg["hidden_size"],
            input_projection="thinker_to_talker_proj" if talker else None,
            lm_head_name="codec_head" if talker else "lm_head",
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(tie),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            mrope_section=tuple(mrope) if mrope else None,
            eos_token_ids=eos_ids,
        )

    @property
    def uses_mrope(self) -> bool:
        return self.mrope_section is not None


def _dig(d: dict[str, Any], dotted: str) -> dict[str, Any]:
    for key in dotted.split("."):
        d = d[key]
    return d


def load_model_config(model_path: str, hf_config_key: str | None = None, weight_prefix: str = "") -> ModelConfig:
    """Read config.json (and generation_config.json's eos ids) from a checkpoint directory."""
    with open(os.path.join(model_path, "config.json")) as f:
        raw = json.load(f)
    key = hf_config_key
    if key is None and weight_prefix.startswith("thinker") and "thinker_config" in raw:
        key = "thinker_config.text_config"
    if key is None and weight_prefix.startswith("talker") and "talker_config" in raw:
        key = "talker_config"
    sub = _dig(raw, key) if key else raw
    if key is None and "text_config" in raw and "hidden_size" not in raw:
        key, sub = "text_config", raw["text_config"]
    # Whether the LM head is tied is decided by the config of the model that owns the head:
    # for a nested text_config (a thinker's), that is its parent, as in transformers.
    owner = (
        _dig(raw, key.rsplit(".", 1)[0])
        if key and key.endswith("text_config") and "." in key
        else (raw if key == "text_config" else sub)
    )
    tie = owner.get("tie_word_embeddings", sub.get("tie_word_embeddings"))
    cfg = ModelConfig.from_hf_dict({**sub, "tie_word_embeddings": tie})
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.exists(gen_path) and not key:
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        if isinstance(eos, int):
            cfg.eos_token_ids = (eos,)
        elif isinstance(eos, list):
            cfg.eos_token_ids = tuple(eos)
    return cfg
