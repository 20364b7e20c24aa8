// The KV-cache write and paged decode attention of a CPU decoder step (float32 queries, a
// float32 or float16 cache: kv_cache_dtype): one call a layer for every decode row of a
// step, each row's keys read in place through its block table at its own length (no
// gather, no mask). What inlinelm's torch attention computes
// (inlinelm/gpu/attention/torch_backend.py), the sums in vector lanes; a float16 cache's
// keys and values are widened as they are read (exactly), so it computes what a float32
// cache holding the same rounded values would, to the bit.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_checks.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace inlinelm;

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#if INLINELM_VEC
  Vec acc = zero();
  for (; i + kLanes <= n; i += kLanes) acc = fma(load(a + i), load(b + i), acc);
  s = total(acc);
#endif
  for (; i < n; ++i) s += a[i] * to_float(b[i]);
  return s;
}

template <typename T>
inline void axpy(float* y, float a, const T* x, int64_t n) {  // y += a * x
  int64_t i = 0;
#if INLINELM_VEC
  const Vec va = splat(a);
  for (; i + kLanes <= n; i += kLanes) store(y + i, fma(va, load(x + i), load(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * to_float(x[i]);
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

// Softmax-weighted values of one KV head's G query heads over keys [lo, len) of one
// sequence (a cache of T: float or c10::Half); ``scores`` holds G * (len - lo) floats,
// ``acc`` G * D.
template <typename T>
struct DecodeArgs {
  const float* q;
  int64_t q_head_stride;
  const T* keys;    // cache[0]
  const T* values;  // cache[1]
  const int64_t* table;
  int64_t block_size, kv_heads, D, G;
  float scale, softcap;
};

// Keys [lo, len) of one sequence page by page: a page's slots are adjacent, so its keys
// are one strided run. visit(i, offset) for key lo + i at offset (of kv head kvh) in a cache.
template <typename Args, typename Visit>
inline void for_each_key(const Args& a, int64_t kvh, int64_t lo, int64_t len, Visit&& visit) {
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
template <int NV, typename T>
void decode_head_vec(const DecodeArgs<T>& a, int64_t kvh, int64_t lo, int64_t len, float* scores,
                     float* out, int64_t out_head_stride) {
  const int64_t n = len - lo, G = a.G;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = a.q + (kvh * G + g) * a.q_head_stride;
    float* sg = scores + g * n;
    Vec q[NV];
    for (int v = 0; v < NV; ++v) q[v] = load(qg + v * kLanes);
    float best = -std::numeric_limits<float>::infinity();
    for_each_key(a, kvh, lo, len, [&](int64_t i, int64_t at) {
      const T* k = a.keys + at;
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
      const T* x = a.values + at;
      const Vec w = splat(sg[i]);
      for (int v = 0; v < NV; ++v) acc[v] = fma(w, load(x + v * kLanes), acc[v]);
    });
    float* y = out + (kvh * G + g) * out_head_stride;
    for (int v = 0; v < NV; ++v) store(y + v * kLanes, mul(acc[v], splat(inv)));
  }
}
#endif

template <typename T>
void decode_head(const DecodeArgs<T>& a, int64_t kvh, int64_t lo, int64_t len, float* scores,
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
    const T* k = a.keys + at;
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
    const T* v = a.values + at;
    for (int64_t g = 0; g < G; ++g) axpy(acc + g * D, scores[g * n + i], v, D);
  });
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / sums[g];
    float* y = out + (kvh * G + g) * out_head_stride;
    for (int64_t i = 0; i < D; ++i) y[i] = acc[g * D + i] * inv;
  }
}

// Rows t of k and v into their slots of a cache of T (float16: rounded to nearest even).
template <typename T>
void write_rows(T* keys, T* values, const torch::Tensor& k, const torch::Tensor& v,
                const int64_t* slots, int64_t KVH, int64_t D) {
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  auto put = [D](T* dst, const float* src) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst, src, D * sizeof(float));
    } else {
      int64_t i = 0;
#if INLINELM_VEC
      for (; i + kLanes <= D; i += kLanes) store(dst + i, load(src + i));
#endif
      for (; i < D; ++i) dst[i] = static_cast<T>(src[i]);
    }
  };
  for (int64_t t = 0; t < k.size(0); ++t)
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = (slots[t] * KVH + h) * D;
      put(keys + dst, kp + t * k.stride(0) + h * k.stride(1));
      put(values + dst, vp + t * v.stride(0) + h * v.stride(1));
    }
}

template <typename T>
void decode_rows(const DecodeArgs<T>& base, const torch::Tensor& q, const int64_t* tables,
                 int64_t rs, const int64_t* lens, int64_t window, int64_t longest, float* op) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = base.kv_heads, G = base.G;
  const float* qp = q.data_ptr<float>();
  at::parallel_for(0, B * KVH, grain(2 * G * longest * D), [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(G * longest), acc(G * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / KVH, kvh = i % KVH, len = lens[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      DecodeArgs<T> a = base;
      a.q = qp + b * q.stride(0);
      a.table = tables + b * rs;
      decode_head(a, kvh, lo, len, scores.data(), acc.data(), op + b * H * D, D);
    }
  });
}

void check_cache(const torch::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu() && (kv_cache.scalar_type() == torch::kFloat32 ||
                                             kv_cache.scalar_type() == torch::kFloat16),
              "kv_cache must be a float32 or float16 CPU tensor");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, slots, KVH, D]");
}

}  // namespace

void write_kv(torch::Tensor& kv_cache, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& slots) {
  check_cache(kv_cache);
  check_rows(k, "k");
  check_rows(v, "v");
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
  if (kv_cache.scalar_type() == torch::kFloat16) {
    c10::Half* keys = kv_cache.data_ptr<c10::Half>();
    write_rows(keys, keys + S * KVH * D, k, v, sp, KVH, D);
  } else {
    float* keys = kv_cache.data_ptr<float>();
    write_rows(keys, keys + S * KVH * D, k, v, sp, KVH, D);
  }
}

torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& kv_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                           int64_t block_size, double scale, int64_t window, double softcap) {
  check_rows(q, "q");
  check_cache(kv_cache);
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]");
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
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  if (kv_cache.scalar_type() == torch::kFloat16) {
    const c10::Half* keys = kv_cache.data_ptr<c10::Half>();
    const DecodeArgs<c10::Half> base{nullptr, q.stride(1), keys, keys + S * KVH * D, nullptr,
                                     block_size, KVH, D, G, sc, cap};
    decode_rows(base, q, tables, rs, lens, window, longest, op);
  } else {
    const float* keys = kv_cache.data_ptr<float>();
    const DecodeArgs<float> base{nullptr, q.stride(1), keys, keys + S * KVH * D, nullptr,
                                 block_size, KVH, D, G, sc, cap};
    decode_rows(base, q, tables, rs, lens, window, longest, op);
  }
  return out;
}
