// The extension's Python module: every operator ops.h declares.
//
// A call that may run for milliseconds (the int8 matmul of a prefill chunk, dequantizing
// weight rows) runs without the GIL, as torch's own ops do, so the event loop's thread
// streams meanwhile; none of them touches a Python object. The rest keep it: a decode
// step makes ~250 of these calls of a few microseconds each, and releasing the GIL around
// each cost the default model ~1 ms per step at batch 1 (9.6 against 8.2-8.7 ms per token,
// measured with one engine streaming one request on 2 cores).
#include "ops.h"

namespace {

constexpr int64_t kHoldGilRows = 32;  // int8_linear calls of at most this many rows keep it

torch::Tensor int8_linear_gil(const torch::Tensor& x, const torch::Tensor& q,
                              const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias,
                              int64_t few_rows_max) {
  if (x.dim() == 2 && x.size(0) <= kHoldGilRows) return int8_linear(x, q, scale, bias, few_rows_max);
  pybind11::gil_scoped_release release;
  return int8_linear(x, q, scale, bias, few_rows_max);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("int8_linear", &int8_linear_gil, "float x times int8 weights with per-row scales");
  m.def("dequantize_rows", &dequantize_rows, "rows [n0, n1) of q * scale[:, None] as floats",
        release());
  m.def("rms_norm", &rms_norm, "x / rms(x) * (offset + weight) over rows of [A, B, D]");
  m.def("add_rms_norm", &add_rms_norm, "in place: residual += x, then x = rms_norm(residual)");
  m.def("rope", &rope, "in place neox RoPE of qk [T, H, D] over the table's width");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for x = [gate | up]");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up for x = [gate | up]");
  m.def("write_kv", &write_kv, "k, v [T, KVH, D] into kv_cache [2, slots, KVH, D] at slots");
  m.def("paged_decode", &paged_decode, "one query row per sequence over the paged cache");
}
