// A decode step's decoder layers in one call: the pre-norm layer of inlinelm's decoder
// (inlinelm/gpu/model/models/decoder.py's DecoderLayer, with block-quantized linear layers,
// the per-head q/k norms or none, and a gated MLP), each op the same extension operator,
// on the same tensors, in the same order as the layer's Python calls it, so the result is
// the same to the bit. At batch 1 the layer's Python (about 200 module calls and 400 tensor
// views a step) cost more than its norms, RoPE, KV write and attention together.
#include <chrono>
#include <vector>

#include "ops.h"

struct DecoderLayerOps {
  struct Matrix {  // a block-quantized linear layer
    torch::Tensor data;
    int64_t kind, rows, cols;
    c10::optional<torch::Tensor> bias;

    torch::Tensor operator()(const torch::Tensor& x) const {
      return block_linear(x, data, kind, rows, cols, bias, 0);
    }
  };

  torch::Tensor input_norm, post_norm;
  c10::optional<torch::Tensor> q_norm, k_norm;
  Matrix qkv, o, gate_up, down;
  int64_t rope;  // the step's RoPE table it reads (-1: none)
  double scale, softcap;
  int64_t window;
};

DecoderStack::DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                           double offset, double residual_scale, bool gelu)
    : heads_(heads),
      kv_heads_(kv_heads),
      head_dim_(head_dim),
      eps_(eps),
      offset_(offset),
      residual_scale_(residual_scale),
      gelu_(gelu) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && head_dim > 0 && heads % kv_heads == 0, "bad heads");
}

DecoderStack::~DecoderStack() = default;

void DecoderStack::add_layer(const torch::Tensor& input_norm, const torch::Tensor& post_norm,
                             const c10::optional<torch::Tensor>& q_norm,
                             const c10::optional<torch::Tensor>& k_norm,
                             const std::vector<torch::Tensor>& weights,
                             const std::vector<int64_t>& kinds,
                             const std::vector<c10::optional<torch::Tensor>>& biases,
                             int64_t hidden, int64_t intermediate, int64_t rope, double scale,
                             int64_t window, double softcap) {
  TORCH_CHECK(weights.size() == 4 && kinds.size() == 4 && biases.size() == 4,
              "a layer has four block matrices: qkv, o, gate_up, down");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
  const int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
  const int64_t rows[4] = {q + 2 * kv, hidden, 2 * intermediate, hidden};
  const int64_t cols[4] = {hidden, q, hidden, intermediate};
  DecoderLayerOps::Matrix m[4];
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(weights[i].numel() == block_packed_bytes(kinds[i], rows[i], cols[i]),
                "block matrix ", i, " is not [", rows[i], ", ", cols[i], "]");
    m[i] = DecoderLayerOps::Matrix{weights[i], kinds[i], rows[i], cols[i], biases[i]};
  }
  layers_.push_back(std::make_unique<DecoderLayerOps>(DecoderLayerOps{
      input_norm, post_norm, q_norm, k_norm, m[0], m[1], m[2], m[3], rope, scale, softcap, window}));
}

int64_t DecoderStack::num_layers() const { return static_cast<int64_t>(layers_.size()); }

void DecoderStack::clock_matmuls(bool on) { clock_matmuls_ = on; }

double DecoderStack::take_matmul_seconds() {
  const double spent = matmul_seconds_;
  matmul_seconds_ = 0.0;
  return spent;
}

std::tuple<torch::Tensor, torch::Tensor> DecoderStack::decode(
    torch::Tensor x, const std::vector<torch::Tensor>& kv_caches,
    const std::vector<torch::Tensor>& rope_tables, const torch::Tensor& positions,
    const torch::Tensor& slots, const torch::Tensor& block_tables,
    const torch::Tensor& seq_lens, int64_t block_size) const {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache a layer");
  TORCH_CHECK(x.dim() == 2, "x must be [T, hidden]");
  const int64_t T = x.size(0), H = heads_, KV = kv_heads_, D = head_dim_;
  const int64_t q_size = H * D, kv_size = KV * D;
  torch::Tensor residual;
  // NOTE: with the matmuls clocked (benchmarks/cpu_step.py), each block matmul is timed
  const auto linear = [this](const DecoderLayerOps::Matrix& m, const torch::Tensor& in) {
    if (!clock_matmuls_) return m(in);
    const auto start = std::chrono::steady_clock::now();
    auto out = m(in);
    matmul_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return out;
  };
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecoderLayerOps& L = *layers_[i];
    // 1) the input norm; the first layer's residual is its input
    if (i == 0) {
      residual = x;
      x = rms_norm(x, L.input_norm, eps_, offset_);
    } else {
      add_rms_norm(x, residual, L.input_norm, eps_, offset_);
    }
    // 2) attention: QKV, the q/k norms, RoPE, the KV write, paged decode, O
    const torch::Tensor qkv = linear(L.qkv, x);
    torch::Tensor qk;
    if (L.q_norm.has_value()) {
      const auto q = rms_norm(qkv.narrow(1, 0, q_size).reshape({T, H, D}), *L.q_norm, eps_, offset_);
      const auto k =
          rms_norm(qkv.narrow(1, q_size, kv_size).reshape({T, KV, D}), *L.k_norm, eps_, offset_);
      qk = torch::cat({q, k}, 1);
    } else {
      qk = qkv.narrow(1, 0, q_size + kv_size).view({T, H + KV, D});
    }
    if (L.rope >= 0) {
      TORCH_CHECK(L.rope < static_cast<int64_t>(rope_tables.size()), "no RoPE table ", L.rope);
      rope(qk, positions, rope_tables[L.rope]);
    }
    torch::Tensor cache = kv_caches[i];
    write_kv(cache, qk.narrow(1, H, KV), qkv.narrow(1, q_size + kv_size, kv_size).reshape({T, KV, D}),
             slots);
    const auto attended = paged_decode(qk.narrow(1, 0, H), cache, block_tables, seq_lens,
                                       block_size, L.scale, L.window, L.softcap);
    x = linear(L.o, attended.reshape({T, q_size}));
    if (residual_scale_ != 1.0) x = x * residual_scale_;
    // 3) the post-attention norm, then the gated MLP
    add_rms_norm(x, residual, L.post_norm, eps_, offset_);
    const auto gate_up = linear(L.gate_up, x);
    x = linear(L.down, gelu_ ? gelu_tanh_and_mul(gate_up) : silu_and_mul(gate_up));
    if (residual_scale_ != 1.0) x = x * residual_scale_;
  }
  return {x, residual};
}
