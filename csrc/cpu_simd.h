// Portable SIMD for the CPU kernels: the extension is compiled for the baseline ISA (the
// wheel's users' CPUs), so the hot loops are compiled again for AVX2 + FMA and picked at load
// time by the CPU's features (GCC target clones), and written in GCC / Clang vector types,
// which the compilers lower to whatever the clone's ISA has.
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

// The clone must be chosen by the CPU's features: GCC dispatches an "arch=haswell" clone by
// CPU model (only on Haswell parts), the ISA level "arch=x86-64-v3" (GCC >= 12) by features;
// older GCCs get an "avx2" clone (features too, without FMA contraction).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#if __GNUC__ >= 12
#define TXL_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define TXL_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#else
#define TXL_CLONES
#endif
#if defined(__GNUC__)
#define TXL_ALWAYS_INLINE __attribute__((always_inline))
#else
#define TXL_ALWAYS_INLINE
#endif

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

// 2^x for 8 floats x <= 0, the softmax's s - max in log2 units: x = n + f with n = round(x),
// |f| <= 1 / 2, 2^f from a degree-5 polynomial (relative error 1.7e-7 in fp32 arithmetic,
// about 1.5 ulp), 2^n built in the exponent bits. Exactly 0 below -126.5 (and at -inf, the
// masked scores); NaN gives NaN through the arithmetic. Positive x is not clamped (there is no
// overflow select): callers pass x <= 0.
TXL_ALWAYS_INLINE inline v8f exp2_8_nonpos(v8f x) {
  const v8i32 under = x < -126.5f;
  const v8f big = v8f{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const v8f n = (x + big) - big;
  const v8f f = x - n;
  v8f p = v8f{} + 1.3264713e-3f;
  p = p * f + 9.6715121e-3f;
  p = p * f + 5.5507340e-2f;
  p = p * f + 2.4022242e-1f;
  p = p * f + 6.9314700e-1f;
  p = p * f + 1.0f;
  const v8i32 e = (__builtin_convertvector(n, v8i32) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &e, sizeof scale);
  const v8f y = p * scale;
  return under ? v8f{} : y;
}
}  // namespace txl_kernels
#endif
