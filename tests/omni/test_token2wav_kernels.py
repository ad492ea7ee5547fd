"""The token2wav kernels (kernels/csrc/token2wav_fused.cpp) and the packed DiT / BigVGAN
forwards against transformers' own modules, with the fused kernels and without them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2_5OmniDiTConfig
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf

from omnistage.kernels import cpu_fused
from omnistage.stages.omni.token2wav_dit import PackedDiT
from omnistage.stages.omni.token2wav_vocoder import PackedBigVGAN


@pytest.fixture(scope="module")
def ops():
    mod = cpu_fused.load()
    assert mod is not None, "the fused CPU kernels did not build on this machine"
    return mod


@pytest.mark.parametrize("rows,length,dim", [(2, 50, 32), (3, 7, 1024), (1, 1, 48)])
def test_dit_norm_is_gated_residual_then_modulated_layer_norm(ops, rows, length, dim):
    g = torch.Generator().manual_seed(dim)
    h = torch.randn(rows, length, dim, generator=g) * 3 + 1
    y = torch.randn(rows, length, dim, generator=g)
    gate, scale, shift = (torch.randn(dim, generator=g) for _ in range(3))
    norm = torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
    want_h = h + gate * y
    want = norm(want_h) * (1 + scale) + shift
    got = ops.dit_norm(h, y, gate, scale, shift, 1e-6)
    assert torch.equal(h, want_h)  # the residual sum rounds as the eager ops do
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.dit_norm(h, None, None, scale, shift, 1e-6), norm(h) * (1 + scale) + shift)


def test_gelu_tanh_matches_torch(ops):
    x = torch.cat([torch.linspace(-30, 30, 6001), torch.randn(1000) * 1e-3, torch.tensor([0.0, -0.0])])
    want = F.gelu(x, approximate="tanh")
    got = x.clone()
    ops.gelu_tanh_(got)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-7)
    assert torch.isfinite(got).all()


def test_block_attention_segments_are_independent_windows(ops):
    """Segments anywhere in qkv: each one's output is its own attention alone (positions from its
    first row), rows outside every segment are zeros, and a segment outside qkv is an error."""
    heads, dh, block = 2, 16, 24
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(120, 3 * heads * dh, generator=g)
    cos, sin = torch.randn(64, dh, generator=g), torch.randn(64, dh, generator=g)
    segments = [(70, 50), (3, 30), (40, 24)]
    starts, lengths = (torch.tensor(c, dtype=torch.int64) for c in zip(*segments))
    got = ops.dit_block_attention(qkv, cos, sin, starts, lengths, heads, block, 1, 1, 1)
    covered = torch.zeros(120, dtype=torch.bool)
    for start, n in segments:
        alone = ops.dit_block_attention(
            qkv[start : start + n].contiguous(), cos, sin, torch.tensor([0]), torch.tensor([n]), heads, block, 1, 1, 1
        )
        assert torch.equal(got[start : start + n], alone)
        covered[start : start + n] = True
    assert not got[~covered].any() and got[covered].abs().sum() > 0
    with pytest.raises(RuntimeError, match="outside qkv"):
        ops.dit_block_attention(qkv, cos, sin, torch.tensor([100]), torch.tensor([30]), heads, block, 0, 0, 1)
    with pytest.raises(RuntimeError, match="longer than the cos"):
        ops.dit_block_attention(qkv, cos, sin, torch.tensor([0]), torch.tensor([100]), heads, block, 0, 0, 1)


def _dit_config(heads: int, head_dim: int) -> Qwen2_5OmniDiTConfig:
    cfg = Qwen2_5OmniDiTConfig(
        hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim, num_hidden_layers=4,
        look_ahead_layers=[1, 3], look_backward_layers=[2, 3], ff_mult=2, emb_dim=16, enc_emb_dim=16, enc_dim=16,
        enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8, enc_se_channels=8, num_embeds=40,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return cfg


def _random_dit(cfg, seed: int):
    torch.manual_seed(seed)
    dit = hf.Qwen2_5OmniToken2WavDiTModel(cfg).eval()
    for sub in dit.modules():
        if sub is not dit and hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    return dit


@pytest.mark.parametrize("heads,head_dim", [(2, 16), (4, 8)])
@pytest.mark.parametrize("path", ["fused-layers", "kernels", "eager"])
def test_packed_dit_forward_equals_transformers_per_window(ops, heads, head_dim, path):
    """Windows of different lengths laid end to end in one guided batch: each window's DiT
    output equals transformers' forward of that window alone (its own length, a dense block
    mask)."""
    cfg = _dit_config(heads, head_dim)
    dit = _random_dit(cfg, seed=heads)
    packed = PackedDiT(dit, torch.device("cpu"))
    assert all(layer.fused is not None for layer in packed.layers)  # a thin DiT: fused layers by default
    if path != "fused-layers":  # the per-op kernels (wide DiTs), or none at all (no compiler, GPU)
        packed.layers = [replace(layer, fused=None) for layer in packed.layers]
    if path == "eager":
        packed.kernels = None
    g = torch.Generator().manual_seed(1)
    lengths = [72, 50, 24, 8]  # whole blocks, a partial last block, one block, less than one
    n, frames = len(lengths), sum(lengths)
    codes = [torch.randint(0, cfg.num_embeds, (length // cfg.repeats,), generator=g) for length in lengths]
    spk = torch.randn(n, cfg.enc_emb_dim, generator=g)
    ref_mel = torch.randn(n, 30, cfg.mel_dim, generator=g)
    x = torch.randn(frames, cfg.mel_dim, generator=g)
    t = torch.tensor(0.37)
    per_frame = torch.tensor(lengths)
    with torch.inference_mode():
        vec = dit.input_embed.spk_encoder(ref_mel)
        null_vec = dit.input_embed.spk_encoder(torch.zeros_like(ref_mel))
        code_ids = torch.cat(codes)[None]
        cond = {
            "code_embed": torch.cat([dit.text_embed(code_ids)[0], dit.text_embed(code_ids, drop_code=True)[0]]),
            "speaker": torch.cat([spk, torch.zeros_like(spk)]).repeat_interleave(per_frame.repeat(2), dim=0),
            "spk_vec": torch.cat([vec, null_vec]).repeat_interleave(per_frame.repeat(2), dim=0),
        }
        got = packed.forward(x, t, packed.prepare(cond, lengths, guided=True))
        assert got.shape == (2 * frames, cfg.mel_dim)
        start = 0
        for i, length in enumerate(lengths):
            want = dit(
                hidden_states=x[None, start : start + length],
                condition_vector=ref_mel[i : i + 1],
                speaker_embedding=spk[i : i + 1, None].expand(1, length, -1),
                quantized_code=codes[i][None],
                time_step=t,
            )  # [2, length, mel]: conditioned, unconditioned
            for half in (0, 1):
                row = half * frames + start
                torch.testing.assert_close(got[row : row + length], want[half], rtol=1e-4, atol=2e-5)
            start += length


def _snake_activation(channels: int, seed: int):
    torch.manual_seed(seed)
    act = hf.Qwen2_5OmniAntiAliasedActivation1d(activation=hf.Qwen2_5OmniSnakeBeta(channels))
    with torch.no_grad():
        act.act.alpha.normal_(0, 0.5)
        act.act.beta.normal_(0, 0.5)
    return act


@pytest.mark.parametrize("length", [1, 2, 5, 16, 37, 300])
def test_snake_antialias_equals_transformers_activation(ops, length):
    channels = 6
    act = _snake_activation(channels, seed=length)
    x = torch.randn(2, channels, length, generator=torch.Generator().manual_seed(length)) * 2
    packed = PackedBigVGAN(torch.nn.Sequential(act), torch.device("cpu"))
    with torch.inference_mode():
        want = act(x)
        got = packed._activation(act, x)
    assert got.shape == want.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cout", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("length", [1, 13, 64, 301])
def test_conv1d_narrow_equals_torch_conv(ops, cout, length):
    g = torch.Generator().manual_seed(cout * 1000 + length)
    cin = 2 if cout == 1 else cout
    for taps, dilation in ((11, 1), (7, 3), (3, 5)):
        x = torch.randn(2, cin, length, generator=g)
        w = torch.randn(cout, cin, taps, generator=g)
        b, res = torch.randn(cout, generator=g), torch.randn(2, cout, length, generator=g)
        padding = dilation * (taps - 1) // 2
        # against float64: up to 16 x 11 products of unit size, summed in another order than ATen's
        exact = F.conv1d(x.double(), w.double(), b.double(), padding=padding, dilation=dilation)
        got = ops.conv1d_narrow(x, w, b, dilation, res)
        torch.testing.assert_close(got.double(), res.double() + exact, rtol=0, atol=5e-5)
        got = ops.conv1d_narrow(x, w, None, dilation, None)
        torch.testing.assert_close(got.double(), exact - b.double()[:, None], rtol=0, atol=5e-5)


def test_conv1d_narrow_rejects_what_it_does_not_compute(ops):
    x = torch.randn(1, 3, 20)
    with pytest.raises(RuntimeError, match="output channels"):
        ops.conv1d_narrow(x, torch.randn(3, 3, 3), None, 1, None)
    with pytest.raises(RuntimeError, match="taps must be odd"):
        ops.conv1d_narrow(x, torch.randn(2, 3, 4), None, 1, None)
    with pytest.raises(RuntimeError, match="res must be"):
        ops.conv1d_narrow(x, torch.randn(2, 3, 3), None, 1, torch.randn(1, 2, 19))


def test_packed_bigvgan_equals_transformers(ops):
    from transformers import Qwen2_5OmniBigVGANConfig

    torch.manual_seed(3)
    net = hf.Qwen2_5OmniToken2WavBigVGANModel(Qwen2_5OmniBigVGANConfig(upsample_initial_channel=64)).eval()
    for sub in net.modules():
        if sub is not net and hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    mel = torch.randn(2, 80, 30, generator=torch.Generator().manual_seed(4))
    fused = PackedBigVGAN(net, torch.device("cpu"))
    assert len(fused.constants) == 6 * 3 * 6 + 1  # every anti-aliased activation runs fused
    assert len(fused.narrow) == 5 * 3 * 6 + 1  # the resblocks at 16..1 channels and conv_post
    with torch.inference_mode():
        want = torch.stack([net(mel[i : i + 1]) for i in range(2)])
        got = fused(mel)
    assert got.shape == want.shape
    assert want.abs().max() > 1e-2  # a waveform, not silence
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
