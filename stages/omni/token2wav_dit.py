"""The token2wav DiT's forward with its weights packed for few ops per layer.

transformers' `Qwen2_5OmniToken2WavDiTModel` computes, per layer and ODE evaluation, three
separate q / k / v projections, an AdaLN linear on a time embedding repeated for every row, a
mask from block differences, and a dozen element-wise ops around LayerNorm, RoPE and the gated
residuals. Here, per evaluation:

- the AdaLN vectors of every layer (and the final norm) come from one matrix-vector product on
  the time embedding: the ODE time is the same for every row, so they are [D] vectors;
- the input projection's conditioning part (speaker, codes, x-vector) is computed once per
  solve, so each evaluation projects only the noisy mel, once for both guidance halves;
- a layer is: norm (gated residual + LayerNorm + modulation), fused q|k|v linear, block-local
  attention, output linear, norm, linear, GELU, linear;
- the windows of a batch lie end to end as rows [frames, D], with no padding: only attention
  mixes frames, and it runs within each window. Without the kernels the attention scatters the
  windows into a padded batch for the eager block attention.

With the fused CPU kernels a thin DiT's layer is three calls (kernels/csrc/token2wav_dit_layer.cpp:
norm and q|k|v projection; token2wav_fused.cpp: the attention, RoPE included; then output
projection, norm and GELU MLP); a wide one keeps MKL's GEMMs with the norm, attention and
GELU as one call each; without the kernels (no compiler, or a GPU) the same steps run as eager
torch ops. Both agree with transformers' module to float32 rounding
(tests/omni/test_token2wav_kernels.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from types import ModuleType

import torch
import torch.nn.functional as F

from omnistage.kernels import cpu_fused
from omnistage.stages.omni.token2wav_attention import BlockLayout, block_attention, block_layout

NORM_EPS = 1e-6  # the DiT's LayerNorms (AdaLayerNormZero, ff_norm, the final norm)
ROPE_HEADS = 1  # the checkpoint applies RoPE to the first head only
FUSED_MAX_HIDDEN = 128  # widest DiT whose layer weights stay in cache for the fused layer kernels


@dataclass(frozen=True)
class FusedLayerWeights:
    """A layer's GEMM weights transposed ([in, out]) for the fused layer kernels."""

    qkv_t: torch.Tensor
    out_t: torch.Tensor
    ff_in_t: torch.Tensor
    ff_out_t: torch.Tensor


@dataclass(frozen=True)
class PackedLayer:
    qkv_weight: torch.Tensor  # [3 * inner, D]: to_q, to_k, to_v stacked
    qkv_bias: torch.Tensor
    out_weight: torch.Tensor
    out_bias: torch.Tensor
    ff_in_weight: torch.Tensor
    ff_in_bias: torch.Tensor
    ff_out_weight: torch.Tensor
    ff_out_bias: torch.Tensor
    back: int  # key blocks before a query's own
    ahead: int  # key blocks after it
    fused: FusedLayerWeights | None = None  # set where the fused layer kernels run


@dataclass(frozen=True)
class Modulation:
    """One ODE time's AdaLN vectors [D] (shared by every row)."""

    layers: list[tuple[torch.Tensor, ...]]  # shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
    final_scale: torch.Tensor
    final_shift: torch.Tensor


@dataclass(frozen=True)
class PaddedView:
    """The segments as a padded [segments, longest] batch, for the eager block attention."""

    segment: torch.Tensor  # [rows] int64: each row's segment
    position: torch.Tensor  # [rows] int64: its position there
    longest: int
    layouts: dict[tuple[int, int], BlockLayout]


@dataclass
class SolveInputs:
    """What stays fixed along one ODE solve of a batch of windows laid end to end.

    Rows are frames: the windows' frames one after another ([frames] = sum of their lengths),
    then, with guidance, the same again for the unconditioned half. Every op but attention is
    per row; attention runs per segment (one window of one half)."""

    conditioning: torch.Tensor  # [rows, D]: input projection of all but the noisy mel, bias included
    cos: torch.Tensor  # [longest, head_dim]: by position within a window
    sin: torch.Tensor
    starts: torch.Tensor  # [segments] int64 (CPU): each segment's first row
    lengths: torch.Tensor  # [segments] int64 (CPU): its frames
    padded: PaddedView | None  # eager attention only
    guided: bool


class PackedDiT:
    def __init__(self, dit, device: torch.device):
        self.dit = dit
        cfg = dit.config
        self.hidden = int(cfg.hidden_size)
        self.heads = int(cfg.num_attention_heads)
        self.head_dim = int(cfg.head_dim)
        self.mel_dim = int(cfg.mel_dim)
        self.block = int(cfg.block_size)
        self.kernels: ModuleType | None = cpu_fused.load() if device.type == "cpu" else None
        blocks = dit.transformer_blocks
        self.layers = [
            PackedLayer(
                qkv_weight=torch.cat([b.attn.to_q.weight, b.attn.to_k.weight, b.attn.to_v.weight]).detach(),
                qkv_bias=torch.cat([b.attn.to_q.bias, b.attn.to_k.bias, b.attn.to_v.bias]).detach(),
                out_weight=b.attn.to_out[0].weight.detach(),
                out_bias=b.attn.to_out[0].bias.detach(),
                ff_in_weight=b.ff.ff[0].weight.detach(),
                ff_in_bias=b.ff.ff[0].bias.detach(),
                ff_out_weight=b.ff.ff[3].weight.detach(),
                ff_out_bias=b.ff.ff[3].bias.detach(),
                back=int(b.look_backward_block),
                ahead=int(b.look_ahead_block),
            )
            for b in blocks
        ]
        if self._fused_layers(cfg):
            self.layers = [replace(layer, fused=_transposed(layer)) for layer in self.layers]
        adaln = [b.attn_norm.linear for b in blocks] + [dit.norm_out.linear]
        self.adaln_weight = torch.cat([m.weight for m in adaln]).detach()
        self.adaln_bias = torch.cat([m.bias for m in adaln]).detach()
        proj = dit.input_embed.proj
        self.mel_weight = proj.weight[:, : self.mel_dim].detach().contiguous()
        self.cond_weight = proj.weight[:, self.mel_dim :].detach().contiguous()
        self.proj_bias = proj.bias.detach()

    def _fused_layers(self, cfg) -> bool:
        """The fused layer kernels serve thin DiTs (the tiny checkpoints): their weights stay in
        cache across a tile of rows. Wide ones (the real 1024-wide DiT) keep MKL's GEMMs."""
        widths = (self.hidden, self.heads * self.head_dim, self.hidden * int(cfg.ff_mult))
        return self.kernels is not None and self.hidden <= FUSED_MAX_HIDDEN and all(w % 16 == 0 for w in widths)

    # -- per solve ----------------------------------------------------------------------
    def prepare(self, cond: dict[str, torch.Tensor], lengths: list[int], guided: bool) -> SolveInputs:
        """cond: per-row inputs fixed along the ODE ([rows, *]: spk_vec, code_embed, speaker),
        rows laid out as SolveInputs describes; lengths: each window's frames."""
        features = torch.cat((cond["spk_vec"], cond["code_embed"], cond["speaker"]), dim=-1)
        conditioning = F.linear(features, self.cond_weight, self.proj_bias)
        device = conditioning.device
        longest = max(lengths)
        segment_lengths = lengths * (2 if guided else 1)
        starts = [0, *itertools.accumulate(segment_lengths[:-1])]
        cos, sin = self.dit.rotary_embed(conditioning, torch.arange(longest, device=device)[None, :])
        padded = None
        if self.kernels is None:
            layouts = {}
            for layer in self.layers:
                reach = (layer.back, layer.ahead)
                if reach not in layouts:
                    layouts[reach] = block_layout(segment_lengths, longest, self.block, *reach, device)
            segment = torch.repeat_interleave(torch.arange(len(segment_lengths)), torch.tensor(segment_lengths))
            position = torch.cat([torch.arange(n) for n in segment_lengths])
            padded = PaddedView(segment.to(device), position.to(device), longest, layouts)
        return SolveInputs(
            conditioning=conditioning,
            cos=cos[0].contiguous(),
            sin=sin[0].contiguous(),
            starts=torch.tensor(starts, dtype=torch.int64),
            lengths=torch.tensor(segment_lengths, dtype=torch.int64),
            padded=padded,
            guided=guided,
        )

    def modulation(self, t: torch.Tensor) -> Modulation:
        emb = self.dit.time_embed(t.reshape(1))  # [1, D]
        vec = F.linear(F.silu(emb), self.adaln_weight, self.adaln_bias)[0]
        d = self.hidden
        layers = [tuple(vec[(6 * i + j) * d : (6 * i + j + 1) * d] for j in range(6)) for i in range(len(self.layers))]
        tail = vec[6 * len(self.layers) * d :]
        return Modulation(layers, final_scale=tail[:d], final_shift=tail[d:])

    # -- per evaluation -----------------------------------------------------------------
    def forward(self, x: torch.Tensor, t: torch.Tensor, inputs: SolveInputs) -> torch.Tensor:
        """The DiT's output [rows, mel_dim] for the noisy mel x [frames, mel_dim] at time t."""
        mod = self.modulation(t)
        mel = F.linear(x, self.mel_weight)
        h = inputs.conditioning.clone()
        h.view(2 if inputs.guided else 1, *mel.shape).add_(mel)
        residual, gate = None, None
        for layer, vectors in zip(self.layers, mod.layers):
            step = self._fused_layer if layer.fused is not None and self.kernels is not None else self._layer
            residual, gate = step(layer, vectors, h, residual, gate, inputs)
        norm = self._norm(h, residual, gate, mod.final_scale, mod.final_shift)
        return self.dit.proj_out(norm)

    def _layer(self, layer: PackedLayer, vectors, h, residual, gate, inputs: SolveInputs):
        """One layer: h takes the previous layer's gated residual (in place); returns this
        layer's MLP output and its gate, which the next layer (or the final norm) adds."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = vectors
        norm = self._norm(h, residual, gate, scale_msa, shift_msa)
        qkv = F.linear(norm, layer.qkv_weight, layer.qkv_bias)
        residual = F.linear(self._attention(qkv, inputs, layer), layer.out_weight, layer.out_bias)
        norm = self._norm(h, residual, gate_msa, scale_mlp, shift_mlp)
        inner = self._gelu_(F.linear(norm, layer.ff_in_weight, layer.ff_in_bias))
        return F.linear(inner, layer.ff_out_weight, layer.ff_out_bias), gate_mlp

    def _fused_layer(self, layer: PackedLayer, vectors, h, residual, gate, inputs: SolveInputs):
        """_layer as two fused kernels around the attention."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = vectors
        w, k = layer.fused, self.kernels
        qkv = k.dit_attn_in(h, residual, gate, scale_msa, shift_msa, NORM_EPS, w.qkv_t, layer.qkv_bias)
        attention = self._attention(qkv, inputs, layer)
        out = k.dit_attn_out_ff(
            h, attention, w.out_t, layer.out_bias, gate_msa, scale_mlp, shift_mlp, NORM_EPS,
            w.ff_in_t, layer.ff_in_bias, w.ff_out_t, layer.ff_out_bias,
        )  # fmt: skip
        return out, gate_mlp

    def _norm(self, h, residual, gate, scale, shift) -> torch.Tensor:
        """h += gate * residual (in place, when given); LayerNorm(h) * (1 + scale) + shift."""
        if self.kernels is not None:
            return self.kernels.dit_norm(h, residual, gate, scale.contiguous(), shift.contiguous(), NORM_EPS)
        if residual is not None:
            h.add_(gate * residual)
        return F.layer_norm(h, (self.hidden,), eps=NORM_EPS) * (1 + scale) + shift

    def _gelu_(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            self.kernels.gelu_tanh_(x)
            return x
        return F.gelu(x, approximate="tanh")

    def _attention(self, qkv: torch.Tensor, inputs: SolveInputs, layer: PackedLayer) -> torch.Tensor:
        """[rows, 3 * inner] -> [rows, inner]"""
        if self.kernels is not None:
            layout = (self.heads, self.block, layer.back, layer.ahead, ROPE_HEADS)
            return self.kernels.dit_block_attention(qkv, inputs.cos, inputs.sin, inputs.starts, inputs.lengths, *layout)
        view = inputs.padded
        grid = qkv.new_zeros(len(inputs.lengths), view.longest, qkv.shape[-1])
        grid[view.segment, view.position] = qkv
        q, k, v = grid.view(*grid.shape[:2], 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = _rope_first_heads(q, inputs.cos, inputs.sin), _rope_first_heads(k, inputs.cos, inputs.sin)
        out, _ = block_attention(None, q, k, v, view.layouts[(layer.back, layer.ahead)])
        return out[view.segment, view.position].reshape(-1, self.heads * self.head_dim)


def _transposed(layer: PackedLayer) -> FusedLayerWeights:
    return FusedLayerWeights(
        *(w.t().contiguous() for w in (layer.qkv_weight, layer.out_weight, layer.ff_in_weight, layer.ff_out_weight))
    )


def _rope_first_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The checkpoint's RoPE on the first ROPE_HEADS heads of x [rows, heads, L, d], as transformers
    applies it: de-interleave the head's dims, then rotate-half."""
    first = x[:, :ROPE_HEADS]
    first = torch.cat((first[..., 0::2], first[..., 1::2]), dim=-1)
    half = first.shape[-1] // 2
    rotated = torch.cat((-first[..., half:], first[..., :half]), dim=-1)
    return torch.cat((first * cos + rotated * sin, x[:, ROPE_HEADS:]), dim=1)
