// The block matmul with AVX2 (see block_tiles.h): for CPUs without AVX-512 VNNI.
#include "block_tiles.h"

namespace inlinelm::blocks {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

namespace {

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
void tiles_range_kind(const Call& c, int64_t M, int64_t t0, int64_t t1) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t t = t0; t < t1; ++t) tile_avx2<KIND>(c, r, t);
}

}  // namespace

bool avx2_built() { return true; }

void tiles_range_avx2(const Call& c, int64_t M, int64_t t0, int64_t t1) {
  if (c.f.kind == kQ8_0) return tiles_range_kind<kQ8_0>(c, M, t0, t1);
  if (c.f.kind == kQ4_0) return tiles_range_kind<kQ4_0>(c, M, t0, t1);
  tiles_range_kind<kQ4_1>(c, M, t0, t1);
}

#else

bool avx2_built() { return false; }

void tiles_range_avx2(const Call&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "this build of the CPU extension has no AVX2 loops");
}

#endif

}  // namespace inlinelm::blocks

