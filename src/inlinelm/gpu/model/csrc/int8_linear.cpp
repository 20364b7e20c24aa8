// y = x @ (q * scale[:, None]).T (+ bias): float activations, int8 weights with one float
// scale per output channel, or one per group of G consecutive weights of a row (scale
// [N, K / G]: a Q8_0 file's own blocks, G = 32). Weight-only: the activations stay float,
// so the only error is the weights' rounding (activation quantization cost most of the
// greedy agreement on this project's default model; see inlinelm/gpu/model/layers/int8.py).
//
// A few rows (decode) read each weight row once per block of four activation rows and
// accumulate in float with vector FMAs, compiled for this machine's instructions
// (-march=native, at first use); many rows (long prefill chunks) dequantize a band of
// weight rows into float and multiply it with a float GEMM.
#include <ATen/Parallel.h>

#include <algorithm>

#include "ops.h"
#include "vec.h"

namespace {

using namespace inlinelm;

// R rows of x (row stride K) against the NB weight rows from n: each weight vector is
// widened to floats once and multiplied into the R rows' accumulators (NB x R independent
// FMA chains, which hide the FMA latency even for one row).
template <int R, int NB>
inline void micro(const float* x, int64_t K, const int8_t* q, const float* scale,
                  const float* bias, float* y, int64_t N, int64_t n) {
  float acc[NB][R] = {};
  int64_t k = 0;
#if INLINELM_VEC
  Vec v[NB][R];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) v[j][r] = zero();
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = widen(q + (n + j) * K + k);
    for (int r = 0; r < R; ++r) {
      const Vec xv = load(x + r * K + k);
      for (int j = 0; j < NB; ++j) v[j][r] = fma(xv, wv[j], v[j][r]);
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = total(v[j][r]);
#endif
  for (; k < K; ++k)
    for (int j = 0; j < NB; ++j) {
      const float wk = static_cast<float>(q[(n + j) * K + k]);
      for (int r = 0; r < R; ++r) acc[j][r] += x[r * K + k] * wk;
    }
  for (int j = 0; j < NB; ++j) {
    const float b = bias ? bias[n + j] : 0.0f;
    for (int r = 0; r < R; ++r) y[r * N + n + j] = acc[j][r] * scale[n + j] + b;
  }
}

// As micro, for weights with a scale per group of G weights (G a multiple of kLanes): each
// widened weight vector is scaled once, then multiplied into the R rows' accumulators.
template <int R, int NB>
inline void micro_grouped(const float* x, int64_t K, const int8_t* q, const float* scale,
                          int64_t S, const float* bias, float* y, int64_t N, int64_t n) {
  const int64_t G = K / S;
  float acc[NB][R] = {};
#if INLINELM_VEC
  Vec v[NB][R];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) v[j][r] = zero();
  for (int64_t g = 0; g < S; ++g) {
    Vec sv[NB];
    for (int j = 0; j < NB; ++j) sv[j] = splat(scale[(n + j) * S + g]);
    for (int64_t k = g * G; k < (g + 1) * G; k += kLanes) {
      Vec wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = mul(widen(q + (n + j) * K + k), sv[j]);
      for (int r = 0; r < R; ++r) {
        const Vec xv = load(x + r * K + k);
        for (int j = 0; j < NB; ++j) v[j][r] = fma(xv, wv[j], v[j][r]);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = total(v[j][r]);
#else
  for (int64_t k = 0; k < K; ++k)
    for (int j = 0; j < NB; ++j) {
      const float wk = static_cast<float>(q[(n + j) * K + k]) * scale[(n + j) * S + k / G];
      for (int r = 0; r < R; ++r) acc[j][r] += x[r * K + k] * wk;
    }
#endif
  for (int j = 0; j < NB; ++j) {
    const float b = bias ? bias[n + j] : 0.0f;
    for (int r = 0; r < R; ++r) y[r * N + n + j] = acc[j][r] + b;
  }
}

// R rows of x against weight rows [n0, n1), NB weight rows at a time (R x NB accumulators
// and NB widened weight vectors fit the 32 vector registers).
template <int R, int NB>
void dot_block(const float* x, int64_t K, const int8_t* q, const float* scale,
               const float* bias, float* y, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) micro<R, NB>(x, K, q, scale, bias, y, N, n);
  for (; n < n1; ++n) micro<R, 1>(x, K, q, scale, bias, y, N, n);
}

template <int R, int NB>
void dot_block_grouped(const float* x, int64_t K, const int8_t* q, const float* scale,
                       int64_t S, const float* bias, float* y, int64_t N, int64_t n0,
                       int64_t n1) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) micro_grouped<R, NB>(x, K, q, scale, S, bias, y, N, n);
  for (; n < n1; ++n) micro_grouped<R, 1>(x, K, q, scale, S, bias, y, N, n);
}

void few_rows(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale,
              const float* bias, float* y, int64_t N) {
  // NOTE: a band of 16 weight rows per task: it stays in cache while every block of rows
  // passes over it.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + 8 <= M; r += 8) dot_block<8, 2>(x + r * K, K, q, scale, bias, y + r * N, N, n0, n1);
    for (; r + 4 <= M; r += 4) dot_block<4, 4>(x + r * K, K, q, scale, bias, y + r * N, N, n0, n1);
    for (; r < M; ++r) dot_block<1, 4>(x + r * K, K, q, scale, bias, y + r * N, N, n0, n1);
  });
}

// few_rows for a scale per group (a separate loop: sharing one with the scale per row made
// the compiler's per-row code slower, 2.2 -> 2.8 ms for the default model's gate/up layers).
void few_rows_grouped(const float* x, int64_t M, int64_t K, const int8_t* q,
                      const float* scale, int64_t S, const float* bias, float* y, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + 8 <= M; r += 8)
      dot_block_grouped<8, 2>(x + r * K, K, q, scale, S, bias, y + r * N, N, n0, n1);
    for (; r + 4 <= M; r += 4)
      dot_block_grouped<4, 4>(x + r * K, K, q, scale, S, bias, y + r * N, N, n0, n1);
    for (; r < M; ++r)
      dot_block_grouped<1, 4>(x + r * K, K, q, scale, S, bias, y + r * N, N, n0, n1);
  });
}

// The groups per row of ``scale`` for int8 weights q [N, K]: 1 for a scale per row ([N]),
// S for [N, S] (S dividing K into groups of a multiple of the vector's lanes).
int64_t scale_groups(const torch::Tensor& q, const torch::Tensor& scale) {
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous(),
              "scale must be a contiguous float32 tensor");
  if (scale.dim() == 1) {
    TORCH_CHECK(scale.numel() == N, "a scale per row needs ", N, " values, not ", scale.numel());
    return 1;
  }
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N, "group scales must be [", N, ", groups]");
  const int64_t S = scale.size(1);
  const int64_t lanes = std::max<int64_t>(kLanes, 1);
  TORCH_CHECK(S >= 1 && K % S == 0 && (K / S) % lanes == 0,
              "groups must split the input size ", K, " evenly into multiples of ", lanes);
  return S;
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias,
                          int64_t few_rows_max) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(),
              "q must be a contiguous 2-D int8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K, "x and q disagree on the input size");
  const int64_t S = scale_groups(q, scale);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat32 &&
                    bias->is_contiguous(),
                "bad bias");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M <= few_rows_max) {
    if (S == 1) {
      few_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), scale.data_ptr<float>(), b,
               y.data_ptr<float>(), N);
    } else {
      few_rows_grouped(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(),
                       scale.data_ptr<float>(), S, b, y.data_ptr<float>(), N);
    }
    return y;
  }
  // NOTE: bands of weight rows, dequantized, then torch's GEMM: a band's floats stay small
  // (an LM head's whole float copy would not). inlinelm/gpu/model/layers/int8.py takes
  // oneDNN's GEMM instead where torch has it.
  const int64_t band = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(K, 1));
  for (int64_t n0 = 0; n0 < N; n0 += band) {
    const int64_t n1 = std::min(N, n0 + band);
    auto wb = dequantize_rows(q, scale, n0, n1);
    auto out = y.narrow(1, n0, n1 - n0);
    if (b != nullptr) {
      out.copy_(torch::addmm(bias->narrow(0, n0, n1 - n0), x, wb.t()));
    } else {
      out.copy_(torch::mm(x, wb.t()));
    }
  }
  return y;
}

torch::Tensor dequantize_rows(const torch::Tensor& q, const torch::Tensor& scale, int64_t n0,
                              int64_t n1) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous(),
              "q must be a contiguous 2-D int8 tensor");
  const int64_t N = q.size(0), K = q.size(1);
  const int64_t S = scale_groups(q, scale);
  const int64_t G = K / S;
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= N, "rows [", n0, ", ", n1, ") are outside [0, ", N, ")");
  auto w = torch::empty({n1 - n0, K}, scale.options());
  float* wp = w.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>() + n0 * K;
  const float* sp = scale.data_ptr<float>() + n0 * S;
  at::parallel_for(0, n1 - n0, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t g = 0; g < S; ++g) {
        const float s = sp[i * S + g];
#pragma omp simd
        for (int64_t k = g * G; k < (g + 1) * G; ++k)
          wp[i * K + k] = static_cast<float>(qp[i * K + k]) * s;
      }
  });
  return w;
}
