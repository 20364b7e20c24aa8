// The float32 kernels of a CPU decoder step besides its matmuls, one call each where torch
// takes several ops (a CPU decode step at batch 1 is bound by per-op dispatch, not by
// arithmetic): RMSNorm alone and with the residual add, RoPE in place, the gated
// activations (the KV-cache write and paged decode attention: paged_attention.cpp).
//
// Each computes what inlinelm's torch kernels compute (inlinelm/gpu/model/kernels.py,
// inlinelm/gpu/attention/torch_backend.py), in the same order of operations where it
// matters; sums run in vector lanes, so results differ from torch's in the last bits only.
// Rows are split over intra-op threads only when a call is big enough to gain from it.
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_checks.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace inlinelm;

inline float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#if INLINELM_VEC
  Vec acc = zero();
  for (; i + kLanes <= n; i += kLanes) {
    const Vec v = load(x + i);
    acc = fma(v, v, acc);
  }
  s = total(acc);
#endif
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// y = x * inv * (offset + w)
inline void scale_row(const float* x, float* y, const float* w, int64_t n, float inv, float offset) {
  int64_t i = 0;
#if INLINELM_VEC
  const Vec vi = splat(inv), vo = splat(offset);
  for (; i + kLanes <= n; i += kLanes) store(y + i, mul(mul(load(x + i), vi), add(vo, load(w + i))));
#endif
  for (; i < n; ++i) y[i] = x[i] * inv * (offset + w[i]);
}

inline float inverse_rms(const float* x, int64_t n, float eps) {
  return 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
}

enum class Gate { kSilu, kGeluTanh };

template <Gate G>
inline float gate_scalar(float g) {
  if constexpr (G == Gate::kSilu) {
    return g / (1.0f + std::exp(-g));
  } else {
    const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.0f + std::tanh(u));
  }
}

#if INLINELM_VEC
template <Gate G>
inline Vec gate_vec(Vec g) {
  const Vec one = splat(1.0f);
  if constexpr (G == Gate::kSilu) {
    return div(g, add(one, inlinelm::exp(sub(zero(), g))));
  } else {
    const Vec u = mul(splat(0.7978845608028654f), fma(mul(splat(0.044715f), g), mul(g, g), g));
    // tanh(u) = 1 - 2 / (e^(2u) + 1): -1 and 1 at the clamped ends of exp
    const Vec t = sub(one, div(splat(2.0f), add(inlinelm::exp(add(u, u)), one)));
    return mul(mul(splat(0.5f), g), add(one, t));
  }
}
#endif

template <Gate G>
torch::Tensor gate_and_mul(const torch::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2 * I]");
  const int64_t T = x.size(0), I = x.size(1) / 2, stride = x.stride(0);
  auto out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = xp + t * stride;
      const float* u = g + I;
      float* y = op + t * I;
      int64_t i = 0;
#if INLINELM_VEC
      for (; i + kLanes <= I; i += kLanes) store(y + i, mul(gate_vec<G>(load(g + i)), load(u + i)));
#endif
      for (; i < I; ++i) y[i] = gate_scalar<G>(g[i]) * u[i];
    }
  });
  return out;
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       double offset) {
  check_rows(x, "x");
  check_float(weight, "weight");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "x must be [T, D] or [T, H, D]");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == D, "weight must be [", D, "]");
  const int64_t A = x.size(0), B = x.dim() == 3 ? x.size(1) : 1;
  const int64_t sa = x.stride(0), sb = x.dim() == 3 ? x.stride(1) : 0;
  auto out = torch::empty(x.sizes(), x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps), off = static_cast<float>(offset);
  at::parallel_for(0, A * B, grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + (r / B) * sa + (r % B) * sb;
      scale_row(row, op + r * D, w, D, inverse_rms(row, D, e), off);
    }
  });
  return out;
}

void add_rms_norm(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                  double eps, double offset) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_float(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes(), "x and residual must be one [T, D]");
  const int64_t T = x.size(0), D = x.size(1), sx = x.stride(0), sr = residual.stride(0);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == D, "weight must be [", D, "]");
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps), off = static_cast<float>(offset);
  at::parallel_for(0, T, grain(D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* xr = xp + t * sx;
      float* rr = rp + t * sr;
      int64_t i = 0;
#if INLINELM_VEC
      for (; i + kLanes <= D; i += kLanes) store(rr + i, add(load(xr + i), load(rr + i)));
#endif
      for (; i < D; ++i) rr[i] = xr[i] + rr[i];
      scale_row(rr, xr, w, D, inverse_rms(rr, D, e), off);
    }
  });
}

void rope(torch::Tensor& qk, const torch::Tensor& positions, const torch::Tensor& cos_sin_cache) {
  check_rows(qk, "qk");
  check_float(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(qk.dim() == 3, "qk must be [T, H, D]");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be a contiguous [positions, rotary_dim]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 1 &&
                  positions.is_contiguous() && positions.size(0) == qk.size(0),
              "positions must be a contiguous int64 [T]");
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2);
  const int64_t P = cos_sin_cache.size(0), rot = cos_sin_cache.size(1), half = rot / 2;
  TORCH_CHECK(rot % 2 == 0 && rot <= D, "the table's width must be even and at most ", D);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " is outside the table [0, ", P, ")");
  float* base = qk.data_ptr<float>();
  const float* table = cos_sin_cache.data_ptr<float>();
  const int64_t s0 = qk.stride(0), s1 = qk.stride(1);
  at::parallel_for(0, T * H, grain(rot), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r / H;
      float* x = base + t * s0 + (r % H) * s1;
      const float* c = table + pos[t] * rot;
      const float* s = c + half;
      int64_t i = 0;
#if INLINELM_VEC
      for (; i + kLanes <= half; i += kLanes) {
        const Vec x1 = load(x + i), x2 = load(x + half + i), vc = load(c + i), vs = load(s + i);
        store(x + i, sub(mul(x1, vc), mul(x2, vs)));
        store(x + half + i, add(mul(x2, vc), mul(x1, vs)));
      }
#endif
      for (; i < half; ++i) {
        const float x1 = x[i], x2 = x[half + i];
        x[i] = x1 * c[i] - x2 * s[i];
        x[half + i] = x2 * c[i] + x1 * s[i];
      }
    }
  });
}

torch::Tensor silu_and_mul(const torch::Tensor& x) { return gate_and_mul<Gate::kSilu>(x); }

torch::Tensor gelu_tanh_and_mul(const torch::Tensor& x) { return gate_and_mul<Gate::kGeluTanh>(x); }
