"""BigVGAN's forward with its anti-aliased Snake activations fused.

Each of BigVGAN's 109 activations is, in transformers, a replicate pad, a depthwise transposed
convolution (2x up), SnakeBeta, another pad and a depthwise convolution (2x down): a dozen ops
and two passes over a signal twice the layer's length, which were three quarters of the
vocoder's CPU time. With the fused CPU kernels (kernels/csrc/token2wav_fused.cpp) an activation
is one pass, and the convolutions of the last levels (2-16 channels over long signals) run as
`conv1d_narrow` with the residual add folded in; the wider ones stay ATen's. Without the
kernels (no compiler, or a GPU) the module's own activation and convolutions run. The walk over
the layers is transformers' forward, written out so these can be swapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from omnistage.kernels import cpu_fused


@dataclass(frozen=True)
class SnakeConstants:
    alpha_exp: torch.Tensor  # exp(alpha) [C]
    inv_beta: torch.Tensor  # 1 / (exp(beta) + 1e-9) [C]
    up_filter: torch.Tensor  # [K]
    down_filter: torch.Tensor  # [K]


class PackedBigVGAN:
    def __init__(self, bigvgan, device: torch.device):
        self.net = bigvgan
        self.kernels: ModuleType | None = cpu_fused.load() if device.type == "cpu" else None
        self.constants: dict[int, SnakeConstants] = {}
        self.narrow: set[int] = set()  # convolutions conv1d_narrow computes
        if self.kernels is not None:
            for module in bigvgan.modules():
                if hasattr(module, "upsample") and hasattr(module, "downsample") and hasattr(module, "act"):
                    if (constants := _snake_constants(module)) is not None:
                        self.constants[id(module)] = constants
                if isinstance(module, torch.nn.Conv1d) and _is_narrow(module):
                    self.narrow.add(id(module))

    def __call__(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [b, mel_dim, frames] -> waveform [b, frames * hop] (clamped to [-1, 1])."""
        net = self.net
        h = net.conv_pre(net.process_mel_spectrogram(mel))
        per_level = net.num_residual_blocks
        for level in range(net.num_upsample_layers):
            h = net.ups[level][0](h)
            blocks = net.resblocks[level * per_level : (level + 1) * per_level]
            total = None
            for block in blocks:
                out = self._amp_block(block, h)
                total = out if total is None else total + out
            h = total / per_level
        h = self._conv(net.conv_post, self._activation(net.activation_post, h))
        return torch.clamp(h, min=-1.0, max=1.0).reshape(mel.shape[0], -1)

    def _amp_block(self, block, h: torch.Tensor) -> torch.Tensor:
        acts = block.activations
        for conv1, conv2, act1, act2 in zip(block.convs1, block.convs2, acts[::2], acts[1::2]):
            inner = self._conv(conv1, self._activation(act1, h))
            h = self._conv(conv2, self._activation(act2, inner), residual=h)
        return h

    def _conv(self, conv, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """conv(h), plus residual when given."""
        if id(conv) in self.narrow:
            return self.kernels.conv1d_narrow(h, conv.weight, conv.bias, conv.dilation[0], residual)
        out = conv(h)
        return out if residual is None else residual + out

    def _activation(self, module, h: torch.Tensor) -> torch.Tensor:
        constants = self.constants.get(id(module))
        if constants is None:
            return module(h)
        return self.kernels.snake_antialias(
            h.contiguous(), constants.alpha_exp, constants.inv_beta, constants.up_filter, constants.down_filter
        )


def _is_narrow(conv: torch.nn.Conv1d) -> bool:
    """Whether conv1d_narrow computes this convolution: few output channels, stride 1, zero
    "same" padding (BigVGAN's last levels and its output convolution)."""
    (taps,), (dilation,) = conv.kernel_size, conv.dilation
    return (
        conv.out_channels in (1, 2, 4, 8, 16)
        and conv.groups == 1
        and conv.stride == (1,)
        and conv.padding_mode == "zeros"
        and taps % 2 == 1
        and conv.padding == (dilation * (taps - 1) // 2,)
        and conv.weight.dtype == torch.float32
    )


def _snake_constants(module) -> SnakeConstants | None:
    """The kernel's constants, or None where it does not apply (it handles 2x up / down
    sampling with even filters: the model's)."""
    up, down, snake = module.upsample, module.downsample, module.act
    if up.ratio != 2 or down.stride != 2 or up.filter.numel() % 2 or down.filter.numel() % 2:
        return None
    with torch.no_grad():
        beta = torch.exp(snake.beta.detach().float())
        return SnakeConstants(
            alpha_exp=torch.exp(snake.alpha.detach().float()).contiguous(),
            inv_beta=(1.0 / (beta + snake.no_div_by_zero)).contiguous(),
            up_filter=up.filter.detach().float().reshape(-1).contiguous(),
            down_filter=down.filter.detach().float().reshape(-1).contiguous(),
        )
