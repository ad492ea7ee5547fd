"""Decoder-only transformer for the Qwen2 / Qwen2.5 / Qwen3 families (and the Qwen2.5-Omni
thinker text model with M-RoPE), written for a flattened token batch over a paged KV cache.

Parameters keep Hugging Face names except two fusions: q/k/v -> qkv_proj and gate/up ->
gate_up_proj (one matmul each); `load_weight` maps HF names onto them.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels import cpu_fused
from omnistage.kernels import triton as triton_kernels
from omnistage.stages.ar import cpu_matmul
from omnistage.stages.ar.attention import AttentionMetadata, paged_attention
from omnistage.stages.ar.config import ModelConfig


class _Module(nn.Module):
    """nn.Module called without the hook machinery: these modules never carry hooks, and
    Module.__call__ costs a few microseconds per call, and a forward makes dozens of calls."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class RMSNorm(_Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused: ModuleType | None = None  # kernels.cpu_fused, set by DecoderModel.finalize()

    def add_forward(self, y: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """y += residual in place; returns (y, norm(y)). One kernel with the fused CPU ops."""
        if self.fused is not None and y.dim() == 2:
            return y, self.fused.add_rms_norm_(y, residual, self.weight, self.eps)
        y = y.add_(residual)
        return y, self.forward(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dim() == 2:
            return self.fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if x.device.type == "cpu":
                # transformers' float32 arithmetic op for op (so bit-identical), two steps in
                # place: F.rms_norm's composite CPU kernel makes more full-size temporaries,
                # each a fresh mapping to fault in
                inv_rms = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
                return torch.mul(x, inv_rms).mul_(self.weight)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # bit-identical in float32
        # transformers' order: normalize in float32, cast back, then scale (matters in bf16).
        dtype = x.dtype
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * xf.to(dtype)


class Linear(_Module):
    """nn.Linear with the HF weight layout [out, in] for loading; `finalize()` swaps in a
    pre-transposed [in, out] copy, which CPU GEMMs run faster on (and which
    cpu_matmul splits by columns across threads)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight_t: torch.Tensor | None = None

    def finalize(self) -> None:
        if self.weight.device.type == "cpu":
            self.weight_t = self.weight.detach().t().contiguous()
            self.weight = None  # type: ignore[assignment]  (only the transposed copy is kept)

    def forward_cols(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Output features [start, end) only."""
        bias = None if self.bias is None else self.bias[start:end]
        if self.weight_t is None:
            return F.linear(x, self.weight[start:end], bias)
        return cpu_matmul.matmul(x, self.weight_t[:, start:end], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is None:
            return F.linear(x, self.weight, self.bias)
        return cpu_matmul.matmul(x, self.weight_t, self.bias)

    def forward_halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output's two column halves (gate | up), without joining them when the CPU
        column split makes exactly those two slabs."""
        if self.weight_t is not None and cpu_matmul.slabs_for(x, self.weight_t) == 2:
            parts = cpu_matmul.matmul_slabs(x, self.weight_t, 2, self.bias)
            return parts[0], parts[1]
        y = self.forward(x)
        return y.split(y.shape[-1] // 2, dim=-1)


class RotaryEmbedding(_Module):
    """cos/sin for 1-D positions [N] or M-RoPE positions [3, N], looked up in a cached table."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...] | None):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.mrope_section = list(mrope_section) if mrope_section else None
        self._cos = self._sin = None
        self._dtype = None
        self._axis: torch.Tensor | None = None
        # M-RoPE: which of the 3 position axes drives each rotary dim (sections repeat for both halves).
        if self.mrope_section:
            axis = [i % 3 for i, s in enumerate(self.mrope_section) for _ in range(s)]
            self._axis_list = axis + axis  # plain list: modules are built on the meta device

    def _axis_index(self, device) -> torch.Tensor:
        """[1, head_dim, 1] M-RoPE axis of each rotary dim, kept per device (no copy per step)."""
        if self._axis is None or self._axis.device != device:
            self._axis = torch.tensor(self._axis_list, device=device).view(1, -1, 1)
        return self._axis

    def inv_freq(self, device) -> torch.Tensor:
        d = self.head_dim
        return 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d))

    def _table(self, max_pos: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] <= max_pos or self._dtype != dtype or self._cos.device != device:
            size = max(2 * max_pos, 4096) if self._cos is None or self._cos.shape[0] <= max_pos else self._cos.shape[0]
            pos = torch.arange(size, dtype=torch.float, device=device)
            freqs = pos.unsqueeze(1) * self.inv_freq(device)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin, self._dtype = emb.cos().to(dtype), emb.sin().to(dtype), dtype
        return self._cos, self._sin

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """max_position: a known bound on the positions, read instead of positions.max() (a
        host sync, which a CUDA graph capture forbids)."""
        bound = int(positions.max()) if max_position is None else max_position
        cos_t, sin_t = self._table(bound, dtype, positions.device)
        if positions.dim() == 1:
            return cos_t[positions], sin_t[positions]
        if self.mrope_section is None:
            return cos_t[positions[0]], sin_t[positions[0]]
        n = positions.shape[1]
        idx = self._axis_index(positions.device).expand(n, -1, 1)
        cos = cos_t[positions].permute(1, 2, 0).gather(2, idx).squeeze(-1)
        sin = sin_t[positions].permute(1, 2, 0).gather(2, idx).squeeze(-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d]; cos/sin [N, d] (rotate-half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[-sin | sin] by halves: rotate_half(x) * sin == roll(x, half) * signed_sin(sin), exactly."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """apply_rotary in place (x may be a strided view, e.g. the q|k columns of the fused qkv
    output): four kernels instead of six, the same bits."""
    rolled = x.roll(x.shape[-1] // 2, dims=-1).mul_(sin_signed.unsqueeze(1))
    return x.mul_(cos.unsqueeze(1)).add_(rolled)


class Attention(_Module):
    paged_attention = staticmethod(paged_attention)  # DecoderModel.finalize() may swap in the Triton one

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.fused: ModuleType | None = None  # kernels.cpu_fused, set by DecoderModel.finalize()

    def forward(
        self,
        x,
        cos,
        sin,
        kv_cache,
        meta: AttentionMetadata,
        out_rows: torch.Tensor | None = None,
        sin_signed: torch.Tensor | None = None,
    ):
        """out_rows: compute queries (and return outputs) for these rows only; K/V for all rows."""
        n = x.shape[0]
        if out_rows is None and sin_signed is not None and (self.q_norm is None or self.fused is not None):
            # Common path: rotate q and k together (Qwen3: normalize them first), in place in
            # the fused qkv output, so K|V stay adjacent and go to the cache without a copy.
            qkv = self.qkv_proj(x)
            h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
            qk = qkv[:, : self.q_size + self.kv_size].view(n, h + kvh, d)
            if self.q_norm is not None:
                self.fused.qk_norm_rope_(
                    qk, h, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin_signed
                )
            elif self.fused is not None:
                self.fused.rope_(qk, cos, sin_signed)
            else:
                apply_rotary_(qk, cos, sin_signed)
            q = qkv[:, : self.q_size].view(n, h, d)
            kv = qkv[:, self.q_size :].view(n, 2 * kvh, d)
            o = self.paged_attention(q, kv[:, :kvh], kv[:, kvh:], kv_cache, meta, self.scale, self.layer_index, kv=kv)
            return self.o_proj(o)
        if out_rows is None:
            qkv = self.qkv_proj(x)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q = self.qkv_proj.forward_cols(x[out_rows], 0, self.q_size)
            k, v = self.qkv_proj.forward_cols(x, self.q_size, self.q_size + 2 * self.kv_size).split(
                self.kv_size, dim=-1
            )
            cos_q, sin_q = cos[out_rows], sin[out_rows]
        nq = q.shape[0]
        q = q.reshape(nq, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin) if out_rows is None else apply_rotary(q, cos_q, sin_q)
        k = apply_rotary(k, cos, sin)
        o = self.paged_attention(q, k, v, kv_cache, meta, self.scale, self.layer_index, out_only=out_rows is not None)
        return self.o_proj(o)


class MLP(_Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused: ModuleType | None = None  # kernels.cpu_fused, set by DecoderModel.finalize()

    def forward(self, x):
        gate, up = self.gate_up_proj.forward_halves(x)
        if self.fused is not None and gate.dim() == 2:
            return self.down_proj(self.fused.silu_mul(gate, up))
        return self.down_proj(F.silu(gate).mul_(up))  # in place: half the memory traffic


class DecoderLayer(_Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_index)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x, cos, sin, kv_cache, meta, out_rows: torch.Tensor | None = None, sin_signed: torch.Tensor | None = None
    ):
        """out_rows: only these rows leave the layer (the rest only write their K/V)."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, out_rows, sin_signed)
        # Residual adds in place into the fresh projection outputs (a + b == b + a bit for bit);
        # x itself may be held as a captured hidden state.
        x, h = self.post_attention_layernorm.add_forward(attn, x if out_rows is None else x[out_rows])
        return self.mlp(h).add_(x)


class DecoderModel(_Module):
    """Embeddings + decoder stack + final norm + LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # no random init: the checkpoint fills it, and a random fill on the meta device would
        # import torch._dynamo (seconds of every worker's start)
        shape = (cfg.vocab_size, cfg.embedding_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.input_proj = Linear(cfg.embedding_size, cfg.hidden_size, bias=True) if cfg.input_projection else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

        self._lm_head_t: torch.Tensor | None = None
        self._logits_workspace = cpu_matmul.Workspace()

    def finalize(self) -> None:
        """Called once the weights are loaded: switch linears to their inference layout and,
        for float32 on CPU, norms, RoPE and SiLU-and-multiply to the fused kernels when they
        are available (kernels.cpu_fused)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.finalize()
        w = self.embed_tokens.weight
        fused = cpu_fused.load() if w.device.type == "cpu" and w.dtype == torch.float32 else None
        triton_attention = None
        if triton_kernels.selected(w.device):  # on CUDA by default; OMNISTAGE_TRITON=0 keeps torch
            from omnistage.kernels.triton import engine_ops

            fused, triton_attention = engine_ops.OPS, engine_ops.paged_attention
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.fused = fused  # (Qwen3's q/k norms see [tokens, heads, d]: RMSNorm keeps those eager)
            if triton_attention is not None and isinstance(m, Attention):
                m.paged_attention = triton_attention
        if self.embed_tokens.weight.device.type == "cpu":
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self._lm_head_t = head.detach().t().contiguous()
            if self.lm_head is not None:
                self.lm_head = None  # only the transposed copy is kept

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N] or [3, N]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        embeds: torch.Tensor | None = None,  # [M, hidden] rows replacing token embeddings
        embed_rows: torch.Tensor | None = None,  # [M] which rows of the batch they replace
        capture_layers: tuple[int, ...] = (),
        outputs_only: bool = False,
        extra: torch.Tensor | None = None,  # [K, embedding_size] added to rows extra_rows (before the projection)
        extra_rows: torch.Tensor | None = None,
        max_position: int | None = None,  # a bound on positions (else read from them: a host sync)
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns (final normed hidden states, {hidden-state index: [N, hidden]}).

        outputs_only: the final hidden states are needed only for meta.out_rows (decode rows and
        the last row of each prompt-completing chunk); the last layer then runs its queries,
        output projection and MLP on those rows alone and the result has one row per out row.
        Not allowed when the final layer's hidden states are captured."""
        x = self.embed_tokens(input_ids)
        if embeds is not None:
            x[embed_rows] = embeds.to(x.dtype)
        if extra is not None:
            x[extra_rows] += extra.to(x.dtype)
        if self.input_proj is not None:
            x = self.input_proj(x)
        cos, sin = self.rotary(positions, x.dtype, max_position)
        sin_signed = signed_sin(sin)  # shared by every layer
        n_layers = len(self.layers)
        captured: dict[int, torch.Tensor] = {}
        if 0 in capture_layers:
            captured[0] = x
        if outputs_only and n_layers in capture_layers:
            raise ValueError("outputs_only cannot capture the final hidden states")
        for i, layer in enumerate(self.layers):
            last = outputs_only and i == n_layers - 1
            x = layer(x, cos, sin, kv_caches[i], meta, meta.out_rows if last else None, sin_signed)
            if i + 1 in capture_layers and i + 1 != n_layers:
                captured[i + 1] = x
        x = self.norm(x)
        if n_layers in capture_layers:
            captured[n_layers] = x
        return x, captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """On CPU the result is reused memory, valid until the next call."""
        if self._lm_head_t is not None:
            return cpu_matmul.matmul(hidden, self._lm_head_t, workspace=self._logits_workspace).float()
        return F.linear(hidden, self.lm_head_weight).float()

    # ---- weight loading by Hugging Face parameter name ----
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one HF-named tensor (relative to the decoder, e.g. "model.layers.0.mlp.up_proj.weight"
        or "lm_head.weight") into place. Returns False for names this model does not own."""
        head = self.config.lm_head_name + "."
        proj = (self.config.input_projection or "\0") + "."
        if name.startswith("model."):
            name = name[len("model.") :]
        elif name.startswith(head):
            if self.lm_head is None:
                return True  # tied: the embedding is the head
            name = "lm_head." + name[len(head) :]
        elif name.startswith(proj):
            name = "input_proj." + name[len(proj) :]
        else:
            return False
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self._FUSED:
            fused, shard = self._FUSED[parts[-2]]
            target_name = ".".join(parts[:-2] + [fused, parts[-1]])
            param = self.get_parameter(target_name)
            if fused == "qkv_proj":
                attn = self.layers[int(parts[1])].self_attn
                sizes = [attn.q_size, attn.kv_size, attn.kv_size]
            else:
                sizes = [self.config.intermediate_size] * 2
            offset = sum(sizes[:shard])
            dst = param.data.narrow(0, offset, sizes[shard])
        else:
            try:
                param = self.get_parameter(name)
            except AttributeError:
                return False
            dst = param.data
        if dst.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model {tuple(dst.shape)}")
        dst.copy_(tensor)
        return True

    def expected_weights(self) -> set[str]:
        """HF names that must be present in a checkpoint for this model."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not None:
            names.add(self.config.lm_head_name + ".weight")
        if self.input_proj is not None:
            names.update({self.config.input_projection + ".weight", self.config.input_projection + ".bias"})
        cfg = self.config
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            for proj in ("q_proj", "k_proj", "v_proj"):
                names.add(p + f"self_attn.{proj}.weight")
                if cfg.qkv_bias:
                    names.add(p + f"self_attn.{proj}.bias")
            names.add(p + "self_attn.o_proj.weight")
            if cfg.qk_norm:
                names.update({p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"})
            names.update(p + f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj"))
            names.update({p + "input_layernorm.weight", p + "post_attention_layernorm.weight"})
        return names
