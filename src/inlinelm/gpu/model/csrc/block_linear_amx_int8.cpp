// The integer loops' arithmetic on AMX (see block_linear.cpp): each block's dot products of
// the two input planes taken by AMX's int8 tile multiply, 16 activation rows by 16 weight
// rows by one block (32 columns) an instruction, instead of VNNI's 16 rows by 4 columns.
//
// A tile (block_tiles.h) already holds its block of 16 rows in the layout AMX's B operand
// reads: quad c (64 bytes) is tile row c, column j's 4 bytes are row lane j's q[4c .. 4c+3]
// (a Q4 tile's nibbles are spread into quads first, as the VNNI loops do). The activation
// planes are A: 16 rows of one block's 32 bytes, at the row stride. TDPBSUD multiplies
// signed inputs by unsigned weights (Q8_0 stores q + 128), so the sums start from the same
// offsets as the VNNI loops'. A block's per-row scales cannot ride along in the tile
// multiply, so each block's integer sums are stored and scaled in AVX-512, the float steps
// the same operations in the same order as the VNNI loops': the same bits.
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include "block_tiles.h"

namespace inlinelm::blocks {

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BW__)
#define INLINELM_AMX 1

namespace {

// Linux hands out AMX's tile registers to a process that asks (arch_prctl).
constexpr int kReqXcompPerm = 0x1023;
constexpr int kXfeatureTileData = 18;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tile registers (GCC's intrinsics take their numbers as literals): tmm0 and tmm1 the
// two input planes' block (A), tmm2 and tmm3 two weight tiles' (B), tmm4 + 2 * plane + j
// the sums of plane by weight tile j (C).
TileConfig tile_config() {
  TileConfig c;
  for (int t : {0, 1}) {
    c.rows[t] = 16;
    c.colsb[t] = kBlock;  // 16 rows of one block of int8 inputs
  }
  for (int t : {2, 3}) {
    c.rows[t] = kBlock / 4;  // a block's 8 quads
    c.colsb[t] = 64;         // of 16 weight rows x 4 bytes
  }
  for (int t = 4; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;  // 16 x 16 int32 sums
  }
  return c;
}

constexpr int64_t kRowTile = 16;
constexpr int64_t kRowGroup = 128;  // activation rows whose float sums a pass keeps

// Rows [m0, m0 + rows) (whole tiles of 16 within the padded planes) against tile t and,
// where both, t + 1, every block; then written out (rows below M). A block's integer sums
// go through memory to be scaled (float sums in acc, [rows][32]).
template <int64_t KIND>
void pair_amx(const Call& c, int64_t M, int64_t m0, int64_t rows, int64_t t, bool both,
              float* acc) {
  const Format& f = c.f;
  const Activations& a = *c.a;
  const int64_t G = f.groups, K = a.cols;
  alignas(64) uint8_t unpacked[2][512];
  alignas(64) int32_t sums[4][kRowTile][16];  // [plane * 2 + j][row][weight row]
  std::fill(acc, acc + rows * 32, 0.0f);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* tile[2];
    tile[0] = c.w + (t * G + g) * f.tile_bytes;
    tile[1] = both ? c.w + ((t + 1) * G + g) * f.tile_bytes : tile[0];
    const uint8_t* b0 = quads<KIND>(tile[0] + f.weights_at, unpacked[0]);
    _tile_loadd(2, b0, 64);
    _tile_loadd(3, both ? quads<KIND>(tile[1] + f.weights_at, unpacked[1]) : b0, 64);
    __m512 d[2], m[2];
    for (int j = 0; j < 2; ++j) {
      d[j] = load_halves(tile_d(tile[j]));
      m[j] = _mm512_setzero_ps();
      if constexpr (KIND == kQ4_1) m[j] = load_halves(tile_m(tile[j]));
    }
    for (int64_t i = 0; i < rows; i += kRowTile) {
      const int64_t x_at = (m0 + i) * K + g * kBlock;
      _tile_loadd(0, a.high.data() + x_at, K);
      _tile_loadd(1, a.low.data() + x_at, K);
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      _tile_dpbsud(4, 0, 2);
      _tile_dpbsud(5, 0, 3);
      _tile_dpbsud(6, 1, 2);
      _tile_dpbsud(7, 1, 3);
      _tile_stored(4, sums[0], 64);
      _tile_stored(5, sums[1], 64);
      _tile_stored(6, sums[2], 64);
      _tile_stored(7, sums[3], 64);
      for (int64_t r = 0; r < kRowTile; ++r) {
        const int64_t ag = (m0 + i + r) * G + g;
        // the sums' offsets (see start_of), both planes' in one: s = 256 high + low
        const __m512i start = _mm512_set1_epi32(start_of(KIND, a.high_sum[ag]) * 256 +
                                                start_of(KIND, a.low_sum[ag]));
        const __m512 xd = _mm512_set1_ps(a.d[ag]);
        float* out = acc + (i + r) * 32;
        for (int j = 0; j < 2; ++j) {
          const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[j][r]), 8),
                                             _mm512_add_epi32(_mm512_load_si512(sums[2 + j][r]), start));
          __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d[j], xd),
                                     _mm512_load_ps(out + 16 * j));
          if constexpr (KIND == kQ4_1) v = _mm512_fmadd_ps(m[j], _mm512_set1_ps(a.sum[ag]), v);
          _mm512_store_ps(out + 16 * j, v);
        }
      }
    }
  }
  for (int j = 0; j < (both ? 2 : 1); ++j) {
    const int64_t n0 = (t + j) * kTileRows;
    const int64_t valid = std::min<int64_t>(kTileRows, f.rows - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = c.bias ? _mm512_maskz_loadu_ps(mask, c.bias + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows && m0 + r < M; ++r)
      _mm512_mask_storeu_ps(c.y + (m0 + r) * f.rows + n0, mask,
                            _mm512_add_ps(_mm512_load_ps(acc + r * 32 + 16 * j), b));
  }
}

template <int64_t KIND>
void range_amx(const Call& c, int64_t M, int64_t t0, int64_t t1) {
  const int64_t padded = (M + kRowTile - 1) / kRowTile * kRowTile;
  alignas(64) float acc[kRowGroup * 32];
  for (int64_t m0 = 0; m0 < padded; m0 += kRowGroup) {
    const int64_t rows = std::min(kRowGroup, padded - m0);
    for (int64_t t = t0; t < t1; t += 2) pair_amx<KIND>(c, M, m0, rows, t, t + 1 < t1, acc);
  }
}

}  // namespace

bool amx_ready() {
  static const bool ready = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("amx-int8") &&
           syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return ready;
}

void tiles_range_amx(const Call& c, int64_t M, int64_t t0, int64_t t1) {
  TORCH_CHECK(amx_ready(), "the AMX block matmul needs AMX-INT8");
  TORCH_CHECK(c.a->padded_rows % kRowTile == 0 && c.a->padded_rows >= M,
              "the activations must be padded to whole tiles of rows");
  static const TileConfig config = tile_config();
  _tile_loadconfig(&config);
  if (c.f.kind == kQ8_0) range_amx<kQ8_0>(c, M, t0, t1);
  else if (c.f.kind == kQ4_0) range_amx<kQ4_0>(c, M, t0, t1);
  else range_amx<kQ4_1>(c, M, t0, t1);
  _tile_release();
}

#else
#define INLINELM_AMX 0

bool amx_ready() { return false; }

void tiles_range_amx(const Call&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "the AMX block matmul needs AMX-INT8");
}

#endif

}  // namespace inlinelm::blocks
