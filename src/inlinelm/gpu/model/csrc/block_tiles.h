// The tiles block-quantized weights live in, and what the block matmul's implementations
// share (block_linear.cpp: AVX-512 VNNI and plain C++; block_linear_avx2.cpp: AVX2;
// block_linear_amx_int8.cpp: AMX's int8 tiles; block_linear_amx.cpp: bfloat16 products on
// AMX for many rows).
//
// The weights live in tiles of 16 rows x 32 columns (one block of each of 16 rows), tile
// (t, g) at byte (t * G + g) * tile_bytes, rows padded to a multiple of 16 with zeros:
//   [16 float16 d][16 float16 m, Q4_1 only][weights]
// Q8_0's weights are 8 quads: quad c holds, for row lane j, the 4 bytes q[4c .. 4c+3] + 128
// (unsigned: AVX-512 VNNI multiplies unsigned by signed bytes; the +128 is taken back with
// 128 * sum xq). Q4's are 4 chunks: chunk c holds, for lane j, 4 bytes whose low nibbles are
// q[8c .. 8c+3] and high nibbles q[8c+4 .. 8c+7]. A vector load is then one quad of 16 rows,
// which one instruction multiplies by a broadcast quad of one activation row: 16 rows' sums
// in the 16 lanes, no horizontal sums; the 8 quads are also the B operand of AMX's int8 tile
// multiply (8 rows of 16 x 4 bytes), as they lie. A tile takes the GGUF block's bytes (34, 18, 20 per
// 32 weights), so weights kept this way take the file's size.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

namespace inlinelm::blocks {

constexpr int64_t kBlock = 32;  // weights per block
constexpr int64_t kTileRows = 16;

enum Kind : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

struct Format {
  int64_t kind, rows, cols, groups, tiles;
  int64_t tile_bytes, weights_at;  // a tile's bytes, and where its weights start in it
  int64_t block_bytes;             // the GGUF block's
};

inline Format format_of(int64_t kind, int64_t rows, int64_t cols) {
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

inline int64_t packed_bytes(const Format& f) { return f.tiles * f.groups * f.tile_bytes; }

inline void check_packed(const torch::Tensor& data, const Format& f) {
  TORCH_CHECK(data.scalar_type() == torch::kUInt8 && data.dim() == 1 && data.is_contiguous(),
              "packed weights must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(data.numel() == packed_bytes(f), "packed weights of [", f.rows, ", ", f.cols,
              "] take ", packed_bytes(f), " bytes, not ", data.numel());
}

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// The value a tile stores for weight i of row lane (Q8_0: q + 128; Q4: the nibble).
inline int32_t stored(const Format& f, const uint8_t* tile, int64_t lane, int64_t i) {
  const uint8_t* w = tile + f.weights_at;
  if (f.kind == kQ8_0) return w[(i / 4) * 64 + lane * 4 + i % 4];
  const int64_t c = i / 8, b = i % 8;
  const uint8_t byte = w[c * 64 + lane * 4 + b % 4];
  return b < 4 ? byte & 0x0F : byte >> 4;
}

// Weight i of row lane as the block holds it (Q8_0: q; Q4: the nibble).
inline int32_t get_value(const Format& f, const uint8_t* tile, int64_t lane, int64_t i) {
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
  int64_t padded_rows;  // rows the planes and sums hold (zeros past rows)
  std::vector<int8_t> high, low;
  std::vector<float> d, sum;
  std::vector<int32_t> high_sum, low_sum;
};

// What a plane's integer sum of a block starts from: the offsets of the weights' stored
// values (Q8_0 stores q + 128, Q4_0 q + 8) times the plane's sum.
inline int32_t start_of(int64_t kind, int32_t plane_sum) {
  return kind == kQ8_0 ? -128 * plane_sum : kind == kQ4_0 ? -8 * plane_sum : 0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
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
#endif

struct Call {
  Format f;
  const uint8_t* w;
  const Activations* a;
  const float* bias;
  float* y;  // [M, N] with row stride N
};

// Rows [0, M) of c against tiles [t0, t1), one activation row at a time, with AVX2 (where
// the extension was built with it: avx2_built()).
bool avx2_built();
void tiles_range_avx2(const Call& c, int64_t M, int64_t t0, int64_t t1);

// Rows [0, M) of c against tiles [t0, t1) with AMX's int8 tile products (block_linear_amx_int8.cpp),
// where the CPU has AMX-INT8 and the extension was built for it: amx_ready(). The same bits
// as the integer loops; the activations padded to a multiple of 16 rows.
bool amx_ready();
void tiles_range_amx(const Call& c, int64_t M, int64_t t0, int64_t t1);

// y [M, N] = x [M, K] @ W.T (+ bias) with the weights widened to bfloat16 and AMX's products
// (block_linear_amx.cpp), where the CPU has AMX and the extension AVX-512 BF16: bf16_ready().
bool bf16_ready();
void linear_bf16(const Format& f, const uint8_t* w, const float* x, int64_t M, const float* bias,
                 float* y);

}  // namespace inlinelm::blocks
