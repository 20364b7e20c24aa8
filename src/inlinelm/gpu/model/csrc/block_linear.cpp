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
// rows), about 1.5-1.7x the time where it computes (many rows).
//
// The weights live in tiles of 16 rows x 32 columns (one block of each of 16 rows), tile
// (t, g) at byte (t * G + g) * tile_bytes, rows padded to a multiple of 16 with zeros:
//   [16 float16 d][16 float16 m, Q4_1 only][weights]
// Q8_0's weights are 8 quads: quad c holds, for row lane j, the 4 bytes q[4c .. 4c+3] + 128
// (unsigned: AVX-512 VNNI multiplies unsigned by signed bytes; the +128 is taken back with
// 128 * sum xq). Q4's are 4 chunks: chunk c holds, for lane j, 4 bytes whose low nibbles are
// q[8c .. 8c+3] and high nibbles q[8c+4 .. 8c+7]. A vector load is then one quad of 16 rows,
// which one instruction multiplies by a broadcast quad of one activation row: 16 rows' sums
// in the 16 lanes, no horizontal sums. A tile takes the GGUF block's bytes (34, 18, 20 per
// 32 weights), so weights kept this way take the file's size.
//
// Three implementations of one arithmetic: AVX-512 VNNI where the CPU has it (compiled for
// this machine at first use), AVX2 where it has not, and plain C++ everywhere; the integer
// sums are exact and the float steps are the same operations in the same order, so all give
// the same bits.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "ops.h"

namespace {

constexpr int64_t kBlock = 32;  // weights per block
constexpr int64_t kTileRows = 16;

enum Kind : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

struct Format {
  int64_t kind, rows, cols, groups, tiles;
  int64_t tile_bytes, weights_at;  // a tile's bytes, and where its weights start in it
  int64_t block_bytes;             // the GGUF block's
};

Format format_of(int64_t kind, int64_t rows, int64_t cols) {
  TORCH_CHECK(kind == kQ8_0 || kind == kQ4_0 || kind == kQ4_1, "unknown block kind ", kind);
  TORCH_CHECK(rows > 0 && cols > 0 && cols % kBlock == 0, "a [", rows, ", ", cols,
              "] matrix does not split into blocks of ", kBlock);
  Format f{kind, rows, cols, cols / kBlock, (rows + kTileRows - 1) / kTileRows, 0, 0, 0};
  const int64_t scales = kind == kQ4_1 ? 2 : 1;
  f.weights_at = scales * kTileRows * 2;
  f.tile_bytes = f.weights_at + kTileRows * (kind == kQ8_0 ? kBlock : kBlock / 2);
  f.block_bytes = f.tile_bytes / kTileRows;
  return f;
}

int64_t packed_bytes(const Format& f) { return f.tiles * f.groups * f.tile_bytes; }

void check_packed(const torch::Tensor& data, const Format& f) {
  TORCH_CHECK(data.scalar_type() == torch::kUInt8 && data.dim() == 1 && data.is_contiguous(),
              "packed weights must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(data.numel() == packed_bytes(f), "packed weights of [", f.rows, ", ", f.cols,
              "] take ", packed_bytes(f), " bytes, not ", data.numel());
}

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// One block of a GGUF row (Q8_0 {d, q[32]}, Q4_0 {d, qs[16]}, Q4_1 {d, m, qs[16]}; a Q4
// byte j holds q[j] low and q[j + 16] high) as its 32 quantized values (Q4: 0..15).
void unpack_block(int64_t kind, const uint8_t* block, int32_t* q) {
  if (kind == kQ8_0) {
    for (int i = 0; i < kBlock; ++i) q[i] = static_cast<int8_t>(block[2 + i]);
    return;
  }
  const uint8_t* qs = block + (kind == kQ4_1 ? 4 : 2);
  for (int i = 0; i < kBlock / 2; ++i) {
    q[i] = qs[i] & 0x0F;
    q[i + kBlock / 2] = qs[i] >> 4;
  }
}

// Row ``row``'s values of group g into its tile (values as unpack_block gives them).
void put_block(const Format& f, uint8_t* tile, int64_t lane, const int32_t* q) {
  uint8_t* w = tile + f.weights_at;
  if (f.kind == kQ8_0) {
    for (int i = 0; i < kBlock; ++i) w[(i / 4) * 64 + lane * 4 + i % 4] = static_cast<uint8_t>(q[i] + 128);
    return;
  }
  for (int c = 0; c < 4; ++c)
    for (int b = 0; b < 4; ++b)
      w[c * 64 + lane * 4 + b] = static_cast<uint8_t>(q[8 * c + b] | (q[8 * c + 4 + b] << 4));
}

// The value a tile stores for weight i of row lane (Q8_0: q + 128; Q4: the nibble).
int32_t stored(const Format& f, const uint8_t* tile, int64_t lane, int64_t i) {
  const uint8_t* w = tile + f.weights_at;
  if (f.kind == kQ8_0) return w[(i / 4) * 64 + lane * 4 + i % 4];
  const int64_t c = i / 8, b = i % 8;
  const uint8_t byte = w[c * 64 + lane * 4 + b % 4];
  return b < 4 ? byte & 0x0F : byte >> 4;
}

// Weight i of row lane as the block holds it (Q8_0: q; Q4: the nibble).
int32_t get_value(const Format& f, const uint8_t* tile, int64_t lane, int64_t i) {
  return stored(f, tile, lane, i) - (f.kind == kQ8_0 ? 128 : 0);
}

inline const uint16_t* tile_d(const uint8_t* tile) { return reinterpret_cast<const uint16_t*>(tile); }
inline const uint16_t* tile_m(const uint8_t* tile) {
  return reinterpret_cast<const uint16_t*>(tile) + kTileRows;
}

// The activations, rounded per block of 32 to 16 bits: v = x * 127 / amax, xh = round(v)
// (ties to even), xl = round(256 (v - xh)) (v - xh is exact; clamped to 127), so that
// x ~ xd * (256 xh + xl) with xd = amax / 127 / 256; and each block's sums of xh and xl,
// and its rounded sum xd * (256 sum xh + sum xl).
struct Activations {
  int64_t rows, cols, groups;
  std::vector<int8_t> high, low;
  std::vector<float> d, sum;
  std::vector<int32_t> high_sum, low_sum;
};

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

Activations quantize_activations(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / kBlock;
  Activations a{M,
                K,
                G,
                std::vector<int8_t>(M * K),
                std::vector<int8_t>(M * K),
                std::vector<float>(M * G),
                std::vector<float>(M * G),
                std::vector<int32_t>(M * G),
                std::vector<int32_t>(M * G)};
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

// What a plane's integer sum of a block starts from: the offsets of the weights' stored
// values (Q8_0 stores q + 128, Q4_0 q + 8) times the plane's sum.
inline int32_t start_of(int64_t kind, int32_t plane_sum) {
  return kind == kQ8_0 ? -128 * plane_sum : kind == kQ4_0 ? -8 * plane_sum : 0;
}

struct Call {
  Format f;
  const uint8_t* w;
  const Activations* a;
  const float* bias;
  float* y;  // [M, N] with row stride N
};

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

inline __m512 load_halves(const uint16_t* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

// A tile's block of weights as 8 quads of 16 rows x 4 bytes (what a Q8_0 tile holds): a Q4
// tile's 4 chunks split into their low nibbles (quads 0, 2, 4, 6) and high ones (1, 3, 5, 7).
template <int64_t KIND>
inline const uint8_t* quads(const uint8_t* weights, uint8_t* buffer) {
  if constexpr (KIND == kQ8_0) {
    return weights;
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int chunk = 0; chunk < 4; ++chunk) {
      const __m512i raw = _mm512_loadu_si512(weights + chunk * 64);
      _mm512_storeu_si512(buffer + chunk * 128, _mm512_and_si512(raw, low));
      _mm512_storeu_si512(buffer + chunk * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
    return buffer;
  }
}

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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INLINELM_AVX2 1

// AVX2 without VNNI: a quad's 64 bytes widened to int16 (four rows a vector, two k pairs
// each) and multiplied by the input quad's int16 pattern with vpmaddwd (no int16
// saturation, where vpmaddubsw would saturate on Q8_0's 255 x 127 pairs); each row's pair
// sums added at the block's end. One activation row at a time; the float steps are the
// VNNI loops', lane by lane, so the bits are theirs.
inline void unpack_quads_avx2(const uint8_t* weights, uint8_t* quads) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int half = 0; half < 8; ++half) {  // 4 chunks of 64 bytes, two halves each
    const int chunk = half / 2, at = (half % 2) * 32;
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + chunk * 64 + at));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(quads + chunk * 128 + at), _mm256_and_si256(raw, low));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(quads + chunk * 128 + 64 + at),
                        _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
  }
}

// The 16 rows' sums of one block from four vectors of pair sums (rows 4v .. 4v + 3, two
// pairs each): rows 0-7 and 8-15.
inline void row_sums(const __m256i (&pairs)[4], __m256i& rows_low, __m256i& rows_high) {
  // NOTE: hadd works within 128-bit halves: rows come out 0 1 4 5 2 3 6 7
  rows_low = _mm256_permute4x64_epi64(_mm256_hadd_epi32(pairs[0], pairs[1]), 0xD8);
  rows_high = _mm256_permute4x64_epi64(_mm256_hadd_epi32(pairs[2], pairs[3]), 0xD8);
}

template <int64_t KIND>
void tile_avx2(const Call& c, int64_t r, int64_t t) {
  const Format& f = c.f;
  const Activations& a = *c.a;
  const int64_t G = f.groups, K = a.cols;
  __m256 acc_low = _mm256_setzero_ps(), acc_high = _mm256_setzero_ps();
  alignas(64) uint8_t buffer[512];
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* tile = c.w + (t * G + g) * f.tile_bytes;
    const uint8_t* w = tile + f.weights_at;
    if constexpr (KIND != kQ8_0) {
      unpack_quads_avx2(w, buffer);
      w = buffer;
    }
    const int8_t* xh = a.high.data() + r * K + g * kBlock;
    const int8_t* xl = a.low.data() + r * K + g * kBlock;
    __m256i high[4], low[4];
    for (int v = 0; v < 4; ++v) high[v] = low[v] = _mm256_setzero_si256();
    for (int quad = 0; quad < 8; ++quad) {
      int64_t h4 = 0, l4 = 0;  // the quad's 4 inputs as int16
      for (int k = 0; k < 4; ++k) {
        h4 |= static_cast<int64_t>(static_cast<uint16_t>(xh[quad * 4 + k])) << (16 * k);
        l4 |= static_cast<int64_t>(static_cast<uint16_t>(xl[quad * 4 + k])) << (16 * k);
      }
      const __m256i hv = _mm256_set1_epi64x(h4), lv = _mm256_set1_epi64x(l4);
      for (int v = 0; v < 4; ++v) {
        const __m256i wv = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + quad * 64 + v * 16)));
        high[v] = _mm256_add_epi32(high[v], _mm256_madd_epi16(wv, hv));
        low[v] = _mm256_add_epi32(low[v], _mm256_madd_epi16(wv, lv));
      }
    }
    __m256i high_rows[2], low_rows[2];
    row_sums(high, high_rows[0], high_rows[1]);
    row_sums(low, low_rows[0], low_rows[1]);
    const int64_t ag = r * G + g;
    const __m256i start_high = _mm256_set1_epi32(start_of(KIND, a.high_sum[ag]));
    const __m256i start_low = _mm256_set1_epi32(start_of(KIND, a.low_sum[ag]));
    const __m256 xd = _mm256_set1_ps(a.d[ag]), xsum = _mm256_set1_ps(a.sum[ag]);
    __m256* acc[2] = {&acc_low, &acc_high};
    for (int h = 0; h < 2; ++h) {
      const __m256i sum = _mm256_add_epi32(
          _mm256_slli_epi32(_mm256_add_epi32(high_rows[h], start_high), 8),
          _mm256_add_epi32(low_rows[h], start_low));
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile_d(tile) + 8 * h)));
      *acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, xd), *acc[h]);
      if constexpr (KIND == kQ4_1) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile_m(tile) + 8 * h)));
        *acc[h] = _mm256_fmadd_ps(m, xsum, *acc[h]);
      }
    }
  }
  const int64_t n0 = t * kTileRows;
  alignas(32) float out[16];
  _mm256_store_ps(out, acc_low);
  _mm256_store_ps(out + 8, acc_high);
  for (int64_t j = 0; j < kTileRows && n0 + j < f.rows; ++j)
    c.y[r * f.rows + n0 + j] = out[j] + (c.bias ? c.bias[n0 + j] : 0.0f);
}

template <int64_t KIND>
void tiles_range_avx2(const Call& c, int64_t M, int64_t t0, int64_t t1) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t t = t0; t < t1; ++t) tile_avx2<KIND>(c, r, t);
}
#else
#define INLINELM_AVX2 0
#endif

void tiles_range_plain(const Call& c, int64_t M, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) tile_plain<4>(c, r, t);
    for (; r < M; ++r) tile_plain<1>(c, r, t);
  }
}

// Which loops run: the fastest this machine has, or slower ones (the same bits from each).
enum Loops : int64_t { kFastest = 0, kAvx2 = 1, kPlain = 2 };

template <int64_t KIND>
void tiles_range_kind(const Call& c, int64_t M, int64_t t0, int64_t t1, int64_t loops) {
#if INLINELM_VNNI
  if (loops == kFastest) return tiles_range_vnni<KIND>(c, 0, M, t0, t1);
#endif
#if INLINELM_AVX2
  if (loops != kPlain) return tiles_range_avx2<KIND>(c, M, t0, t1);
#endif
  tiles_range_plain(c, M, t0, t1);
}

void tiles_range(const Call& c, int64_t M, int64_t t0, int64_t t1, int64_t loops) {
  if (c.f.kind == kQ8_0) return tiles_range_kind<kQ8_0>(c, M, t0, t1, loops);
  if (c.f.kind == kQ4_0) return tiles_range_kind<kQ4_0>(c, M, t0, t1, loops);
  tiles_range_kind<kQ4_1>(c, M, t0, t1, loops);
}

// Tiles per pass over the activation rows: their weights stay in the core's cache while
// every row passes over them (a pass of many rows over all of a thread's tiles would read
// them from memory again for each block of rows).
int64_t tiles_per_pass(const Format& f) {
  constexpr int64_t kPassBytes = 256 << 10;
  return std::max<int64_t>(4, kPassBytes / (f.groups * f.tile_bytes) / 4 * 4);
}

}  // namespace

std::string block_loops() { return INLINELM_VNNI ? "vnni" : INLINELM_AVX2 ? "avx2" : "plain"; }

int64_t block_packed_bytes(int64_t kind, int64_t rows, int64_t cols) {
  return packed_bytes(format_of(kind, rows, cols));
}

void block_pack(torch::Tensor& data, int64_t kind, int64_t rows, int64_t cols, int64_t row0,
                const torch::Tensor& blocks) {
  const Format f = format_of(kind, rows, cols);
  check_packed(data, f);
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous 2-D uint8 tensor");
  const int64_t n = blocks.size(0);
  TORCH_CHECK(blocks.size(1) == f.groups * f.block_bytes, "a row of ", cols, " weights takes ",
              f.groups * f.block_bytes, " bytes of blocks, not ", blocks.size(1));
  TORCH_CHECK(0 <= row0 && row0 + n <= rows, "rows [", row0, ", ", row0 + n,
              ") are outside [0, ", rows, ")");
  uint8_t* out = data.data_ptr<uint8_t>();
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t i0, int64_t i1) {
    int32_t q[kBlock];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = row0 + i, t = row / kTileRows, lane = row % kTileRows;
      for (int64_t g = 0; g < f.groups; ++g) {
        const uint8_t* block = src + i * blocks.size(1) + g * f.block_bytes;
        uint8_t* tile = out + (t * f.groups + g) * f.tile_bytes;
        uint16_t scales[2];
        std::memcpy(scales, block, kind == kQ4_1 ? 4 : 2);
        std::memcpy(tile + lane * 2, &scales[0], 2);
        if (kind == kQ4_1) std::memcpy(tile + (kTileRows + lane) * 2, &scales[1], 2);
        unpack_block(kind, block, q);
        put_block(f, tile, lane, q);
      }
    }
  });
}

torch::Tensor block_rows(const torch::Tensor& data, int64_t kind, int64_t rows, int64_t cols,
                         const torch::Tensor& ids) {
  const Format f = format_of(kind, rows, cols);
  check_packed(data, f);
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1 && ids.is_contiguous(),
              "ids must be a contiguous 1-D int64 tensor");
  const int64_t T = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i)
    TORCH_CHECK(0 <= id[i] && id[i] < rows, "row ", id[i], " is outside [0, ", rows, ")");
  auto out = torch::empty({T, cols}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const uint8_t* w = data.data_ptr<uint8_t>();
  at::parallel_for(0, T, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = id[i] / kTileRows, lane = id[i] % kTileRows;
      for (int64_t g = 0; g < f.groups; ++g) {
        const uint8_t* tile = w + (t * f.groups + g) * f.tile_bytes;
        const float d = half_to_float(tile_d(tile)[lane]);
        const float m = kind == kQ4_1 ? half_to_float(tile_m(tile)[lane]) : 0.0f;
        const int32_t offset = kind == kQ4_0 ? 8 : 0;
        for (int64_t k = 0; k < kBlock; ++k)
          o[i * cols + g * kBlock + k] = d * static_cast<float>(get_value(f, tile, lane, k) - offset) + m;
      }
    }
  });
  return out;
}

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
  const int64_t M = x.size(0);
  auto y = torch::empty({M, rows}, x.options());
  if (M == 0) return y;
  const Activations a = quantize_activations(x.data_ptr<float>(), M, cols);
  const Call c{f, data.data_ptr<uint8_t>(), &a, b, y.data_ptr<float>()};
  // NOTE: tiles split over the threads, 4 at a time (64 rows: a few KiB of weights a
  // group), every activation row against each, so a tile is read from memory once.
  const int64_t pass = tiles_per_pass(f);
  at::parallel_for(0, f.tiles, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t += pass) tiles_range(c, M, t, std::min(t1, t + pass), loops);
  });
  return y;
}
