// The float32 kernels of a CPU decoder step besides its matmuls, one call each where torch
// takes several ops (a CPU decode step at batch 1 is bound by per-op dispatch, not by
// arithmetic): RMSNorm alone and with the residual add, RoPE in place, the gated
// activations, the KV-cache write and paged decode attention.
//
// Each computes what inlinelm's torch kernels compute (inlinelm/gpu/model/kernels.py,
// inlinelm/gpu/attention/torch_backend.py), in the same order of operations where it
// matters; sums run in vector lanes, so results differ from torch's in the last bits only.
// Rows are split over intra-op threads only when a call is big enough to gain from it.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace inlinelm;

constexpr int64_t kSerialWork = 1 << 16;  // elements (or MACs) below which a call is serial

inline int64_t grain(int64_t work_per_item) {
  return std::max<int64_t>(1, kSerialWork / std::max<int64_t>(work_per_item, 1));
}

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name,
              " must be a float32 CPU tensor");
}

void check_rows(const torch::Tensor& t, const char* name) {
  check_float(t, name);
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, "'s last dimension must be contiguous");
}

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

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#if INLINELM_VEC
  Vec acc = zero();
  for (; i + kLanes <= n; i += kLanes) acc = fma(load(a + i), load(b + i), acc);
  s = total(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {  // y += a * x
  int64_t i = 0;
#if INLINELM_VEC
  const Vec va = splat(a);
  for (; i + kLanes <= n; i += kLanes) store(y + i, fma(va, load(x + i), load(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
}

// x[i] = exp(x[i] - m); returns their sum
inline float exp_shifted(float* x, int64_t n, float m) {
  int64_t i = 0;
  float s = 0.0f;
#if INLINELM_VEC
  const Vec vm = splat(m);
  Vec acc = zero();
  for (; i + kLanes <= n; i += kLanes) {
    const Vec e = inlinelm::exp(sub(load(x + i), vm));
    store(x + i, e);
    acc = add(acc, e);
  }
  s = total(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  return s;
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

// Softmax-weighted values of one KV head's G query heads over keys [lo, len) of one
// sequence; ``scores`` holds G * (len - lo) floats, ``acc`` G * D.
struct DecodeArgs {
  const float* q;
  int64_t q_head_stride;
  const float* keys;    // cache[0]
  const float* values;  // cache[1]
  const int64_t* table;
  int64_t block_size, kv_heads, D, G;
  float scale, softcap;
};

// Keys [lo, len) of one sequence page by page: a page's slots are adjacent, so its keys
// are one strided run. visit(i, offset) for key lo + i at offset (of kv head kvh) in a cache.
template <typename Visit>
inline void for_each_key(const DecodeArgs& a, int64_t kvh, int64_t lo, int64_t len, Visit&& visit) {
  const int64_t bs = a.block_size, stride = a.kv_heads * a.D;
  for (int64_t page = lo / bs, j = lo; j < len; ++page) {
    const int64_t end = std::min(len, (page + 1) * bs);
    for (int64_t slot = a.table[page] * bs + j - page * bs; j < end; ++j, ++slot)
      visit(j - lo, slot * stride + kvh * a.D);
  }
}

#if INLINELM_VEC
// decode_head for D = NV vectors: one query head at a time, its query and its sum of
// values in registers (the same operations in the same order as the loops below, so the
// same bits; the sum no longer goes through memory for every key).
template <int NV>
void decode_head_vec(const DecodeArgs& a, int64_t kvh, int64_t lo, int64_t len, float* scores,
                     float* out, int64_t out_head_stride) {
  const int64_t n = len - lo, G = a.G;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = a.q + (kvh * G + g) * a.q_head_stride;
    float* sg = scores + g * n;
    Vec q[NV];
    for (int v = 0; v < NV; ++v) q[v] = load(qg + v * kLanes);
    float best = -std::numeric_limits<float>::infinity();
    for_each_key(a, kvh, lo, len, [&](int64_t i, int64_t at) {
      const float* k = a.keys + at;
      Vec acc = zero();
      for (int v = 0; v < NV; ++v) acc = fma(q[v], load(k + v * kLanes), acc);
      float s = total(acc) * a.scale;
      if (a.softcap > 0.0f) s = a.softcap * std::tanh(s / a.softcap);
      sg[i] = s;
      best = std::max(best, s);
    });
    const float inv = 1.0f / exp_shifted(sg, n, best);
    Vec acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = zero();
    for_each_key(a, kvh, lo, len, [&](int64_t i, int64_t at) {
      const float* x = a.values + at;
      const Vec w = splat(sg[i]);
      for (int v = 0; v < NV; ++v) acc[v] = fma(w, load(x + v * kLanes), acc[v]);
    });
    float* y = out + (kvh * G + g) * out_head_stride;
    for (int v = 0; v < NV; ++v) store(y + v * kLanes, mul(acc[v], splat(inv)));
  }
}
#endif

void decode_head(const DecodeArgs& a, int64_t kvh, int64_t lo, int64_t len, float* scores,
                 float* acc, float* out, int64_t out_head_stride) {
  const int64_t n = len - lo, D = a.D, G = a.G;
#if INLINELM_VEC
  switch (D) {
    case 4 * kLanes: return decode_head_vec<4>(a, kvh, lo, len, scores, out, out_head_stride);
    case 8 * kLanes: return decode_head_vec<8>(a, kvh, lo, len, scores, out, out_head_stride);
    default: break;
  }
#endif
  std::vector<float> best(G, -std::numeric_limits<float>::infinity());
  for_each_key(a, kvh, lo, len, [&](int64_t i, int64_t at) {
    const float* k = a.keys + at;
    for (int64_t g = 0; g < G; ++g) {
      float s = dot(a.q + (kvh * G + g) * a.q_head_stride, k, D) * a.scale;
      if (a.softcap > 0.0f) s = a.softcap * std::tanh(s / a.softcap);
      scores[g * n + i] = s;
      best[g] = std::max(best[g], s);
    }
  });
  std::vector<float> sums(G);
  for (int64_t g = 0; g < G; ++g) sums[g] = exp_shifted(scores + g * n, n, best[g]);
  std::fill(acc, acc + G * D, 0.0f);
  for_each_key(a, kvh, lo, len, [&](int64_t i, int64_t at) {
    const float* v = a.values + at;
    for (int64_t g = 0; g < G; ++g) axpy(acc + g * D, scores[g * n + i], v, D);
  });
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / sums[g];
    float* y = out + (kvh * G + g) * out_head_stride;
    for (int64_t i = 0; i < D; ++i) y[i] = acc[g * D + i] * inv;
  }
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

void write_kv(torch::Tensor& kv_cache, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& slots) {
  check_float(kv_cache, "kv_cache");
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, slots, KVH, D]");
  const int64_t S = kv_cache.size(1), KVH = kv_cache.size(2), D = kv_cache.size(3);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == KVH && k.size(2) == D,
              "k and v must be [T, ", KVH, ", ", D, "]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == k.size(0),
              "slots must be a contiguous int64 [T]");
  const int64_t T = k.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "slot ", sp[t], " is outside the cache [0, ", S, ")");
  float* keys = kv_cache.data_ptr<float>();
  float* values = keys + S * KVH * D;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = (sp[t] * KVH + h) * D;
      std::memcpy(keys + dst, kp + t * k.stride(0) + h * k.stride(1), D * sizeof(float));
      std::memcpy(values + dst, vp + t * v.stride(0) + h * v.stride(1), D * sizeof(float));
    }
  }
}

torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& kv_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                           int64_t block_size, double scale, int64_t window, double softcap) {
  check_rows(q, "q");
  check_float(kv_cache, "kv_cache");
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, slots, KVH, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t S = kv_cache.size(1), KVH = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == D && H % KVH == 0, "q and kv_cache disagree on heads");
  TORCH_CHECK(block_size > 0 && S % block_size == 0, "bad block_size ", block_size);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 &&
                  block_tables.size(0) == B && block_tables.stride(1) == 1,
              "block_tables must be int64 [B, blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous() && seq_lens.size(0) == B,
              "seq_lens must be a contiguous int64 [B]");
  const int64_t nb = block_tables.size(1), rs = block_tables.stride(0), num_blocks = S / block_size;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= nb * block_size, "sequence length ", lens[b],
                " is outside [1, ", nb * block_size, "]");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tables[b * rs + i] >= 0 && tables[b * rs + i] < num_blocks, "block ",
                  tables[b * rs + i], " is outside the cache [0, ", num_blocks, ")");
    longest = std::max(longest, lens[b]);
  }
  const int64_t G = H / KVH;
  if (window > 0) longest = std::min(longest, window);
  auto out = torch::empty({B, H, D}, q.options());
  const float* keys = kv_cache.data_ptr<float>();
  DecodeArgs base{nullptr, q.stride(1), keys, keys + S * KVH * D, nullptr, block_size, KVH, D, G,
                  static_cast<float>(scale), static_cast<float>(softcap)};
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * KVH, grain(2 * G * longest * D), [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(G * longest), acc(G * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / KVH, kvh = i % KVH, len = lens[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      DecodeArgs a = base;
      a.q = qp + b * q.stride(0);
      a.table = tables + b * rs;
      decode_head(a, kvh, lo, len, scores.data(), acc.data(), op + b * H * D, D);
    }
  });
  return out;
}
