// The float vector this machine's CPU has, as a few inline helpers the kernels share:
// AVX-512 (16 lanes) or AVX2 with FMA (8 lanes), compiled for this machine
// (-march=native, at first use). INLINELM_VEC is 0 where neither exists, and every kernel
// then runs its plain loops only.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#include <immintrin.h>

namespace inlinelm {

#if defined(__AVX512F__)
#define INLINELM_VEC 1
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec load(const float* x) { return _mm512_loadu_ps(x); }
inline Vec load(const c10::Half* x) {  // float16, widened (exactly)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
inline void store(float* x, Vec v) { _mm512_storeu_ps(x, v); }
inline void store(c10::Half* x, Vec v) {  // rounded to float16, to nearest even
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline Vec splat(float a) { return _mm512_set1_ps(a); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline float total(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec round_even(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec times_pow2(Vec y, Vec n) { return _mm512_scalef_ps(y, n); }  // y * 2^n
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INLINELM_VEC 1
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec load(const float* x) { return _mm256_loadu_ps(x); }
inline Vec load(const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
inline void store(float* x, Vec v) { _mm256_storeu_ps(x, v); }
inline void store(c10::Half* x, Vec v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline Vec splat(float a) { return _mm256_set1_ps(a); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline float total(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
inline Vec round_even(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec times_pow2(Vec y, Vec n) {  // y * 2^n for integral n in [-126, 127]
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#else
#define INLINELM_VEC 0
constexpr int64_t kLanes = 0;
#endif

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

#if INLINELM_VEC
// e^x, within ~2 float32 ulps (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5
// polynomial for e^r, then the exponent); x is clamped to [-87, 88], where e^x is a normal
// float, which is all silu and tanh-GELU ask of it.
inline Vec exp(Vec x) {
  x = vmin(vmax(x, splat(-87.0f)), splat(88.0f));
  const Vec n = round_even(mul(x, splat(1.44269504088896341f)));
  Vec r = fma(n, splat(-0.693359375f), x);
  r = fma(n, splat(2.12194440e-4f), r);
  Vec p = splat(1.9875691500e-4f);
  p = fma(p, r, splat(1.3981999507e-3f));
  p = fma(p, r, splat(8.3334519073e-3f));
  p = fma(p, r, splat(4.1665795894e-2f));
  p = fma(p, r, splat(1.6666665459e-1f));
  p = fma(p, r, splat(5.0000001201e-1f));
  p = fma(p, mul(r, r), add(r, splat(1.0f)));
  return times_pow2(p, n);
}
#endif

}  // namespace inlinelm
