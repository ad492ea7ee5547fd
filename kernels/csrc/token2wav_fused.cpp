// Fused float32 CPU kernels for the Qwen2.5-Omni token2wav stage: the DiT's per-layer small ops
// and BigVGAN's anti-aliased Snake activation.
//
// Why: the DiT is thin (22 layers; 32 wide in the tiny checkpoints) and runs 36 times per
// window, so its LayerNorm, modulation, block attention and GELU are a few dozen ATen ops per
// layer whose dispatch and memory passes cost more than the arithmetic; BigVGAN's activation
// (replicate pad, a depthwise transposed conv, Snake, pad, a depthwise conv) is ~12 ops that
// were three quarters of the vocoder's time. Each function here is one pass instead.
// Products and sums are grouped as the eager ops group them; sums over a row (LayerNorm moments,
// attention scores, filter taps) run in another order, so results agree to float rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "t2w_simd.h"

using namespace t2w_simd;

namespace {

// The checkpoint's RoPE on one head's interleaved pairs (x[2i], x[2i+1]), written in the
// de-interleaved order transformers leaves them in: out[i * stride] and out[(i + half) * stride].
inline void rope_interleaved(const float* x, const float* c, const float* s, int64_t half, float* out,
                             int64_t stride) {
  for (int64_t i = 0; i < half; ++i) {
    out[i * stride] = x[2 * i] * c[i] - x[2 * i + 1] * s[i];
    out[(i + half) * stride] = x[2 * i + 1] * c[i + half] + x[2 * i] * s[i + half];
  }
}

}  // namespace

// DiT pre-norm with modulation, optionally after the gated residual of the previous sub-layer:
//   h += gate * y                      (when y is given; h updated in place)
//   out = LayerNorm(h) * (1 + scale) + shift
// h, y [..., D] contiguous; gate / scale / shift [D] (the step's modulation, the same for every row).
torch::Tensor dit_norm(torch::Tensor h, const c10::optional<torch::Tensor>& y, const c10::optional<torch::Tensor>& gate,
                       const torch::Tensor& scale, const torch::Tensor& shift, double eps) {
  check_float_cpu(h, "h");
  const int64_t d = h.size(-1), rows = h.numel() / d;
  check_vector(scale, d, "scale");
  check_vector(shift, d, "shift");
  const GatedResidual res = gated_residual(h, y, gate, d);
  auto out = torch::empty_like(h);
  float* hp = h.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* sh = shift.data_ptr<float>();
  const auto opl = one_plus(scale);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      modulated_norm_row(hp + r * d, res.y == nullptr ? nullptr : res.y + r * d, res.gate, opl.data(), sh, d, e,
                         op + r * d);
  });
  return out;
}

// GELU with the tanh approximation (t2w_simd.h), in place.
void gelu_tanh_(torch::Tensor x) {
  check_float_cpu(x, "x");
  float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  at::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + W <= end; i += W) vstore(p + i, gelu_tanh_vec(vload(p + i)));
    for (; i < end; ++i) p[i] = gelu_tanh_scalar(p[i]);
  });
}

// The DiT's block-local attention, straight from the fused q|k|v projection, over windows laid
// end to end.
//   qkv [T, 3 * H * Dh]; starts / lengths [S] (int64): segment s is rows starts[s] .. starts[s] +
//   lengths[s], one window (positions and blocks count from its first row); cos / sin [P, Dh]
//   (rotate-half tables by position, P >= every length)
// A query in block b of its segment attends to the segment's keys in blocks b - back .. b + ahead
// (scaled dot product, softmax). Heads below rope_heads get the checkpoint's RoPE first: the
// head's interleaved pairs (x[2i], x[2i+1]) rotated as transformers does after de-interleaving
// (the de-interleaved order is a permutation shared by q and k, which leaves their dot products
// unchanged). Rows outside every segment get zeros. Returns [T, H * Dh].
torch::Tensor dit_block_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                  const torch::Tensor& starts, const torch::Tensor& lengths, int64_t heads,
                                  int64_t block, int64_t back, int64_t ahead, int64_t rope_heads) {
  check_float_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && heads > 0 && qkv.size(1) % (3 * heads) == 0, "qkv must be [T, 3 * heads * head_dim]");
  const int64_t total = qkv.size(0), dh = qkv.size(1) / (3 * heads), half = dh / 2;
  TORCH_CHECK(dh % 2 == 0, "head_dim must be even");
  check_float_cpu(cos, "cos");
  check_float_cpu(sin, "sin");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dh && sin.sizes() == cos.sizes(), "cos and sin must be [P, head_dim]");
  for (const auto* t : {&starts, &lengths}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kInt64 && t->dim() == 1 && t->is_contiguous(),
                "starts and lengths must be int64 [S]");
  }
  TORCH_CHECK(starts.numel() == lengths.numel(), "starts and lengths differ in size");
  TORCH_CHECK(block > 0 && back >= 0 && ahead >= 0 && rope_heads >= 0 && rope_heads <= heads, "bad block layout");
  const int64_t* sp0 = starts.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  // (segment, query block) pairs: the parallel tasks, times heads
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t s = 0; s < starts.numel(); ++s) {
    TORCH_CHECK(sp0[s] >= 0 && lp[s] >= 0 && sp0[s] + lp[s] <= total, "segment ", s, " lies outside qkv");
    TORCH_CHECK(lp[s] <= cos.size(0), "segment ", s, " is longer than the cos / sin tables");
    for (int64_t qb = 0; qb * block < lp[s]; ++qb) items.emplace_back(s, qb);
  }
  auto out = torch::zeros({total, heads * dh}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t ld = 3 * heads * dh, span = (1 + back + ahead) * block;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  // Scores: queries sit in vector lanes (W at a time), so a key's score for W queries is dh
  // multiply-adds with the key's values broadcast, and the softmax's max and sum run lane-wise,
  // with no horizontal reductions; keys go 4 at a time for independent chains.
  constexpr int64_t KJ = 4;
  const bool vector_rows = dh % W == 0;  // P V below loads whole rows of values
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, num_items * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> keys((span + KJ) * dh, 0.f), qt(dh * W);
    std::vector<vf> score(span + KJ);
    for (int64_t task = begin; task < end; ++task) {
      const auto [seg, qb] = items[task / heads];
      const int64_t h = task % heads, n = lp[seg];
      const int64_t q0 = qb * block, q1 = std::min(q0 + block, n);
      const int64_t k0 = std::max<int64_t>(0, (qb - back) * block), k1 = std::min(n, (qb + 1 + ahead) * block);
      const int64_t nk = k1 - k0;
      const bool rope = h < rope_heads;
      const float* base = src + sp0[seg] * ld;
      for (int64_t j = 0; j < nk; ++j) {
        const float* k = base + (k0 + j) * ld + (heads + h) * dh;
        float* kr = keys.data() + j * dh;
        if (rope) {
          rope_interleaved(k, cp + (k0 + j) * dh, sp + (k0 + j) * dh, half, kr, 1);
        } else {
          std::copy(k, k + dh, kr);
        }
      }
      std::fill(keys.begin() + nk * dh, keys.begin() + (nk + KJ) * dh, 0.f);  // the last group's spare keys
      for (int64_t g0 = q0; g0 < q1; g0 += W) {
        const int64_t ng = std::min<int64_t>(W, q1 - g0);
        // queries transposed [dh, W] (spare lanes repeat the last query)
        for (int64_t g = 0; g < W; ++g) {
          const int64_t t = g0 + std::min(g, ng - 1);
          const float* qs = base + t * ld + h * dh;
          if (rope) {
            rope_interleaved(qs, cp + t * dh, sp + t * dh, half, qt.data() + g, W);
          } else {
            for (int64_t i = 0; i < dh; ++i) qt[i * W + g] = qs[i];
          }
        }
        const vf vscale = vset(scale);
        for (int64_t j = 0; j < nk; j += KJ) {
          vf acc[KJ];
          for (int64_t jj = 0; jj < KJ; ++jj) acc[jj] = vset(0.f);
          for (int64_t i = 0; i < dh; ++i) {
            const vf qi = vload(qt.data() + i * W);
            for (int64_t jj = 0; jj < KJ; ++jj) acc[jj] = vfma(qi, vset(keys[(j + jj) * dh + i]), acc[jj]);
          }
          for (int64_t jj = 0; jj < KJ; ++jj) score[j + jj] = vmul(acc[jj], vscale);
        }
        vf top = score[0];
        for (int64_t j = 1; j < nk; ++j) top = vmax(top, score[j]);
        vf total = vset(0.f);
        for (int64_t j = 0; j < nk; ++j) {
          score[j] = vexp(vsub(score[j], top));
          total = vadd(total, score[j]);
        }
        alignas(64) float inv[W < 4 ? 4 : W];  // the groups of four below may read past a short last group
        vstore(inv, vdiv(vset(1.0f), total));
        // P V per query (its weights broadcast from the score lanes, the values' rows as whole
        // vectors), four queries at a time for independent chains; rows are stored directly
        const float* probs = reinterpret_cast<const float*>(score.data());  // [key][lane]
        const float* v0 = base + k0 * ld + (2 * heads + h) * dh;
        float* o0 = dst + (sp0[seg] + g0) * heads * dh + h * dh;
        const int64_t lo = heads * dh;  // one query's output row
        if (!vector_rows) {
          for (int64_t g = 0; g < ng; ++g) {
            float* o = o0 + g * lo;
            for (int64_t j = 0; j < nk; ++j) {
              const float pj = probs[j * W + g];
              for (int64_t i = 0; i < dh; ++i) o[i] += pj * v0[j * ld + i];
            }
            for (int64_t i = 0; i < dh; ++i) o[i] *= inv[g];
          }
          continue;
        }
        for (int64_t i = 0; i < dh; i += W) {
          for (int64_t g = 0; g < ng; g += 4) {
            vf acc[4];
            for (int64_t gg = 0; gg < 4; ++gg) acc[gg] = vset(0.f);
            for (int64_t j = 0; j < nk; ++j) {
              const vf v = vload(v0 + j * ld + i);
              for (int64_t gg = 0; gg < 4; ++gg) acc[gg] = vfma(vset(probs[j * W + g + gg]), v, acc[gg]);
            }
            for (int64_t gg = 0; gg < 4 && g + gg < ng; ++gg) vstore(o0 + (g + gg) * lo + i, vmul(acc[gg], vset(inv[g + gg])));
          }
        }
      }
    }
  });
  return out;
}

// BigVGAN's anti-aliased SnakeBeta activation over x [B, C, T]: upsample 2x (replicate pad, the
// transposed kaiser-sinc filter, times 2), x + inv_beta * sin(alpha_exp * x)^2 per channel, then
// downsample 2x (replicate pad, the low-pass filter, stride 2). One pass per channel row: the
// upsampled signal lives only in two phase buffers (even and odd samples), each filtered as a
// contiguous FIR. alpha_exp = exp(alpha), inv_beta = 1 / (exp(beta) + 1e-9), per channel.
torch::Tensor snake_antialias(const torch::Tensor& x, const torch::Tensor& alpha_exp, const torch::Tensor& inv_beta,
                              const torch::Tensor& up_filter, const torch::Tensor& down_filter) {
  check_float_cpu(x, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [B, C, T]");
  const int64_t batch = x.size(0), ch = x.size(1), len = x.size(2);
  TORCH_CHECK(len > 0, "x must hold samples");
  check_vector(alpha_exp, ch, "alpha_exp");
  check_vector(inv_beta, ch, "inv_beta");
  check_float_cpu(up_filter, "up_filter");
  check_float_cpu(down_filter, "down_filter");
  const int64_t ku = up_filter.numel(), kd = down_filter.numel();
  TORCH_CHECK(ku >= 2 && ku % 2 == 0 && kd >= 2 && kd % 2 == 0, "filters must have an even number of taps");
  // transformers' UpSample1d(ratio 2): pad, then crop pad_left of the transposed convolution
  const int64_t up_pad = ku / 2 - 1, up_crop = up_pad * 2 + (ku - 2) / 2;
  // DownSample1d(ratio 2, even kernel): replicate pad of kd / 2 - 1 on the left
  const int64_t down_left = kd / 2 - 1, margin = kd / 2 + 1;
  struct Tap {
    float w;
    int64_t off;
  };
  // up: output sample 2m + p reads xp[m + off] for the taps of its phase p
  std::vector<Tap> up_taps[2];
  for (int64_t p = 0; p < 2; ++p)
    for (int64_t k = 0; k < ku; ++k)
      if ((p + up_crop - k) % 2 == 0) up_taps[p].push_back({up_filter.data_ptr<float>()[k], (p + up_crop - k) / 2});
  for (int64_t p = 0; p < 2; ++p)
    for (const Tap& t : up_taps[p]) TORCH_CHECK(t.off >= 0 && t.off <= 2 * up_pad, "unexpected up-sampling layout");
  // down: output t reads phase (k - down_left) mod 2 at m = t + off
  std::vector<Tap> down_taps[2];
  for (int64_t k = 0; k < kd; ++k) {
    const int64_t j = k - down_left;  // sample 2t + j of the activated signal
    const int64_t p = ((j % 2) + 2) % 2;
    down_taps[p].push_back({down_filter.data_ptr<float>()[k], (j - p) / 2});
  }
  for (int64_t p = 0; p < 2; ++p)
    for (const Tap& t : down_taps[p]) TORCH_CHECK(t.off >= -margin && t.off <= margin, "unexpected down-sampling layout");

  constexpr int64_t U = 4;
  auto out = torch::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const float* ap = alpha_exp.data_ptr<float>();
  const float* bp = inv_beta.data_ptr<float>();
  at::parallel_for(0, batch * ch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xp(len + 2 * up_pad + W), phase[2] = {std::vector<float>(len + 2 * margin + W),
                                                             std::vector<float>(len + 2 * margin + W)};
    for (int64_t row = begin; row < end; ++row) {
      const float* in = src + row * len;
      float* o = dst + row * len;
      const float a = ap[row % ch], ib = bp[row % ch];
      std::fill(xp.begin(), xp.begin() + up_pad, in[0]);
      std::copy(in, in + len, xp.begin() + up_pad);
      std::fill(xp.begin() + up_pad + len, xp.end(), in[len - 1]);
      for (int64_t p = 0; p < 2; ++p) {
        float* s = phase[p].data() + margin;
        const std::vector<Tap>& taps = up_taps[p];
        int64_t m = 0;
        const vf two = vset(2.0f), va = vset(a), vb = vset(ib);
        // U vectors per pass: independent multiply-add chains (one chain waits on each add)
        for (; m + U * W <= len; m += U * W) {
          vf acc[U];
          for (int64_t u = 0; u < U; ++u) acc[u] = vset(0.f);
          for (const Tap& tap : taps) {
            const vf w = vset(tap.w);
            for (int64_t u = 0; u < U; ++u) acc[u] = vfma(w, vload(xp.data() + m + u * W + tap.off), acc[u]);
          }
          for (int64_t u = 0; u < U; ++u) {
            const vf up = vmul(two, acc[u]);
            const vf sn = vsin(vmul(up, va));
            vstore(s + m + u * W, vadd(up, vmul(vb, vmul(sn, sn))));
          }
        }
        for (; m + W <= len; m += W) {
          vf acc = vset(0.f);
          for (const Tap& tap : taps) acc = vfma(vset(tap.w), vload(xp.data() + m + tap.off), acc);
          const vf up = vmul(two, acc);
          const vf sn = vsin(vmul(up, va));
          vstore(s + m, vadd(up, vmul(vb, vmul(sn, sn))));
        }
        for (; m < len; ++m) {
          float acc = taps[0].w * xp[m + taps[0].off];
          for (size_t k = 1; k < taps.size(); ++k) acc += taps[k].w * xp[m + taps[k].off];
          const float u = 2.0f * acc;
          const float sn = std::sin(u * a);
          s[m] = u + ib * (sn * sn);
        }
      }
      // replicate padding of the activated signal: its first sample (even phase, m = 0) on the
      // left, its last (odd phase, m = len - 1) on the right
      const float first = phase[0][margin], last = phase[1][margin + len - 1];
      for (int64_t p = 0; p < 2; ++p) {
        std::fill(phase[p].begin(), phase[p].begin() + margin, first);
        std::fill(phase[p].begin() + margin + len, phase[p].end(), last);
      }
      int64_t t = 0;
      for (; t + U * W <= len; t += U * W) {
        vf acc[U];
        for (int64_t u = 0; u < U; ++u) acc[u] = vset(0.f);
        for (int64_t p = 0; p < 2; ++p)
          for (const Tap& tap : down_taps[p]) {
            const vf w = vset(tap.w);
            const float* src_p = phase[p].data() + margin + t + tap.off;
            for (int64_t u = 0; u < U; ++u) acc[u] = vfma(w, vload(src_p + u * W), acc[u]);
          }
        for (int64_t u = 0; u < U; ++u) vstore(o + t + u * W, acc[u]);
      }
      for (; t + W <= len; t += W) {
        vf acc = vset(0.f);
        for (int64_t p = 0; p < 2; ++p)
          for (const Tap& tap : down_taps[p])
            acc = vfma(vset(tap.w), vload(phase[p].data() + margin + t + tap.off), acc);
        vstore(o + t, acc);
      }
      for (; t < len; ++t) {
        float acc = 0.f;
        for (int64_t p = 0; p < 2; ++p)
          for (const Tap& tap : down_taps[p]) acc += tap.w * phase[p][margin + t + tap.off];
        o[t] = acc;
      }
    }
  });
  return out;
}

namespace {

// One output tile of conv1d_narrow: CO output channels x TV vectors of time, all in registers.
// xp: the zero-padded input rows [cin][ldx]; wt: weights as [cin][k][wstride] (this tile's CO
// channels first); out / res: [CO][len].
template <int CO, int TV>
void conv_narrow_rows(const float* xp, int64_t ldx, int64_t cin, int64_t taps, int64_t dil, const float* wt,
                      int64_t wstride, const float* bias, const float* res, float* out, int64_t len) {
  int64_t t = 0;
  for (; t + TV * W <= len; t += TV * W) {
    vf acc[CO][TV];
    for (int c = 0; c < CO; ++c)
      for (int v = 0; v < TV; ++v) acc[c][v] = vset(bias == nullptr ? 0.f : bias[c]);
    for (int64_t ci = 0; ci < cin; ++ci) {
      const float* row = xp + ci * ldx + t;
      for (int64_t k = 0; k < taps; ++k) {
        vf xv[TV];
        for (int v = 0; v < TV; ++v) xv[v] = vload(row + k * dil + v * W);
        const float* wk = wt + (ci * taps + k) * wstride;
        for (int c = 0; c < CO; ++c) {
          const vf w = vset(wk[c]);
          for (int v = 0; v < TV; ++v) acc[c][v] = vfma(w, xv[v], acc[c][v]);
        }
      }
    }
    for (int c = 0; c < CO; ++c)
      for (int v = 0; v < TV; ++v) {
        float* o = out + c * len + t + v * W;
        vstore(o, res == nullptr ? acc[c][v] : vadd(vload(res + c * len + t + v * W), acc[c][v]));
      }
  }
  for (; t < len; ++t)
    for (int c = 0; c < CO; ++c) {
      float acc = bias == nullptr ? 0.f : bias[c];
      for (int64_t ci = 0; ci < cin; ++ci)
        for (int64_t k = 0; k < taps; ++k) acc += wt[(ci * taps + k) * wstride + c] * xp[ci * ldx + t + k * dil];
      out[c * len + t] = res == nullptr ? acc : res[c * len + t] + acc;
    }
}

}  // namespace

// A "same" 1-D convolution (stride 1, zero padding of dilation * (taps - 1) / 2 per side) with
// few output channels, plus an optional residual: out = res + conv(x).
//   x [B, Cin, T]; weight [Cout, Cin, taps] (taps odd); bias [Cout] or none; res [B, Cout, T] or none
// Why: BigVGAN's last levels run at 2-16 channels over 30-240 samples per mel frame; ATen's
// convolution vectorizes over channels there and reached 4-30 GMAC/s against ~40 at 64 channels.
// Here time sits in the vector lanes and every output channel's accumulators stay in registers
// while each input sample is loaded once per tap.
torch::Tensor conv1d_narrow(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                            int64_t dilation, const c10::optional<torch::Tensor>& res) {
  check_float_cpu(x, "x");
  check_float_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 3 && weight.size(1) == x.size(1), "x [B, Cin, T] and weight [Cout, Cin, taps]");
  const int64_t batch = x.size(0), cin = x.size(1), len = x.size(2), cout = weight.size(0), taps = weight.size(2);
  TORCH_CHECK(taps % 2 == 1 && dilation >= 1, "taps must be odd and dilation positive");
  TORCH_CHECK(cout == 1 || cout == 2 || cout == 4 || cout == 8 || cout == 16, "conv1d_narrow takes 1, 2, 4, 8 or 16 output channels");
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_vector(*bias, cout, "bias");
    bp = bias->data_ptr<float>();
  }
  const float* rp = nullptr;
  if (res.has_value()) {
    check_float_cpu(*res, "res");
    TORCH_CHECK(res->dim() == 3 && res->size(0) == batch && res->size(1) == cout && res->size(2) == len, "res must be [B, Cout, T]");
    rp = res->data_ptr<float>();
  }
  const int64_t pad = dilation * (taps - 1) / 2, ldx = len + 2 * pad;
  std::vector<float> wt(cin * taps * cout);  // [cin][taps][cout]: a tap's weights side by side
  const float* wp = weight.data_ptr<float>();
  for (int64_t c = 0; c < cout; ++c)
    for (int64_t ci = 0; ci < cin; ++ci)
      for (int64_t k = 0; k < taps; ++k) wt[(ci * taps + k) * cout + c] = wp[(c * cin + ci) * taps + k];
  auto out = torch::empty({batch, cout, len}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xp(cin * ldx, 0.f);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t ci = 0; ci < cin; ++ci) std::copy_n(src + (b * cin + ci) * len, len, xp.data() + ci * ldx + pad);
      const float* r = rp == nullptr ? nullptr : rp + b * cout * len;
      float* o = dst + b * cout * len;
      const float* w = wt.data();
      switch (cout) {
        case 1: conv_narrow_rows<1, 4>(xp.data(), ldx, cin, taps, dilation, w, 1, bp, r, o, len); break;
        case 2: conv_narrow_rows<2, 4>(xp.data(), ldx, cin, taps, dilation, w, 2, bp, r, o, len); break;
        case 4: conv_narrow_rows<4, 2>(xp.data(), ldx, cin, taps, dilation, w, 4, bp, r, o, len); break;
        default:  // 8 or 16: eight channels at a time (16 at once spill the registers)
          for (int64_t c = 0; c < cout; c += 8)
            conv_narrow_rows<8, 2>(xp.data(), ldx, cin, taps, dilation, w + c, cout, bp == nullptr ? nullptr : bp + c,
                                   r == nullptr ? nullptr : r + c * len, o + c * len, len);
      }
    }
  });
  return out;
}

void register_token2wav_kernels(pybind11::module& m) {
  m.def("dit_norm", &dit_norm, "h += gate * y (optional); LayerNorm(h) * (1 + scale) + shift");
  m.def("gelu_tanh_", &gelu_tanh_, "GELU (tanh approximation) in place");
  m.def("dit_block_attention", &dit_block_attention, "the token2wav DiT's block-local attention from fused qkv");
  m.def("snake_antialias", &snake_antialias, "BigVGAN's anti-aliased SnakeBeta activation");
  m.def("conv1d_narrow", &conv1d_narrow, "same-padded conv1d with few output channels, plus a residual");
}
