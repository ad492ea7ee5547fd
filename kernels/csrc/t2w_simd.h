// Helpers shared by the token2wav kernels (token2wav_fused.cpp, token2wav_dit_layer.cpp): one
// vector type for the build's widest float lanes (AVX-512, AVX2, or scalar), argument checks,
// and the DiT's per-row pieces both files use (the modulated pre-norm row, GELU).
#pragma once
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

// ATen's vectorized SLEEF functions (exported by libtorch_cpu).
extern "C" __m512 Sleef_sinf16_u35(__m512);
extern "C" __m256 Sleef_expf8_u10(__m256);
extern "C" __m256 Sleef_sinf8_u35(__m256);

namespace t2w_simd {

// One vector type for the build's widest float lanes; loops step W at a time, tails are scalar.
#if defined(__AVX512F__)
constexpr int64_t W = 16;
using vf = __m512;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
// exp as Cephes' expf: n = round(x / ln 2), a degree-6 polynomial on the remainder, times 2^n
// (scalef); within ~1 ULP like SLEEF's u10 at a third of its cost here. Inputs clamp to
// [-88, 88] (exp of the clamp stays finite, and under 1e-38 below).
inline vf vexp(vf x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  const vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  vf p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
inline vf vsin(vf a) { return Sleef_sinf16_u35(a); }  // 3.5 ULP: a third cheaper than 1 ULP
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__)
constexpr int64_t W = 8;
using vf = __m256;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vexp(vf a) { return Sleef_expf8_u10(a); }
inline vf vsin(vf a) { return Sleef_sinf8_u35(a); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
constexpr int64_t W = 1;
using vf = float;
inline vf vload(const float* p) { return *p; }
inline void vstore(float* p, vf v) { *p = v; }
inline vf vset(float x) { return x; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vexp(vf a) { return std::exp(a); }
inline vf vsin(vf a) { return std::sin(a); }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmax(vf a, vf b) { return std::max(a, b); }
inline vf vdiv(vf a, vf b) { return a / b; }
inline float vsum(vf a) { return a; }
#endif

inline void check_float_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

inline void check_vector(const torch::Tensor& t, int64_t n, const char* name) {
  check_float_cpu(t, name);
  TORCH_CHECK(t.numel() == n, name, " must hold ", n, " values");
}

// A pre-norm's optional gated residual (h += gate * y): y [same shape as h] and gate [d] come
// together or not at all. Raw pointers, null when absent.
struct GatedResidual {
  const float* y = nullptr;
  const float* gate = nullptr;
};

inline GatedResidual gated_residual(const torch::Tensor& h, const c10::optional<torch::Tensor>& y,
                                    const c10::optional<torch::Tensor>& gate, int64_t d) {
  TORCH_CHECK(y.has_value() == gate.has_value(), "y and gate come together");
  if (!y.has_value()) return {};
  check_float_cpu(*y, "y");
  TORCH_CHECK(y->sizes() == h.sizes(), "y and h differ in shape");
  check_vector(*gate, d, "gate");
  return {y->data_ptr<float>(), gate->data_ptr<float>()};
}

// 1 + scale, the LayerNorm's modulated weight.
inline std::vector<float> one_plus(const torch::Tensor& scale) {
  const float* sc = scale.data_ptr<float>();
  std::vector<float> out(scale.numel());
  for (size_t i = 0; i < out.size(); ++i) out[i] = 1.0f + sc[i];
  return out;
}

// One row of the DiT's pre-norm: x += gate * y (when y is given), then
// out = LayerNorm(x) * one_plus_scale + shift (one_plus_scale = 1 + scale, precomputed).
// Rows of whole vectors (the DiT's widths) take the vector path: lane-wise partial sums, one
// horizontal sum each for the mean and the variance.
inline void modulated_norm_row(float* x, const float* y, const float* gate, const float* one_plus_scale,
                               const float* shift, int64_t d, float eps, float* out) {
  const float inv_d = 1.0f / static_cast<float>(d);
  if (d % W == 0) {
    vf sum = vset(0.f);
    for (int64_t i = 0; i < d; i += W) {
      vf v = vload(x + i);
      if (y != nullptr) {
        v = vadd(v, vmul(vload(gate + i), vload(y + i)));
        vstore(x + i, v);
      }
      sum = vadd(sum, v);
    }
    const float mean = vsum(sum) * inv_d;
    const vf vmean = vset(mean);
    vf var = vset(0.f);
    for (int64_t i = 0; i < d; i += W) {
      const vf c = vsub(vload(x + i), vmean);
      var = vadd(var, vmul(c, c));
    }
    const vf rstd = vset(1.0f / std::sqrt(vsum(var) * inv_d + eps));
    for (int64_t i = 0; i < d; i += W) {
      const vf c = vmul(vsub(vload(x + i), vmean), rstd);
      vstore(out + i, vadd(vmul(c, vload(one_plus_scale + i)), vload(shift + i)));
    }
    return;
  }
  if (y != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) x[i] = x[i] + gate[i] * y[i];
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += x[i];
  const float mean = sum * inv_d;
  float var = 0.f;
#pragma omp simd reduction(+ : var)
  for (int64_t i = 0; i < d; ++i) var += (x[i] - mean) * (x[i] - mean);
  const float rstd = 1.0f / std::sqrt(var * inv_d + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = ((x[i] - mean) * rstd) * one_plus_scale[i] + shift[i];
}

// GELU with the tanh approximation, 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), as
// x / (1 + exp(-2u)) (the same function: 0.5 (1 + tanh(u)) = sigmoid(2u)); SLEEF's tanh costs
// several times its exp here.
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;
inline vf gelu_tanh_vec(vf v) {
  const vf inner = vmul(vset(-2.0f * kGeluBeta), vadd(v, vmul(vset(kGeluKappa), vmul(vmul(v, v), v))));
  const vf den = vadd(vset(1.0f), vexp(inner));
  return vdiv(v, den);
}
inline float gelu_tanh_scalar(float v) {
  return v / (1.0f + std::exp(-2.0f * kGeluBeta * (v + kGeluKappa * (v * v * v))));
}

}  // namespace t2w_simd
