// What the float32 kernels of cpu_ops.cpp and paged_attention.cpp share: their argument
// checks, and how much work an intra-op thread takes.
#pragma once

#include <torch/extension.h>

#include <algorithm>

namespace inlinelm {

constexpr int64_t kSerialWork = 1 << 16;  // elements (or MACs) below which a call is serial

inline int64_t grain(int64_t work_per_item) {
  return std::max<int64_t>(1, kSerialWork / std::max<int64_t>(work_per_item, 1));
}

inline void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name,
              " must be a float32 CPU tensor");
}

inline void check_rows(const torch::Tensor& t, const char* name) {
  check_float(t, name);
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, "'s last dimension must be contiguous");
}

}  // namespace inlinelm
