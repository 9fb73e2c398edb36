// Portable SIMD for the CPU kernels: the extension is compiled for the baseline ISA (the
// wheel's users' CPUs), so the hot loops are compiled again for AVX2 + FMA and for AVX-512 (per
// function target attributes, TXL_TARGET_AVX2 / TXL_TARGET_AVX512) and the variant is picked at
// run time from ATen's own choice (cpu_isa.h), and written in GCC / Clang vector types, which
// the compilers lower to whatever the variant's ISA has.
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <array>
#include <cstdint>
#include <cstring>

namespace txl_kernels {
// The fp32 value of every float8_e4m3fn bit pattern (the 8-bit memory's fp8 rows).
inline const std::array<float, 256> kFp8Values = [] {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i)
    t[i] = static_cast<float>(c10::Float8_e4m3fn(i, c10::Float8_e4m3fn::from_bits()));
  return t;
}();
}  // namespace txl_kernels

// The ISA variants' target attributes. TXL_ISA_VARIANTS is 1 where they are compiled (GCC on
// x86-64 Linux); elsewhere the attributes are empty, the variants are the baseline code and the
// dispatcher always picks "default". "arch=x86-64-v3" / "-v4" are the ISA levels (GCC >= 12);
// older GCCs get feature lists ("avx2", without FMA contraction, as their AVX2 code always had).
// cpu_isa.cpp checks that the CPU has every feature a variant was compiled for.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TXL_ISA_VARIANTS 1
#if __GNUC__ >= 12
#define TXL_AVX2_TARGET "arch=x86-64-v3"
#define TXL_AVX512_TARGET "arch=x86-64-v4"
#else
#define TXL_AVX2_TARGET "avx2"
#define TXL_AVX512_TARGET "avx2,fma,avx512f,avx512cd,avx512bw,avx512dq,avx512vl"
#endif
#define TXL_TARGET_AVX2 __attribute__((target(TXL_AVX2_TARGET)))
#define TXL_TARGET_AVX512 __attribute__((target(TXL_AVX512_TARGET)))
#else
#define TXL_ISA_VARIANTS 0
#define TXL_TARGET_AVX2
#define TXL_TARGET_AVX512
#endif
#if defined(__GNUC__)
#define TXL_ALWAYS_INLINE __attribute__((always_inline))
#else
#define TXL_ALWAYS_INLINE
#endif

namespace txl_kernels {
// A software prefetch of every cache line of x[0, n): for rows the hardware prefetcher does
// not follow (short rows streamed from memory, rows a page apart). No-op without
// __builtin_prefetch.
template <typename X>
TXL_ALWAYS_INLINE inline void prefetch_span(const X* x, int64_t n) {
#if defined(__GNUC__)
  constexpr int64_t line = 64 / static_cast<int64_t>(sizeof(X));
  for (int64_t d = 0; d < n; d += line) __builtin_prefetch(x + d);
  __builtin_prefetch(x + n - 1);
#else
  (void)x;
  (void)n;
#endif
}
}  // namespace txl_kernels

#if defined(__GNUC__)
#define TXL_VEC8 1
namespace txl_kernels {
typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8i8 __attribute__((vector_size(8)));
typedef int32_t v8i32 __attribute__((vector_size(32)));

TXL_ALWAYS_INLINE inline v8f loadu8(const float* x) {
  v8f v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
TXL_ALWAYS_INLINE inline void storeu8(float* x, v8f v) { std::memcpy(x, &v, sizeof v); }
TXL_ALWAYS_INLINE inline float hsum8(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
TXL_ALWAYS_INLINE inline float hmax8(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// 16 lanes, the AVX-512 variant's width (in the other variants the 8-lane code runs).
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i32 __attribute__((vector_size(64)));
template <typename V>
struct VecInt;  // the int32 vector of V's width (the comparisons' masks)
template <>
struct VecInt<v8f> {
  using type = v8i32;
};
template <>
struct VecInt<v16f> {
  using type = v16i32;
};
template <typename V>
TXL_ALWAYS_INLINE inline V loadu(const float* x) {
  V v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
template <typename V>
TXL_ALWAYS_INLINE inline void storeu(float* x, V v) {
  std::memcpy(x, &v, sizeof v);
}
TXL_ALWAYS_INLINE inline float hsum(v8f v) { return hsum8(v); }
TXL_ALWAYS_INLINE inline float hsum(v16f v) {  // the two halves added, then hsum8
  v8f lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  return hsum8(lo + hi);
}
TXL_ALWAYS_INLINE inline float hmax(v8f v) { return hmax8(v); }
TXL_ALWAYS_INLINE inline float hmax(v16f v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// 2^x for a vector of floats x <= 0, the softmax's s - max in log2 units: x = n + f with
// n = round(x), |f| <= 1 / 2, 2^f from a degree-5 polynomial (relative error 1.7e-7 in fp32
// arithmetic, about 1.5 ulp), 2^n built in the exponent bits. Exactly 0 below -126.5 (and at
// -inf, the masked scores); NaN gives NaN through the arithmetic. Positive x is not clamped
// (there is no overflow select): callers pass x <= 0. Lane by lane, so every width gives the
// same values.
template <typename V>
TXL_ALWAYS_INLINE inline V exp2_nonpos(V x) {
  using VI = typename VecInt<V>::type;
  const VI under = x < -126.5f;
  const V big = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x + big) - big;
  const V f = x - n;
  V p = V{} + 1.3264713e-3f;
  p = p * f + 9.6715121e-3f;
  p = p * f + 5.5507340e-2f;
  p = p * f + 2.4022242e-1f;
  p = p * f + 6.9314700e-1f;
  p = p * f + 1.0f;
  const VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &e, sizeof scale);
  const V y = p * scale;
  return under ? V{} : y;
}
}  // namespace txl_kernels
#endif
