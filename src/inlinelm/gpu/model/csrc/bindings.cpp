// The extension's Python module: every operator ops.h declares.
//
// A call that may run for milliseconds (the quantized matmul of a prefill chunk, packing or
// dequantizing weight rows) runs without the GIL, as torch's own ops do, so the event loop's thread
// streams meanwhile; none of them touches a Python object. The rest keep it: a decode
// step makes ~250 of these calls of a few microseconds each, and releasing the GIL around
// each cost the default model ~1 ms per step at batch 1 (9.6 against 8.2-8.7 ms per token,
// measured with one engine streaming one request on 2 cores).
#include "ops.h"

namespace {

constexpr int64_t kHoldGilRows = 32;  // block_linear calls of at most this many rows keep it

torch::Tensor block_linear_gil(const torch::Tensor& x, const torch::Tensor& data, int64_t kind,
                               int64_t rows, int64_t cols,
                               const c10::optional<torch::Tensor>& bias, int64_t loops) {
  if (x.dim() == 2 && x.size(0) <= kHoldGilRows)
    return block_linear(x, data, kind, rows, cols, bias, loops);
  pybind11::gil_scoped_release release;
  return block_linear(x, data, kind, rows, cols, bias, loops);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("block_loops", &block_loops, "the fastest loops block_linear runs here");
  m.def("block_bf16_ready", &block_bf16_ready, "whether block_linear has AMX's bfloat16 products");
  m.def("block_amx_ready", &block_amx_ready, "whether block_linear's integer loops run on AMX's int8 tiles");
  m.def("block_packed_bytes", &block_packed_bytes, "bytes of a [rows, cols] matrix's tiles");
  m.def("block_pack", &block_pack, "GGUF blocks of rows [row0, row0 + n) into the tiles",
        release());
  m.def("block_rows", &block_rows, "rows ids of the tiles, dequantized to float32", release());
  m.def("block_linear", &block_linear_gil, "x @ W.T (+ bias), W block-quantized in tiles");
  m.def("rms_norm", &rms_norm, "x / rms(x) * (offset + weight) over rows of [A, B, D]");
  m.def("add_rms_norm", &add_rms_norm, "in place: residual += x, then x = rms_norm(residual)");
  m.def("rope", &rope, "in place neox RoPE of qk [T, H, D] over the table's width");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for x = [gate | up]");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up for x = [gate | up]");
  m.def("write_kv", &write_kv, "k, v [T, KVH, D] into kv_cache [2, slots, KVH, D] at slots");
  m.def("paged_decode", &paged_decode, "one query row per sequence over the paged cache");
  // NOTE: a whole decode step's layers run without the GIL: one release a step, not one a call
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, double, bool>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      .def("clock_matmuls", &DecoderStack::clock_matmuls)
      .def("take_matmul_seconds", &DecoderStack::take_matmul_seconds)
      .def("decode", &DecoderStack::decode, release());
}
