// Block-quantized weights packed into their tiles (block_tiles.h says the layout), and rows
// of them read back as floats.
#include <ATen/Parallel.h>

#include "block_tiles.h"
#include "ops.h"

namespace {

using namespace inlinelm::blocks;

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

}  // namespace

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

