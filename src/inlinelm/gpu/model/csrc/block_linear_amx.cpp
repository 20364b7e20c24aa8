// The block matmul for many rows on a CPU with AMX: the weights widened to bfloat16 and the
// product taken by torch's AMX micro-kernel (at::native::cpublas::brgemm, oneDNN's), summed
// and returned in float32.
//
// Where many rows compute (a prefill chunk), the integer loops are bound by their dot
// products (two passes of VNNI, one per input plane) and come to about float32's time. An
// AMX tile multiply takes 16x16x32 bfloat16 products in one instruction, but the weights'
// per-block scales cannot ride along with it (a block is one tile's depth), so each matrix
// is first widened, a group of rows at a time, into a scratch buffer of bfloat16 weights in
// the micro-kernel's layout, then multiplied; at 64 rows and more the widening costs a few
// percent of the product (benchmarks/quantized_cpu.py's kernel table).
//
// Precision: a weight is d * q (+ m) in float32, as block_rows reads it, rounded to
// bfloat16 (8 significant bits, a relative error of at most 2^-9: a quarter of a Q8_0
// block's own rounding step at its largest value, far less for the 4-bit kinds); an input
// is rounded to bfloat16 on its own, not on its block's scale (llama.cpp rounds it to 8
// bits on the block's largest value); every product is exact in float32 and the sums are
// float32's. Teacher-forced against float32 (benchmarks/quality_vs_llama_cpp.py), the
// file types agree with float32's top-1 token as often as or more often than llama.cpp's
// kernels do.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <memory>

#include "block_tiles.h"
#include "ops.h"

namespace {

using namespace inlinelm::blocks;

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define INLINELM_BF16 1

constexpr int64_t kScratchBytes = 8 << 20;  // the widened weights of one group of rows
constexpr int64_t kRowBlock = 128;          // activation rows a micro-kernel call
constexpr int64_t kPanel = 128;             // weight rows a micro-kernel call

// Two vectors of 16 floats (columns k and k + 1 of 16 weight rows) as bfloat16 pairs: the
// micro-kernel's layout, B[k / 2][n][k % 2] (round to nearest even).
inline void put_pair(uint16_t* dst, __m512 even, __m512 odd) {
  const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(even)));
  const __m512i hi = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(odd)));
  _mm512_storeu_si512(dst, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
}

// Tile (t, g) (16 rows x 32 columns) into a panel of kPanel rows, at its row n0: columns
// [32 g, 32 g + 32) are pair rows [16 g, 16 g + 16).
void widen_tile(const Format& f, const uint8_t* tile, uint16_t* panel, int64_t n0, int64_t g) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile_d(tile))));
  const uint8_t* w = tile + f.weights_at;
  auto pair = [&](int64_t p) { return panel + ((g * kBlock / 2 + p) * kPanel + n0) * 2; };
  if (f.kind == kQ8_0) {
    // quad c: lane j's bytes are q[4c .. 4c + 3] + 128
    for (int c = 0; c < 8; ++c) {
      const __m512i q = _mm512_xor_si512(_mm512_loadu_si512(w + c * 64), _mm512_set1_epi8(-128));
      __m512 v[4];
      for (int b = 0; b < 4; ++b) {
        const __m512i qb = _mm512_srai_epi32(_mm512_slli_epi32(q, 24 - 8 * b), 24);
        v[b] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(qb));
      }
      put_pair(pair(2 * c), v[0], v[1]);
      put_pair(pair(2 * c + 1), v[2], v[3]);
    }
    return;
  }
  // chunk c: lane j's byte b holds q[8c + b] low and q[8c + 4 + b] high
  const bool q4_1 = f.kind == kQ4_1;
  const __m512 m =
      q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile_m(tile))))
           : _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi32(0x0F), offset = _mm512_set1_epi32(q4_1 ? 0 : 8);
  for (int c = 0; c < 4; ++c) {
    const __m512i bytes = _mm512_loadu_si512(w + c * 64);
    __m512 v[8];
    for (int i = 0; i < 8; ++i) {
      const __m512i shifted = _mm512_srl_epi32(bytes, _mm_cvtsi32_si128(8 * (i % 4) + 4 * (i / 4)));
      const __m512i q = _mm512_sub_epi32(_mm512_and_si512(shifted, nibble), offset);
      const __m512 x = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
      v[i] = q4_1 ? _mm512_add_ps(x, m) : x;
    }
    for (int p = 0; p < 4; ++p) put_pair(pair(4 * c + p), v[2 * p], v[2 * p + 1]);
  }
}

// A buffer that grows and is kept, its contents left as they are.
struct Scratch {
  std::unique_ptr<uint16_t[]> data;
  int64_t size = 0;
  uint16_t* get(int64_t n) {
    if (n > size) {
      data.reset(new uint16_t[n]);
      size = n;
    }
    return data.get();
  }
};

#else
#define INLINELM_BF16 0
#endif

}  // namespace

namespace inlinelm::blocks {

bool bf16_ready() {
#if INLINELM_BF16
  static const bool ready = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("amx-bf16") && at::native::cpublas::could_pack(at::kBFloat16);
  }();
  return ready;
#else
  return false;
#endif
}

void linear_bf16(const Format& f, const uint8_t* w, const float* x, int64_t M, const float* bias,
                 float* y) {
  TORCH_CHECK(bf16_ready(), "the bfloat16 block matmul needs AMX and AVX-512 BF16");
#if INLINELM_BF16
  const int64_t K = f.cols, N = f.rows;
  // NOTE: the calling thread's buffers, kept between calls: fresh pages cost more than
  // the widening itself
  thread_local Scratch inputs, weights;
  uint16_t* xb = inputs.get(M * K);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * K; i < r1 * K; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
  });
  const auto* a = reinterpret_cast<const at::BFloat16*>(xb);
  // NOTE: groups of whole panels (whole tiles) within the scratch bytes; a panel holds
  // its kPanel rows' pairs together, so the micro-kernel reads it in one stretch
  const int64_t group_rows = std::max<int64_t>(kPanel, kScratchBytes / (K * 2) / kPanel * kPanel);
  uint16_t* scratch = weights.get((std::min(group_rows, N) + kPanel - 1) / kPanel * kPanel * K);
  for (int64_t g0 = 0; g0 < N; g0 += group_rows) {
    const int64_t rows = std::min(group_rows, N - g0);
    const int64_t t_first = g0 / kTileRows, tiles = (rows + kTileRows - 1) / kTileRows;
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
      // NOTE: block g of adjacent tiles lands in adjacent lines of a panel
      for (int64_t g = 0; g < f.groups; ++g)
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t n = t * kTileRows;
          widen_tile(f, w + ((t_first + t) * f.groups + g) * f.tile_bytes,
                     scratch + n / kPanel * kPanel * K, n % kPanel, g);
        }
    });
    const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
    const int64_t panels = (rows + kPanel - 1) / kPanel;
    at::parallel_for(0, row_blocks * panels, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t m0 = i / panels * kRowBlock, n0 = i % panels * kPanel;
        const int64_t mr = std::min(kRowBlock, M - m0), nr = std::min(kPanel, rows - n0);
        const auto* b = reinterpret_cast<const at::BFloat16*>(scratch + n0 * K);
        at::native::cpublas::brgemm(mr, nr, K, K, kPanel, N, false, a + m0 * K, b,
                                    y + m0 * N + g0 + n0);
      }
      at::native::cpublas::brgemm_release();
    });
  }
  if (bias != nullptr)
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t n = 0; n < N; ++n) y[r * N + n] += bias[n];
    });
#endif
}

}  // namespace inlinelm::blocks
