// The token2wav DiT's layer as two fused CPU kernels around its attention, for thin DiTs.
//
// Why: at the tiny checkpoints' width (32) a layer's four GEMMs have K = 32 or 64, where MKL
// reached ~30 GMAC/s (its packing and call overhead are paid per GEMM), and every step between
// them (pre-norms, gated residuals, GELU) was a pass of its own over [rows, D]. Here a tile of
// rows goes through the row-local part of a layer while it sits in L1, with the GEMMs as
// register-blocked products against transposed weights that stay in cache:
//   dit_attn_in:     h += gate * y; n = LayerNorm(h) * (1 + scale) + shift; qkv = n Wqkv + b
//   dit_attn_out_ff: y = a Wout + b; h += gate * y; n = LayerNorm(h) * (1 + scale) + shift;
//                    out = GELU(n Win + b) Wff + b
// Sums run in another order than MKL's, so results agree with the eager ops to float rounding.
// Wide DiTs (the real checkpoints) keep MKL: their weights do not stay in cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

#include "t2w_simd.h"

using namespace t2w_simd;

namespace {

constexpr int64_t TILE = 16;  // rows per tile: its intermediates stay in L1
// Register blocking: ROWS rows x up to MAXV output vectors of accumulators (AVX-512 has 32
// registers, AVX2 16). 8 x 3 measured fastest for these shapes here (~1.4-1.6x MKL); 4 x 6
// spilled.
constexpr int MAXV = W == 16 ? 3 : 2;
constexpr int ROWS = W == 16 ? 8 : 4;

// y[r][0 .. NV * W) = bias + sum_k x[r][k] * wt[k][..] for R rows. wt's rows are ldw apart.
// The loops over R and NV must unroll for the accumulators to live in registers.
template <int R, int NV>
inline void gemm_block(const float* x, int64_t ldx, int64_t k_len, const float* wt, int64_t ldw, const float* bias,
                       float* y, int64_t ldy) {
  vf acc[R][NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const vf b = vload(bias + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][v] = b;
  }
  for (int64_t k = 0; k < k_len; ++k) {
    vf w[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) w[v] = vload(wt + k * ldw + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf xb = vset(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(xb, w[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) vstore(y + r * ldy + v * W, acc[r][v]);
}

template <int R>
void gemm_rows_r(const float* x, int64_t ldx, int64_t k_len, const float* wt, int64_t n, const float* bias, float* y,
                 int64_t ldy) {
  const int64_t nv = n / W;
  int64_t v0 = 0;
  for (; v0 + MAXV <= nv; v0 += MAXV) gemm_block<R, MAXV>(x, ldx, k_len, wt + v0 * W, n, bias + v0 * W, y + v0 * W, ldy);
  const float* w = wt + v0 * W;
  const float* b = bias + v0 * W;
  float* o = y + v0 * W;
  switch (nv - v0) {
    case 0: break;
    case 1: gemm_block<R, 1>(x, ldx, k_len, w, n, b, o, ldy); break;
    default: gemm_block<R, 2>(x, ldx, k_len, w, n, b, o, ldy); break;
  }
}

// y [rows, n] = x [rows, k_len] wt [k_len, n] + bias [n]; n a multiple of W.
void gemm_rows(const float* x, int64_t ldx, int64_t rows, int64_t k_len, const float* wt, int64_t n, const float* bias,
               float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) gemm_rows_r<ROWS>(x + r * ldx, ldx, k_len, wt, n, bias, y + r * ldy, ldy);
  for (; r < rows; ++r) gemm_rows_r<1>(x + r * ldx, ldx, k_len, wt, n, bias, y + r * ldy, ldy);
}

void check_weight(const torch::Tensor& wt, int64_t k_len, int64_t n, const char* name) {
  check_float_cpu(wt, name);
  TORCH_CHECK(wt.dim() == 2 && wt.size(0) == k_len && wt.size(1) == n, name, " must be [", k_len, ", ", n,
              "] (the weight transposed)");
  TORCH_CHECK(n % W == 0, name, ": ", n, " outputs are not a multiple of the vector width ", W);
}

}  // namespace

// h [N, D] (updated in place); y [N, D] and gate [D] together or neither; scale / shift [D];
// wqkv_t [D, 3I]; bqkv [3I]. Returns qkv [N, 3I].
torch::Tensor dit_attn_in(torch::Tensor h, const c10::optional<torch::Tensor>& y,
                          const c10::optional<torch::Tensor>& gate, const torch::Tensor& scale,
                          const torch::Tensor& shift, double eps, const torch::Tensor& wqkv_t,
                          const torch::Tensor& bqkv) {
  check_float_cpu(h, "h");
  TORCH_CHECK(h.dim() == 2, "h must be [N, D]");
  const int64_t rows = h.size(0), d = h.size(1), n = wqkv_t.size(1);
  check_vector(scale, d, "scale");
  check_vector(shift, d, "shift");
  check_weight(wqkv_t, d, n, "wqkv_t");
  check_vector(bqkv, n, "bqkv");
  const GatedResidual res = gated_residual(h, y, gate, d);
  auto out = torch::empty({rows, n}, h.options());
  float* hp = h.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto opl = one_plus(scale);
  const float* sh = shift.data_ptr<float>();
  const float* wp = wqkv_t.data_ptr<float>();
  const float* bp = bqkv.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t tiles = (rows + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> norm(TILE * d);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t r0 = tile * TILE, count = std::min(TILE, rows - r0);
      for (int64_t r = 0; r < count; ++r) {
        const int64_t row = r0 + r;
        modulated_norm_row(hp + row * d, res.y == nullptr ? nullptr : res.y + row * d, res.gate, opl.data(), sh, d,
                           e, norm.data() + r * d);
      }
      gemm_rows(norm.data(), d, count, d, wp, n, bp, op + r0 * n, n);
    }
  });
  return out;
}

// h [N, D] (updated in place); a [N, I] (attention output); wout_t [I, D], bout [D]; gate /
// scale / shift [D]; win_t [D, F], bin [F]; wff_t [F, D], bff [D]. Returns [N, D].
torch::Tensor dit_attn_out_ff(torch::Tensor h, const torch::Tensor& a, const torch::Tensor& wout_t,
                              const torch::Tensor& bout, const torch::Tensor& gate, const torch::Tensor& scale,
                              const torch::Tensor& shift, double eps, const torch::Tensor& win_t,
                              const torch::Tensor& bin, const torch::Tensor& wff_t, const torch::Tensor& bff) {
  check_float_cpu(h, "h");
  check_float_cpu(a, "a");
  TORCH_CHECK(h.dim() == 2 && a.dim() == 2 && a.size(0) == h.size(0), "h must be [N, D] and a [N, I]");
  const int64_t rows = h.size(0), d = h.size(1), inner = a.size(1), ff = win_t.size(1);
  check_weight(wout_t, inner, d, "wout_t");
  check_vector(bout, d, "bout");
  check_vector(gate, d, "gate");
  check_vector(scale, d, "scale");
  check_vector(shift, d, "shift");
  check_weight(win_t, d, ff, "win_t");
  check_vector(bin, ff, "bin");
  check_weight(wff_t, ff, d, "wff_t");
  check_vector(bff, d, "bff");
  auto out = torch::empty({rows, d}, h.options());
  float* hp = h.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto opl = one_plus(scale);
  const float* gp = gate.data_ptr<float>();
  const float* sh = shift.data_ptr<float>();
  const float* wo = wout_t.data_ptr<float>();
  const float* bo = bout.data_ptr<float>();
  const float* wi = win_t.data_ptr<float>();
  const float* bi = bin.data_ptr<float>();
  const float* wf = wff_t.data_ptr<float>();
  const float* bf = bff.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t tiles = (rows + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> proj(TILE * d), norm(TILE * d), hidden(TILE * ff);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t r0 = tile * TILE, count = std::min(TILE, rows - r0);
      gemm_rows(ap + r0 * inner, inner, count, inner, wo, d, bo, proj.data(), d);
      for (int64_t r = 0; r < count; ++r)
        modulated_norm_row(hp + (r0 + r) * d, proj.data() + r * d, gp, opl.data(), sh, d, e, norm.data() + r * d);
      gemm_rows(norm.data(), d, count, d, wi, ff, bi, hidden.data(), ff);
      float* f = hidden.data();
      for (int64_t i = 0; i < count * ff; i += W) vstore(f + i, gelu_tanh_vec(vload(f + i)));
      gemm_rows(hidden.data(), ff, count, ff, wf, d, bf, op + r0 * d, d);
    }
  });
  return out;
}

void register_token2wav_layer_kernels(pybind11::module& m) {
  m.def("dit_attn_in", &dit_attn_in, "DiT: gated residual, modulated LayerNorm and the q|k|v projection");
  m.def("dit_attn_out_ff", &dit_attn_out_ff,
        "DiT: attention output projection, gated residual, modulated LayerNorm and the GELU MLP");
}
