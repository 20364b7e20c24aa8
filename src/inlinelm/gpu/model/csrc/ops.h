// The CPU operators of inlinelm's extension (built at first use for this machine; see
// inlinelm/gpu/model/cpu_extension.py): the block-quantized linear layer and the fused
// float32 kernels of a decoder step. Every float tensor is float32; shapes and strides are
// checked on entry, so a bad call is a Python RuntimeError, never a bad read.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <tuple>
#include <vector>

// block_linear.cpp: block-quantized weights (kind 0 Q8_0, 1 Q4_0, 2 Q4_1), packed in the
// kernel's tiles (a flat uint8 tensor of block_packed_bytes)
std::string block_loops();  // the fastest loops block_linear runs here
bool block_bf16_ready();     // whether block_linear takes bfloat16 products on AMX here
bool block_amx_ready();      // whether its integer loops run on AMX's int8 tiles here
int64_t block_packed_bytes(int64_t kind, int64_t rows, int64_t cols);
void block_pack(torch::Tensor& data, int64_t kind, int64_t rows, int64_t cols, int64_t row0,
                const torch::Tensor& blocks);
torch::Tensor block_rows(const torch::Tensor& data, int64_t kind, int64_t rows, int64_t cols,
                         const torch::Tensor& ids);
torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& data, int64_t kind,
                           int64_t rows, int64_t cols, const c10::optional<torch::Tensor>& bias,
                           int64_t loops);

// cpu_ops.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       double offset);
void add_rms_norm(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                  double eps, double offset);
void rope(torch::Tensor& qk, const torch::Tensor& positions, const torch::Tensor& cos_sin_cache);
torch::Tensor silu_and_mul(const torch::Tensor& x);
torch::Tensor gelu_tanh_and_mul(const torch::Tensor& x);
// paged_attention.cpp
void write_kv(torch::Tensor& kv_cache, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& slots);
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& kv_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                           int64_t block_size, double scale, int64_t window, double softcap);

// decoder_stack.cpp: a decode step's pre-norm decoder layers (block-quantized linears) in
// one call, each op one of the above
struct DecoderLayerOps;
class DecoderStack {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double offset,
               double residual_scale, bool gelu);
  ~DecoderStack();
  void add_layer(const torch::Tensor& input_norm, const torch::Tensor& post_norm,
                 const c10::optional<torch::Tensor>& q_norm,
                 const c10::optional<torch::Tensor>& k_norm,
                 const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& kinds,
                 const std::vector<c10::optional<torch::Tensor>>& biases, int64_t hidden,
                 int64_t intermediate, int64_t rope, double scale, int64_t window,
                 double softcap);
  int64_t num_layers() const;
  // Time the block matmuls of decode (off by default): for benchmarks/cpu_step.py.
  void clock_matmuls(bool on);
  double take_matmul_seconds();
  std::tuple<torch::Tensor, torch::Tensor> decode(
      torch::Tensor x, const std::vector<torch::Tensor>& kv_caches,
      const std::vector<torch::Tensor>& rope_tables, const torch::Tensor& positions,
      const torch::Tensor& slots, const torch::Tensor& block_tables,
      const torch::Tensor& seq_lens, int64_t block_size) const;

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, offset_, residual_scale_;
  bool gelu_;
  std::vector<std::unique_ptr<DecoderLayerOps>> layers_;
  bool clock_matmuls_ = false;
  mutable double matmul_seconds_ = 0.0;
};
