// Block-quantized weights and y = x @ W.T (+ bias) with them: GGUF's Q8_0, Q4_0 and Q4_1,
// 32 weights a block with float16 scales. The activations are rounded per block of 32 to
// 16 bits, as two int8 planes (x ~ xd * (256 xh + xl)), and each block's dot product is
// exact integer arithmetic, one plane at a time; only the scales are floats:
//   Q8_0  w = d * q,        q in [-127, 127]   sum_k w x = d * xd * sum q xq
//   Q4_0  w = d * (q - 8),  q in [0, 15]       d * xd * (sum q xq - 8 sum xq)
//   Q4_1  w = d * q + m,    q in [0, 15]       d * xd * sum q xq + m * xd * sum xq
// with xq = 256 xh + xl. Q4_1's m multiplies the rounded sum, not the exact one: the
// rounding errors of a block then meet the weights w = d q + m, which are centred, not d q,
// which are not (m ~ -8 d): the exact sum tripled the error of the default model's
// projections.
//
// Why 16 bits: llama.cpp rounds the activations to 8 (Q8_0/Q8_1 blocks of 32, Q8_K of 256),
// and on the default model that alone moved the top-1 token at 2.5% of teacher-forced
// positions; at 16 bits the blocks' own rounding is all that is left. The second plane
// costs a second pass of dot products: free where a step reads weights from memory (a few
// rows), about 1.5-1.7x the time where it computes (many rows). There, from 64 rows on a CPU
// with AMX, block_linear_amx.cpp takes bfloat16 products instead.
//
// Four implementations of one arithmetic: AMX's int8 tiles for 16 to 63 rows where the CPU
// has them (block_linear_amx_int8.cpp), AVX-512 VNNI where it has that (compiled for this
// machine at first use), AVX2 where it has not, and plain C++ everywhere; the integer sums
// are exact and the float steps are the same operations in the same order, so all give the
// same bits.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "block_tiles.h"
#include "ops.h"

namespace {

using namespace inlinelm::blocks;

// One block of 32 activations into its planes (see Activations); returns the planes' sums.
inline std::pair<int32_t, int32_t> quantize_block(const float* x, float inv, int8_t* high,
                                                  int8_t* low) {
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv), scale = _mm512_set1_ps(256.0f);
  const __m512 top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512i high_sum = _mm512_setzero_si512(), low_sum = _mm512_setzero_si512();
  for (int i = 0; i < kBlock; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), vinv);
    const __m512 h = _mm512_roundscale_ps(v, kNearest);
    __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, h), scale), kNearest);
    l = _mm512_min_ps(top, _mm512_max_ps(bottom, l));
    const __m512i hi = _mm512_cvtps_epi32(h), li = _mm512_cvtps_epi32(l);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(high + i), _mm512_cvtepi32_epi8(hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(low + i), _mm512_cvtepi32_epi8(li));
    high_sum = _mm512_add_epi32(high_sum, hi);
    low_sum = _mm512_add_epi32(low_sum, li);
  }
  return {_mm512_reduce_add_epi32(high_sum), _mm512_reduce_add_epi32(low_sum)};
#else
  int32_t high_sum = 0, low_sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    const float v = x[i] * inv;
    const float h = std::nearbyint(v);
    const float l = std::min(127.0f, std::max(-127.0f, std::nearbyint((v - h) * 256.0f)));
    high[i] = static_cast<int8_t>(h);
    low[i] = static_cast<int8_t>(l);
    high_sum += high[i];
    low_sum += low[i];
  }
  return {high_sum, low_sum};
#endif
}

// The activations' planes and sums, rows past M (to padded rows) zero.
Activations quantize_activations(const float* x, int64_t M, int64_t K, int64_t padded) {
  const int64_t G = K / kBlock;
  Activations a{M,
                K,
                G,
                padded,
                std::vector<int8_t>(padded * K),
                std::vector<int8_t>(padded * K),
                std::vector<float>(padded * G),
                std::vector<float>(padded * G),
                std::vector<int32_t>(padded * G),
                std::vector<int32_t>(padded * G)};
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const float* xb = x + r * K + g * kBlock;
        float amax = 0.0f;
        for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const int64_t ag = r * G + g;
        const auto [high_sum, low_sum] =
            quantize_block(xb, inv, a.high.data() + r * K + g * kBlock, a.low.data() + r * K + g * kBlock);
        a.d[ag] = amax / 127.0f / 256.0f;
        a.sum[ag] = a.d[ag] * static_cast<float>(256 * high_sum + low_sum);
        a.high_sum[ag] = high_sum;
        a.low_sum[ag] = low_sum;
      }
  });
  return a;
}

// The plain implementation: R activation rows against tile t's 16 rows.
template <int R>
void tile_plain(const Call& c, int64_t r0, int64_t t) {
  const Format& f = c.f;
  const Activations& a = *c.a;
  float acc[R][kTileRows] = {};
  for (int64_t g = 0; g < f.groups; ++g) {
    const uint8_t* tile = c.w + (t * f.groups + g) * f.tile_bytes;
    for (int r = 0; r < R; ++r) {
      const int8_t* high = a.high.data() + (r0 + r) * a.cols + g * kBlock;
      const int8_t* low = a.low.data() + (r0 + r) * a.cols + g * kBlock;
      const int64_t ag = (r0 + r) * a.groups + g;
      for (int64_t j = 0; j < kTileRows; ++j) {
        int32_t s = start_of(f.kind, a.high_sum[ag]);
        for (int64_t i = 0; i < kBlock; ++i) s += stored(f, tile, j, i) * high[i];
        s = s * 256 + start_of(f.kind, a.low_sum[ag]);
        for (int64_t i = 0; i < kBlock; ++i) s += stored(f, tile, j, i) * low[i];
        const float scale = half_to_float(tile_d(tile)[j]) * a.d[ag];
        acc[r][j] = std::fma(static_cast<float>(s), scale, acc[r][j]);
        if (f.kind == kQ4_1) acc[r][j] = std::fma(half_to_float(tile_m(tile)[j]), a.sum[ag], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kTileRows && t * kTileRows + j < f.rows; ++j) {
      const int64_t n = t * kTileRows + j;
      c.y[(r0 + r) * f.rows + n] = acc[r][j] + (c.bias ? c.bias[n] : 0.0f);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define INLINELM_VNNI 1

// One plane of R activation rows (x, row stride K, at the block) into the NB tiles' sums.
template <int R, int NB>
inline void dot_plane(const uint8_t* const* w, const int8_t* x, int64_t K, __m512i (&sum)[R][NB]) {
  for (int quad = 0; quad < 8; ++quad) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w[j] + quad * 64);
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      std::memcpy(&x4, x + r * K + quad * 4, 4);
      const __m512i xv = _mm512_set1_epi32(x4);
      for (int j = 0; j < NB; ++j) sum[r][j] = _mm512_dpbusd_epi32(sum[r][j], wv[j], xv);
    }
  }
}

// R activation rows against the NB tiles from t: NB x R accumulators of 16 lanes.
template <int64_t KIND, int R, int NB>
void tiles_vnni(const Call& c, int64_t r0, int64_t t) {
  const Format& f = c.f;
  const Activations& a = *c.a;
  const int64_t G = f.groups, K = a.cols;
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  alignas(64) uint8_t buffer[NB][512];
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* tile[NB];
    for (int j = 0; j < NB; ++j) tile[j] = c.w + ((t + j) * G + g) * f.tile_bytes;
    __m512i sum[R][NB];
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(start_of(KIND, a.high_sum[(r0 + r) * G + g]));
      for (int j = 0; j < NB; ++j) sum[r][j] = start;
    }
    const uint8_t* w[NB];
    for (int j = 0; j < NB; ++j) w[j] = quads<KIND>(tile[j] + f.weights_at, buffer[j]);
    const int64_t x_at = r0 * K + g * kBlock;
    dot_plane<R, NB>(w, a.high.data() + x_at, K, sum);
    for (int r = 0; r < R; ++r) {
      const __m512i start = _mm512_set1_epi32(start_of(KIND, a.low_sum[(r0 + r) * G + g]));
      for (int j = 0; j < NB; ++j) sum[r][j] = _mm512_add_epi32(_mm512_slli_epi32(sum[r][j], 8), start);
    }
    dot_plane<R, NB>(w, a.low.data() + x_at, K, sum);
    for (int j = 0; j < NB; ++j) {
      const __m512 d = load_halves(tile_d(tile[j]));
      __m512 m = _mm512_setzero_ps();
      if constexpr (KIND == kQ4_1) m = load_halves(tile_m(tile[j]));
      for (int r = 0; r < R; ++r) {
        const int64_t ag = (r0 + r) * G + g;
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.d[ag]));
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][j]), scale, acc[r][j]);
        if constexpr (KIND == kQ4_1) acc[r][j] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sum[ag]), acc[r][j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = (t + j) * kTileRows;
    const int64_t valid = std::min<int64_t>(kTileRows, f.rows - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = c.bias ? _mm512_maskz_loadu_ps(mask, c.bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(c.y + (r0 + r) * f.rows + n0, mask, _mm512_add_ps(acc[r][j], b));
  }
}

// Rows [r, M) against tiles [t0, t1).
template <int64_t KIND>
void tiles_range_vnni(const Call& c, int64_t r, int64_t M, int64_t t0, int64_t t1) {
  for (; r + 4 <= M; r += 4) {
    int64_t t = t0;
    for (; t + 2 <= t1; t += 2) tiles_vnni<KIND, 4, 2>(c, r, t);
    for (; t < t1; ++t) tiles_vnni<KIND, 4, 1>(c, r, t);
  }
  for (; r < M; ++r) {
    int64_t t = t0;
    for (; t + 4 <= t1; t += 4) tiles_vnni<KIND, 1, 4>(c, r, t);
    for (; t < t1; ++t) tiles_vnni<KIND, 1, 1>(c, r, t);
  }
}

#else
#define INLINELM_VNNI 0
#endif

void tiles_range_plain(const Call& c, int64_t M, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) tile_plain<4>(c, r, t);
    for (; r < M; ++r) tile_plain<1>(c, r, t);
  }
}

// Which loops run: the fastest this machine has for the call's rows (the bfloat16 products
// from kBf16Rows rows where bf16_ready(), AMX's int8 tiles from kAmxRows where
// amx_ready()), the fastest integer loops, other integer ones (the same bits from each
// integer implementation), or the bfloat16 products at any rows.
enum Loops : int64_t { kFastest = 0, kAvx2 = 1, kPlain = 2, kInteger = 3, kBf16 = 4, kAmx = 5 };

// From this many rows the bfloat16 products beat the integer loops (the default model's
// shapes on 2 cores: benchmarks/quantized_cpu.py's kernel table).
constexpr int64_t kBf16Rows = 64;
constexpr int64_t kAmxRows = 16;  // AMX multiplies 16 rows a tile: fewer would be padding

// Whether a call of M rows takes AMX's int8 tiles (its activations are then padded to whole
// tiles of 16 rows).
bool takes_amx(int64_t M, int64_t loops) {
  return loops == kAmx || (loops == kFastest && M >= kAmxRows && amx_ready());
}

void tiles_range(const Call& c, int64_t M, int64_t t0, int64_t t1, int64_t loops) {
  if (takes_amx(M, loops)) return tiles_range_amx(c, M, t0, t1);
#if INLINELM_VNNI
  if (loops == kFastest || loops == kInteger) {
    if (c.f.kind == kQ8_0) return tiles_range_vnni<kQ8_0>(c, 0, M, t0, t1);
    if (c.f.kind == kQ4_0) return tiles_range_vnni<kQ4_0>(c, 0, M, t0, t1);
    return tiles_range_vnni<kQ4_1>(c, 0, M, t0, t1);
  }
#endif
  if (loops != kPlain && avx2_built()) return tiles_range_avx2(c, M, t0, t1);
  tiles_range_plain(c, M, t0, t1);
}

// Tiles per pass over the activation rows: their weights stay in the core's cache while
// every row passes over them (a pass of many rows over all of a thread's tiles would read
// them from memory again for each block of rows).
int64_t tiles_per_pass(const Format& f) {
  constexpr int64_t kPassBytes = 256 << 10;
  return std::max<int64_t>(4, kPassBytes / (f.groups * f.tile_bytes) / 4 * 4);
}

}  // namespace


std::string block_loops() { return INLINELM_VNNI ? "vnni" : avx2_built() ? "avx2" : "plain"; }

bool block_bf16_ready() { return bf16_ready(); }

bool block_amx_ready() { return amx_ready(); }

torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& data, int64_t kind,
                           int64_t rows, int64_t cols, const c10::optional<torch::Tensor>& bias,
                           int64_t loops) {
  const Format f = format_of(kind, rows, cols);
  check_packed(data, f);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns, the weights ", cols);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == rows && bias->scalar_type() == torch::kFloat32 &&
                    bias->is_contiguous(),
                "the bias must be ", rows, " contiguous float32 values");
    b = bias->data_ptr<float>();
  }
  TORCH_CHECK(loops >= kFastest && loops <= kAmx, "unknown loops ", loops);
  TORCH_CHECK(loops != kAmx || amx_ready(), "the AMX loops need AMX-INT8");
  const int64_t M = x.size(0);
  auto y = torch::empty({M, rows}, x.options());
  if (M == 0) return y;
  if (loops == kBf16 || (loops == kFastest && M >= kBf16Rows && bf16_ready())) {
    linear_bf16(f, data.data_ptr<uint8_t>(), x.data_ptr<float>(), M, b, y.data_ptr<float>());
    return y;
  }
  const int64_t padded = takes_amx(M, loops) ? (M + 15) / 16 * 16 : M;
  const Activations a = quantize_activations(x.data_ptr<float>(), M, cols, padded);
  const Call c{f, data.data_ptr<uint8_t>(), &a, b, y.data_ptr<float>()};
  // NOTE: tiles split over the threads, 4 at a time (64 rows: a few KiB of weights a
  // group), every activation row against each, so a tile is read from memory once.
  const int64_t pass = tiles_per_pass(f);
  at::parallel_for(0, f.tiles, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t += pass) tiles_range(c, M, t, std::min(t1, t + pass), loops);
  });
  return y;
}
