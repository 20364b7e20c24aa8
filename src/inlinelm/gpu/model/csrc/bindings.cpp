// The extension's Python module: every operator ops.h declares.
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "float x times int8 weights with per-row scales");
  m.def("rms_norm", &rms_norm, "x / rms(x) * (offset + weight) over rows of [A, B, D]");
  m.def("add_rms_norm", &add_rms_norm, "in place: residual += x, then x = rms_norm(residual)");
  m.def("rope", &rope, "in place neox RoPE of qk [T, H, D] over the table's width");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for x = [gate | up]");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up for x = [gate | up]");
  m.def("write_kv", &write_kv, "k, v [T, KVH, D] into kv_cache [2, slots, KVH, D] at slots");
  m.def("paged_decode", &paged_decode, "one query row per sequence over the paged cache");
}
