// Fused float32 CPU kernels for the AR decoder's small per-layer ops.
//
// Why: a small ATen op that runs right after a GEMM has streamed megabytes of weights through
// the caches costs several times what it costs with its code cached (the dispatcher's code and
// data were evicted; docs/bench-ar.md has the figures), and an RMSNorm is six such ops. One
// call here replaces them. Built with -ffp-contract=off so products and sums round exactly as the eager
// ops do, and RMSNorm's sum of squares is accumulated in the order of ATen's float sum, so the
// norms are bit-identical to transformers' x.pow(2).mean(-1) too.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

// ATen's vectorized exp (SLEEF, exported by libtorch_cpu): SiLU here rounds as F.silu does.
extern "C" __m512 Sleef_expf16_u10(__m512);
extern "C" __m256 Sleef_expf8_u10(__m256);

namespace {

constexpr int64_t kGrainElements = 32768;  // below this, one thread (as ATen's own grain size)

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1)); }

// Lanes of ATen's Vectorized<float> in its sum kernel on this machine; cpu_fused.py sets it
// after checking which width reproduces torch.sum.
int g_sum_lanes = 8;

int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v; v >>= 1) ++bits;
  return bits;
}

// sum(x[i] * x[i]) in the order of ATen's cascade sum over a contiguous row (SumKernel.cpp):
// vectors of L lanes dealt round-robin to four accumulators, whose groups of four vectors are
// summed in levels of 2^p groups; left-over vectors go to the first accumulator, the four are
// folded in order, then the scalar tail and the L lanes are added one by one.
template <int L>
float sum_squares_aten_order(const float* x, int64_t n) {
  constexpr int kLevels = 4, kIlp = 4;
  const int64_t vectors = n / L, groups = vectors / kIlp;
  const int64_t power = std::max<int64_t>(4, ceil_log2(groups) / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  float acc[kLevels][kIlp][L] = {};
  auto add_group = [&](int64_t g) {
    for (int k = 0; k < kIlp; ++k) {
      const float* v = x + (g * kIlp + k) * L;
#pragma omp simd
      for (int l = 0; l < L; ++l) acc[0][k][l] += v[l] * v[l];
    }
  };
  auto fold = [&](int into, int from, bool clear) {
    for (int k = 0; k < kIlp; ++k) {
#pragma omp simd
      for (int l = 0; l < L; ++l) {
        acc[into][k][l] += acc[from][k][l];
        if (clear) acc[from][k][l] = 0.f;
      }
    }
  };
  int64_t g = 0;
  while (g + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++g) add_group(g);
    for (int level = 1; level < kLevels; ++level) {
      fold(level, level - 1, true);
      if ((g & (mask << (level * power))) != 0) break;
    }
  }
  for (; g < groups; ++g) add_group(g);
  for (int level = 1; level < kLevels; ++level) fold(0, level, false);
  float* first = acc[0][0];
  for (int64_t v = groups * kIlp; v < vectors; ++v) {
#pragma omp simd
    for (int l = 0; l < L; ++l) first[l] += x[v * L + l] * x[v * L + l];
  }
  for (int k = 1; k < kIlp; ++k) {
#pragma omp simd
    for (int l = 0; l < L; ++l) first[l] += acc[0][k][l];
  }
  float total = 0.f;
  for (int64_t i = vectors * L; i < n; ++i) total += x[i] * x[i];
  for (int l = 0; l < L; ++l) total += first[l];
  return total;
}

inline float sum_squares(const float* x, int64_t n) {
  if (n < g_sum_lanes) return sum_squares_aten_order<1>(x, n);  // ATen's scalar path: the same cascade
  return g_sum_lanes == 16 ? sum_squares_aten_order<16>(x, n) : sum_squares_aten_order<8>(x, n);
}

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float ss = sum_squares(x, n);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

// Rotate-half RoPE of one head: out <- in * cos + roll(in, d / 2) * sin_signed (in may be out).
inline void rope_head(const float* in, float* out, const float* c, const float* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = in[i], b = in[i + half];
    out[i] = a * c[i] + b * s[i];
    out[i + half] = b * c[i + half] + a * s[i + half];
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with unit column stride");
}

void check_weight(const torch::Tensor& w, int64_t n, const char* name) {
  TORCH_CHECK(w.is_contiguous() && w.numel() == n && w.scalar_type() == torch::kFloat32,
              name, " must be a contiguous float32 vector of ", n);
}

// x [rows, heads, d] (rows and heads strided, unit stride in d); cos / sin_signed [rows, d].
void check_heads_and_tables(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1,
              "x must be a float32 CPU tensor [rows, heads, d] with unit stride in d");
  const int64_t rows = x.size(0), d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && cos.is_contiguous() && sin_signed.is_contiguous() &&
              cos.numel() == rows * d && sin_signed.numel() == rows * d &&
              cos.scalar_type() == torch::kFloat32 && sin_signed.scalar_type() == torch::kFloat32,
              "cos / sin_signed must be contiguous float32 [rows, d] (d even)");
}

}  // namespace

// out = x * rsqrt(mean(x^2) + eps) * weight, row by row.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  check_weight(weight, n, "weight");
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * ldx, wp, op + r * n, n, e);
  });
  return out;
}

// y += residual (in place), then returns rms_norm(y).
torch::Tensor add_rms_norm_(torch::Tensor& y, const torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  check_rows(y, "y");
  check_rows(residual, "residual");
  TORCH_CHECK(y.sizes() == residual.sizes(), "y and residual differ in shape");
  const int64_t rows = y.size(0), n = y.size(1);
  check_weight(weight, n, "weight");
  auto out = torch::empty({rows, n}, y.options());
  float* yp = y.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldy = y.stride(0), ldr = residual.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* yr = yp + r * ldy;
      const float* rr = rp + r * ldr;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) yr[i] = yr[i] + rr[i];
      norm_row(yr, wp, op + r * n, n, e);
    }
  });
  return out;
}

// Rotate-half RoPE in place: x [rows, heads, d] (rows and heads strided, unit stride within a
// head), cos / sin_signed [rows, d] contiguous, sin_signed = [-sin | sin] by halves:
// x <- x * cos + roll(x, d / 2) * sin_signed.
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed) {
  check_heads_and_tables(x, cos, sin_signed);
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  const int64_t ldr = x.stride(0), ldh = x.stride(1);
  at::parallel_for(0, rows, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * d;
      const float* s = sp + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + r * ldr + h * ldh;
        rope_head(v, v, c, s, half);
      }
    }
  });
}

// silu(gate) * up, with silu(x) = x / (1 + exp(-x)) as ATen computes it.
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up differ in shape");
  const int64_t rows = gate.size(0), n = gate.size(1);
  auto out = torch::empty({rows, n}, gate.options());
  const float* gp = gate.data_ptr<float>();
  const float* upp = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldg = gate.stride(0), ldu = up.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * ldg;
      const float* u = upp + r * ldu;
      float* o = op + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
      for (; i < n; i += 16) {  // the tail through the same vector code, masked (as ATen does)
        const __mmask16 k = i + 16 <= n ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(k, g + i);
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_sub_ps(zero, x))));
        _mm512_mask_storeu_ps(o + i, k, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, u + i)));
      }
#elif defined(__AVX2__)
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_sub_ps(zero, x))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < n; ++i) o[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
    }
  });
  return out;
}

// Qwen3's per-head q/k RMSNorm followed by rotate-half RoPE, in place on the q|k columns of the
// fused qkv output: x [rows, q_heads + k_heads, d] (rows and heads strided, unit stride in d);
// heads below q_heads use q_weight [d], the rest k_weight [d].
void qk_norm_rope_(torch::Tensor& x, int64_t q_heads, const torch::Tensor& q_weight, const torch::Tensor& k_weight,
                   double eps, const torch::Tensor& cos, const torch::Tensor& sin_signed) {
  check_heads_and_tables(x, cos, sin_signed);
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d <= 1024, "head_dim must be at most 1024");
  TORCH_CHECK(q_heads >= 0 && q_heads <= heads, "q_heads out of range");
  check_weight(q_weight, d, "q_weight");
  check_weight(k_weight, d, "k_weight");
  float* xp = x.data_ptr<float>();
  const float* qw = q_weight.data_ptr<float>();
  const float* kw = k_weight.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  const int64_t ldr = x.stride(0), ldh = x.stride(1);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    float normed[1024];
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * d;
      const float* s = sp + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + r * ldr + h * ldh;
        norm_row(v, h < q_heads ? qw : kw, normed, d, e);
        rope_head(normed, v, c, s, half);
      }
    }
  });
}

// kernels/csrc/token2wav_fused.cpp
void register_token2wav_kernels(pybind11::module& m);
void register_token2wav_layer_kernels(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qk_norm_rope_", &qk_norm_rope_, "per-head q/k RMSNorm then rotate-half RoPE, in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim of a 2-D float32 tensor");
  m.def("add_rms_norm_", &add_rms_norm_, "y += residual; return RMSNorm(y)");
  m.def("rope_", &rope_, "rotate-half RoPE in place");
  m.def("set_sum_lanes", [](int lanes) {
    TORCH_CHECK(lanes == 8 || lanes == 16, "lanes must be 8 or 16");
    g_sum_lanes = lanes;
  }, "vector width of ATen's float sum, which RMSNorm's sum of squares follows");
  register_token2wav_kernels(m);
  register_token2wav_layer_kernels(m);
}
