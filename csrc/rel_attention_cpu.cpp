// Fused Transformer-XL relative attention on CPUs, forward and backward, flash-attention style:
// no Lq x Lk tensor is ever formed (docs/cpu.md).
//
// The CPU kernels of the attention ops (one schema per direction, txl_kernels/_op.py; their CUDA
// kernels are the Triton ones):
//   txl_kernels::rel_attn_fwd(q, k, v, r, r_w_bias, r_r_bias, softmax_scale, wl, wr, kpm?, mask?,
//       band?, p, seed?, mem_k?, mem_k_scale?, mem_v?, mem_v_scale?, r_first_distance?)
//       -> (out, lse)
//   txl_kernels::rel_attn_fwd.out(<the same>, *, out!) -> lse   (into out, which may be q)
//   txl_kernels::rel_attn_bwd(dout, q, k, v, r, r_w_bias, r_r_bias, out, lse, softmax_scale, wl,
//       wr, kpm?, mask?, band?, deterministic, p, seed?, r_first_distance?)
//       -> (dq, dk, dv, dr, dr_w_bias, dr_r_bias)   (always deterministic here)
//   txl_kernels::rel_attn_decode: its CPU kernel is in decode_attention.cpp
//
// Forward, per (batch, head, query block [i0, i0 + m)), over the key tiles [j0, j0 + n) that
// the window / band leaves: AC = (q + u) K^T is one GEMM; BD needs r rows p = j - i + c
// (c = Lq - 1, or r_first_distance - Lk + Lq when r's row 0 holds that distance: rows outside
// [0, R) read as 0), for the tile the window of m + n - 1 rows starting at
// P0 = j0 - (i0 + m - 1) + c, and
// T = (q + vb) Rwin^T is one GEMM whose row a, read from column m - 1 - a on, is BD's row a
// (the skew is a pointer offset). Consecutive tiles' windows overlap in m - 1 rows: T is kept
// and shifted, so each tile computes only its n new columns (BD costs one QK-sized GEMM).
// Then the online softmax in fp32 (fp64 for fp64 inputs) in log2 units, P @ V, and the row
// log-sum-exp (natural log).
// Backward (FlashAttention-2), per (batch, head): each query block recomputes P from the saved
// lse (the difference S - lse in natural units, S rounded to them as the forward rounded the
// lse, so that a saturated row's P is exactly 1); dV += P^T dO, dP = dO V^T,
// dS = P (dP - rowsum(dO O)) (0 where P is 1); dq_u = dS K, dK += dS^T (q + u);
// the un-skewed dS accumulates in a window buffer dT laid out like T, and the columns that no
// later tile touches are flushed: dq_v += dT Rwin, dR[win] += dT^T (q + vb). The tasks are
// (batch, head, split): with fewer (batch, head) pairs than threads each pair's query blocks are
// dealt to several splits, each with its own dK, dV, dR, du and dvb accumulators; these are
// summed over the splits, then dR, du and dvb over the batch, in a fixed order. Results depend
// on the thread count only through the number of splits (1 whenever batch * heads >= threads).
//
// GEMMs go to the BLAS that libtorch_cpu carries and exports (sgemm_ / dgemm_, MKL in the x86
// wheels; ATen's own cpublas::gemm is not exported to extensions), through at::addmm_ on views
// where torch exports no BLAS symbol. bf16 / fp16 tiles are converted to fp32 first (one tile
// row per key, so the conversions cost 1 / m of the GEMMs), except on CPUs with AMX for the
// dtype, where the forward's GEMMs and the backward's scores and dO V^T run on oneDNN's brgemm
// in the input dtype ("bf16 / fp16 GEMMs on oneDNN's brgemm" below); fp32 / fp64 tiles are
// read in place through their row strides. fp32 takes the same brgemm route, with fp32
// operands, where that is the faster library ("fp32 GEMMs: the BLAS or oneDNN's brgemm").
// The row loops (scale, max, exp, sums) are in cpu_simd.h's vector types, compiled for the
// baseline, AVX2 + FMA and AVX-512, the variant chosen at run time from ATen's own choice
// (cpu_isa.h): at::vec compiles to its scalar fallback in an extension built for the baseline
// ISA.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "cpu_isa.h"
#include "cpu_simd.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

extern "C" {
// libtorch_cpu's BLAS (weak: a torch build without one falls back to ATen's own kernel)
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
            const float*, const int*, const float*, const int*, const float*, float*,
            const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*,
            const double*, const int*, const double*, const int*, const double*, double*,
            const int*) __attribute__((weak));
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));  // MKL's C interface
// MKL's packed GEMM (CBLAS, 32-bit ints): an operand packed once, multiplied many times
size_t cblas_sgemm_pack_get_size(int, int, int, int) __attribute__((weak));
void cblas_sgemm_pack(int, int, int, int, int, int, float, const float*, int, float*)
    __attribute__((weak));
void cblas_sgemm_compute(int, int, int, int, int, int, const float*, int, const float*, int,
                         float, float*, int) __attribute__((weak));
}

namespace txl_kernels {
namespace {

// Every GEMM runs on one thread, whatever torch's thread count: the kernel parallelises over
// its own tasks, and MKL's results depend on how many threads it uses.
struct SequentialBlas {
  int prev = 0;
  SequentialBlas() {
    if (MKL_Set_Num_Threads_Local) prev = MKL_Set_Num_Threads_Local(1);
  }
  ~SequentialBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(prev);
  }
};

constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
// The softmax runs in log2 units: the scores come scaled by softmax_scale * log2(e) and go through
// 2^x (cheaper than e^x: no Cody-Waite reduction); the lse goes back to natural log.
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

// Row-major C[M, N] = alpha * op(A) op(B) + beta * C (op: transpose when ta / tb).
template <typename T>
void gemm_rm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
             int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  // column-major: C^T = op(B)^T op(A)^T
  const char cb = tb ? 'T' : 'N', ca = ta ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  if constexpr (std::is_same<T, float>::value) {
    if (sgemm_) {
      sgemm_(&cb, &ca, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
      return;
    }
  } else {
    if (dgemm_) {
      dgemm_(&cb, &ca, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
      return;
    }
  }
  // no BLAS symbol in this torch build: ATen's matmul on views of the same memory
  auto opt = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  at::Tensor a = ta ? at::from_blob(const_cast<T*>(A), {K, M}, {lda, 1}, opt).t()
                    : at::from_blob(const_cast<T*>(A), {M, K}, {lda, 1}, opt);
  at::Tensor b = tb ? at::from_blob(const_cast<T*>(B), {N, K}, {ldb, 1}, opt).t()
                    : at::from_blob(const_cast<T*>(B), {K, N}, {ldb, 1}, opt);
  at::Tensor c = at::from_blob(C, {M, N}, {ldc, 1}, opt);
  if (beta == T(0)) c.zero_();
  c.addmm_(a, b, beta == T(0) ? T(1) : beta, alpha);
}

// MKL's CBLAS constants
constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112, kCblasPacked = 151,
              kCblasBMatrix = 162;

// fp32 B = X^T for row-major C[M, N] = A[M, K] B, X [N, K] with rows ld apart, packed once
// (MKL's packed GEMM): band tiles multiply every query block by the same short position table
// (all its rows), which plain sgemm would pack again for each block.
struct PackedBT {
  at::Tensor buf;
  int N = 0, K = 0;
  static bool available() {
    return cblas_sgemm_pack_get_size && cblas_sgemm_pack && cblas_sgemm_compute;
  }
  void pack(const float* X, int64_t ld, int64_t N_, int64_t K_, int64_t M_hint) {
    N = static_cast<int>(N_);
    K = static_cast<int>(K_);
    const size_t bytes = cblas_sgemm_pack_get_size(kCblasBMatrix, static_cast<int>(M_hint), N, K);
    const int64_t floats = static_cast<int64_t>(bytes / sizeof(float)) + 16;
    if (!buf.defined() || buf.numel() < floats) buf = at::empty({floats}, at::kFloat);
    cblas_sgemm_pack(kCblasRowMajor, kCblasBMatrix, kCblasTrans, static_cast<int>(M_hint), N, K,
                     1.0f, X, static_cast<int>(ld), buf.data_ptr<float>());
  }
  // C[M, N] = A[M, K] B (beta 0)
  void compute(int64_t M, const float* A, int64_t lda, float* C, int64_t ldc) const {
    cblas_sgemm_compute(kCblasRowMajor, kCblasNoTrans, kCblasPacked, static_cast<int>(M), N, K,
                        A, static_cast<int>(lda), buf.data_ptr<float>(), K, 0.0f, C,
                        static_cast<int>(ldc));
  }
};

// ---- row loops: generic, and for fp32 in vector types, compiled per ISA variant (cpu_isa.h)

template <typename T>
T add_max(T* s, const T* t, int64_t n, T c) {  // s = c (s + t); returns max(s)
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t x = 0; x < n; ++x) {
    s[x] = c * (s[x] + t[x]);
    m = s[x] > m ? s[x] : m;
  }
  return m;
}
template <typename T>
T row_max(const T* s, int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t x = 0; x < n; ++x) m = s[x] > m ? s[x] : m;
  return m;
}
template <typename T>
T exp2_sum(T* s, int64_t n, T mx) {  // s = 2^(s - mx) (0 at -inf); returns the sum
  T sum = 0;
  for (int64_t x = 0; x < n; ++x) {
    s[x] = std::exp2(s[x] - mx);
    sum += s[x];
  }
  return sum;
}
template <typename T>
void mul_rows(T* s, const T* z, int64_t n) {  // s *= z
  for (int64_t x = 0; x < n; ++x) s[x] *= z[x];
}
template <typename T>
void scale_row(T* s, T c, int64_t n) {
  for (int64_t x = 0; x < n; ++x) s[x] *= c;
}
template <typename T>
void add_row(T* s, const T* t, int64_t n, T c) {  // s = c (s + t)
  for (int64_t x = 0; x < n; ++x) s[x] = c * (s[x] + t[x]);
}
template <typename T>
void exp_diff(T* s, int64_t n, T c) {  // s = e^(s - c), as 2^((s - c) log2 e) (0 at -inf)
  const T l2e = static_cast<T>(kLog2e);
  for (int64_t x = 0; x < n; ++x) s[x] = std::exp2((s[x] - c) * l2e);
}
// dS = sc * P (dP - delta), into dp. Where P is exactly 1 the row's softmax is saturated (the
// other probabilities sum to less than an ulp of 1) and its Jacobian diag(P) - P P^T is 0:
// dS is then sc * 0 * (dp - delta), 0 (NaN where dp or delta is), not the scale times the
// rounding of dP - rowsum(dO * O), two sums of one value in different orders.
template <typename T>
void ds_row(T* dp, const T* p, int64_t n, T sc, T delta) {
  for (int64_t x = 0; x < n; ++x) dp[x] = sc * (p[x] == T(1) ? T(0) : p[x]) * (dp[x] - delta);
}

#ifdef TXL_VEC8
// The fp32 row loops, written once over the vector type V (v8f, or v16f in the AVX-512
// variant), compiled per ISA variant below and called through the variant's table.
namespace rows {
template <typename V>
TXL_ALWAYS_INLINE inline float add_max(float* s, const float* t, int64_t n, float c) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  float m = -std::numeric_limits<float>::infinity();
  int64_t x = 0;
  if (n >= W) {
    V mv = V{} + m;
    for (; x + W <= n; x += W) {
      const V v = (loadu<V>(s + x) + loadu<V>(t + x)) * c;
      storeu(s + x, v);
      mv = v > mv ? v : mv;
    }
    m = hmax(mv);
  }
  for (; x < n; ++x) {
    s[x] = c * (s[x] + t[x]);
    m = s[x] > m ? s[x] : m;
  }
  return m;
}
template <typename V>
TXL_ALWAYS_INLINE inline float row_max(const float* s, int64_t n) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  float m = -std::numeric_limits<float>::infinity();
  int64_t x = 0;
  if (n >= W) {
    V mv = loadu<V>(s);
    for (x = W; x + W <= n; x += W) {
      const V v = loadu<V>(s + x);
      mv = v > mv ? v : mv;
    }
    m = hmax(mv);
  }
  for (; x < n; ++x) m = s[x] > m ? s[x] : m;
  return m;
}
template <typename V>
TXL_ALWAYS_INLINE inline float exp2_sum(float* s, int64_t n, float mx) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  V acc = {};
  int64_t x = 0;
  for (; x + W <= n; x += W) {
    const V e = exp2_nonpos(loadu<V>(s + x) - mx);
    storeu(s + x, e);
    acc += e;
  }
  float sum = hsum(acc);
  for (; x < n; ++x) {
    s[x] = std::exp2(s[x] - mx);
    sum += s[x];
  }
  return sum;
}
TXL_ALWAYS_INLINE inline void mul_rows(float* s, const float* z, int64_t n) {
  for (int64_t x = 0; x < n; ++x) s[x] *= z[x];
}
TXL_ALWAYS_INLINE inline void scale_row(float* s, float c, int64_t n) {
  for (int64_t x = 0; x < n; ++x) s[x] *= c;
}
TXL_ALWAYS_INLINE inline void add_row(float* s, const float* t, int64_t n, float c) {
  for (int64_t x = 0; x < n; ++x) s[x] = c * (s[x] + t[x]);
}
template <typename V>
TXL_ALWAYS_INLINE inline void exp_diff(float* s, int64_t n, float c) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  const float l2e = static_cast<float>(kLog2e);
  int64_t x = 0;
  for (; x + W <= n; x += W) storeu(s + x, exp2_nonpos((loadu<V>(s + x) - c) * l2e));
  for (; x < n; ++x) s[x] = std::exp2((s[x] - c) * l2e);
}
TXL_ALWAYS_INLINE inline void ds_row(float* dp, const float* p, int64_t n, float sc,
                                     float delta) {
  for (int64_t x = 0; x < n; ++x) dp[x] = sc * (p[x] == 1.0f ? 0.0f : p[x]) * (dp[x] - delta);
}

struct Table {
  float (*add_max)(float*, const float*, int64_t, float);
  float (*row_max)(const float*, int64_t);
  float (*exp2_sum)(float*, int64_t, float);
  void (*mul_rows)(float*, const float*, int64_t);
  void (*scale_row)(float*, float, int64_t);
  void (*add_row)(float*, const float*, int64_t, float);
  void (*exp_diff)(float*, int64_t, float);
  void (*ds_row)(float*, const float*, int64_t, float, float);
};

// One ISA variant: the loops compiled under ATTR with vectors V, and its table.
#define TXL_ROW_VARIANT(ISA, ATTR, V)                                                         \
  namespace ISA {                                                                             \
  ATTR float add_max(float* s, const float* t, int64_t n, float c) {                          \
    return rows::add_max<V>(s, t, n, c);                                                      \
  }                                                                                           \
  ATTR float row_max(const float* s, int64_t n) { return rows::row_max<V>(s, n); }            \
  ATTR float exp2_sum(float* s, int64_t n, float mx) { return rows::exp2_sum<V>(s, n, mx); }  \
  ATTR void mul_rows(float* s, const float* z, int64_t n) { rows::mul_rows(s, z, n); }        \
  ATTR void scale_row(float* s, float c, int64_t n) { rows::scale_row(s, c, n); }             \
  ATTR void add_row(float* s, const float* t, int64_t n, float c) { rows::add_row(s, t, n, c); } \
  ATTR void exp_diff(float* s, int64_t n, float c) { rows::exp_diff<V>(s, n, c); }            \
  ATTR void ds_row(float* dp, const float* p, int64_t n, float sc, float delta) {             \
    rows::ds_row(dp, p, n, sc, delta);                                                        \
  }                                                                                           \
  constexpr Table kTable = {add_max, row_max, exp2_sum, mul_rows,                             \
                            scale_row, add_row, exp_diff, ds_row};                            \
  }
TXL_ROW_VARIANT(isa_default, , v8f)
TXL_ROW_VARIANT(isa_avx2, TXL_TARGET_AVX2, v8f)
TXL_ROW_VARIANT(isa_avx512, TXL_TARGET_AVX512, v16f)
#undef TXL_ROW_VARIANT

// The table of the variant that cpu_isa() names (cpu_isa.h).
inline const Table& table() {
  static constexpr const Table* kTables[] = {&isa_default::kTable, &isa_avx2::kTable,
                                             &isa_avx512::kTable};
  return *kTables[static_cast<int>(cpu_isa())];
}
}  // namespace rows

// The fp32 overloads of the row loops above (the templates serve fp64).
inline float add_max(float* s, const float* t, int64_t n, float c) {
  return rows::table().add_max(s, t, n, c);
}
inline float row_max(const float* s, int64_t n) { return rows::table().row_max(s, n); }
inline float exp2_sum(float* s, int64_t n, float mx) { return rows::table().exp2_sum(s, n, mx); }
inline void mul_rows(float* s, const float* z, int64_t n) { rows::table().mul_rows(s, z, n); }
inline void scale_row(float* s, float c, int64_t n) { rows::table().scale_row(s, c, n); }
inline void add_row(float* s, const float* t, int64_t n, float c) {
  rows::table().add_row(s, t, n, c);
}
inline void exp_diff(float* s, int64_t n, float c) { rows::table().exp_diff(s, n, c); }
inline void ds_row(float* dp, const float* p, int64_t n, float sc, float delta) {
  rows::table().ds_row(dp, p, n, sc, delta);
}
#endif

// ---- dropout: the Triton kernels' Philox-4x32-10 keep-mask, element for element

inline uint32_t mulhi(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

inline void philox(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    const uint32_t c0 = c[0], c2 = c[2];
    c[0] = mulhi(0xCD9E8D57u, c2) ^ c[1] ^ k0;
    c[2] = mulhi(0xD2511F53u, c0) ^ c[3] ^ k1;
    c[1] = 0xCD9E8D57u * c2;
    c[3] = 0xD2511F53u * c0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

struct Dropout {
  bool on = false;
  uint64_t seed = 0, offset = 0;
  uint32_t t_hi = 0;    // theta >> 16: the 7-bit threshold T
  uint32_t f_wide = 0;  // theta & 0xFFFF (F) with bit 4 k + m at bit 8 k + m, as s below
  double keep_factor = 1.0;  // 1 / (1 - theta / 2^23)

  // theta = dropout_threshold(p) (ops/_common.py): round(p 2^23), within [1, 2^23 - 1]
  void set(double p) {
    const double res = 8388608.0;  // 2^23
    const uint32_t theta =
        static_cast<uint32_t>(std::min(std::max(std::floor(p * res + 0.5), 1.0), res - 1.0));
    t_hi = theta >> 16;
    const uint32_t f = theta & 0xFFFFu;
    f_wide = (f & 0xFu) | ((f & 0xF0u) << 4) | ((f & 0xF00u) << 8) | ((f & 0xF000u) << 12);
    keep_factor = res / (res - theta);
  }

  // z[a * ldz + b] = keep(bh, i0 + a, j0 + b) ? keep_factor : 0, the Triton kernels' mask
  // (ops/_common.py, dropout_keep). Query rows i = 16 x + 8 t + y form the row pair
  // pair = (bh * ceil(Lq / 16) + x) * 8 + y; key j = 32 h + 16 u + 8 g + 2 q + e takes byte
  // 2 g + e of word 2 t + u of the Philox call with counter
  // (4 h + q, pair, offset, (offset >> 32) + (pair >> 32)); kept when that byte's low 7 bits
  // are >= T + [s < F], s the call's 16 top bits (bit 7 of byte k of word m at bit 4 k + m,
  // compared here spread out to bit 8 k + m like f_wide).
  template <typename T>
  void keep_scale(int64_t bh, int64_t Lq, int64_t i0, int64_t m, int64_t j0, int64_t n, T* z,
                  int64_t ldz) const {
    const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    const int64_t row_tiles = (Lq + 15) / 16;
    for (int64_t a = 0; a < m; ++a) {
      const int64_t i = i0 + a;
      const uint64_t pair = static_cast<uint64_t>((bh * row_tiles + i / 16) * 8 + i % 8);
      const int t = static_cast<int>((i % 16) / 8);
      T* zr = z + a * ldz;
      for (int64_t h = j0 >> 5; h <= (j0 + n - 1) >> 5; ++h) {
        for (int q = 0; q < 4; ++q) {
          uint32_t c[4] = {static_cast<uint32_t>(h * 4 + q), static_cast<uint32_t>(pair),
                           static_cast<uint32_t>(offset),
                           static_cast<uint32_t>((offset >> 32) + (pair >> 32))};
          philox(c, k0, k1);
          const uint32_t s = ((c[0] >> 7) & 0x01010101u) | ((c[1] >> 6) & 0x02020202u) |
                             ((c[2] >> 5) & 0x04040404u) | ((c[3] >> 4) & 0x08080808u);
          const uint32_t threshold = t_hi + (s < f_wide ? 1u : 0u);
          for (int u = 0; u < 2; ++u) {
            const uint32_t w = c[2 * t + u];
            for (int g = 0; g < 2; ++g) {
              for (int e = 0; e < 2; ++e) {
                const int64_t j = h * 32 + 16 * u + 8 * g + 2 * q + e;
                if (j >= j0 && j < j0 + n) {
                  const uint32_t low7 = (w >> (8 * (2 * g + e))) & 0x7Fu;
                  zr[j - j0] = low7 >= threshold ? T(keep_factor) : T(0);
                }
              }
            }
          }
        }
      }
    }
  }
};

// ---- operands

// The [L, D] rows of one (batch, head) of a [B, L, H, D] tensor, optionally preceded by the M
// rows of an 8-bit memory (dequantised as txl_kernels.quant.dequantize_per_token does: the
// fp32 product of value and scale, rounded to the input dtype).
template <typename scalar_t, typename acc_t>
struct Rows {
  const scalar_t* base = nullptr;  // row `first` of the segment
  int64_t ld = 0, D = 0, M = 0;
  int64_t first = 0;  // the segment row base holds (a copy of a row range: band tiles)
  const PackedBT* packed = nullptr;  // all rows packed as a GEMM's B^T (fp32), or none
  const uint8_t* mem = nullptr;  // memory row 0 (int8 or fp8 bytes)
  int64_t mem_ld = 0;
  bool mem_fp8 = false;
  const float* scale_f = nullptr;
  const at::Half* scale_h = nullptr;
  int64_t scale_ld = 0;

  acc_t mem_value(int64_t j, int64_t d) const {
    const uint8_t x = mem[j * mem_ld + d];
    const float v = mem_fp8 ? kFp8Values[x] : static_cast<float>(static_cast<int8_t>(x));
    const float s = scale_f ? scale_f[j * scale_ld] : static_cast<float>(scale_h[j * scale_ld]);
    return static_cast<acc_t>(static_cast<scalar_t>(v * s));
  }

  // rows [j0, j0 + n) as acc_t: in place (fp32 / fp64 segment rows) or converted into buf
  const acc_t* get(int64_t j0, int64_t n, acc_t* buf, int64_t* ldo) const {
    if constexpr (std::is_same<scalar_t, acc_t>::value) {
      if (j0 >= M) {
        *ldo = ld;
        return base + (j0 - M - first) * ld;
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      const int64_t j = j0 + t;
      acc_t* o = buf + t * D;
      if (j < M) {
        for (int64_t d = 0; d < D; ++d) o[d] = mem_value(j, d);
      } else {
        const scalar_t* x = base + (j - M - first) * ld;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<acc_t>(x[d]);
      }
    }
    *ldo = D;
    return buf;
  }

  // row j in the input dtype: in place (segment rows) or dequantised into buf [D]
  const scalar_t* raw(int64_t j, scalar_t* buf) const {
    if (j >= M) return base + (j - M - first) * ld;
    for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<scalar_t>(mem_value(j, d));
    return buf;
  }
};

// ---- non-finite operand rows: what the masks exclude must not reach the results
//
// A masked pair's probability (and its dS) is an exact 0, but a GEMM over a tile still
// multiplies it with the excluded key's k / v / r row: 0 * NaN or 0 * inf is NaN. The rows
// holding a NaN or an inf are therefore flagged (the backward flags each (batch, head)'s k, v
// and r rows once per task, the forward every v row once per call where masks apply); a tile with
// flagged rows (none in the usual case, which then reads the tile as it is) has them zeroed in
// a copy for the GEMM, and each pair the masks allow adds its product with the original row
// back (add_allowed), so the rows that attend such a key still come out non-finite.

// whether x[0, n) holds a NaN or an inf (an OR of exponent-field tests, which the compiler
// vectorises, where a floating-point sum would be kept in order)
template <typename T>
bool any_nonfinite(const T* x, int64_t n) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr U e = sizeof(T) == 4 ? U(0x7f800000u) : U(0x7ff0000000000000ull);
  U bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    U b;
    std::memcpy(&b, x + i, sizeof b);
    bad |= U((b & e) == e);
  }
  return bad != 0;
}

// The flagged rows t of the tile X [n, D] (row stride *ld), into bad. When there are any,
// returns X copied into buf (or buf itself when X is buf) with those rows 0 and sets
// *ld = D; else returns X.
template <typename T>
const T* zero_flagged_rows(const T* X, int64_t* ld, int64_t n, int64_t D, const uint8_t* flags,
                           T* buf, std::vector<int64_t>& bad) {
  bad.clear();
  for (int64_t t = 0; t < n; ++t)
    if (flags[t]) bad.push_back(t);
  if (bad.empty()) return X;
  const int64_t l = *ld;
  if (X != buf)
    for (int64_t t = 0; t < n; ++t) std::memcpy(buf + t * D, X + t * l, D * sizeof(T));
  for (const int64_t t : bad) std::fill(buf + t * D, buf + (t + 1) * D, T(0));
  *ld = D;
  return buf;
}

// A scratch buffer on torch's CPU allocator (64-byte aligned): the BLAS may take a different
// path, with different rounding, for other alignments, and results must not depend on where
// malloc put a buffer.
template <typename T>
struct Scratch {
  at::Tensor t;
  T* p = nullptr;
  int64_t n = 0;
  explicit Scratch(int64_t size)
      : t(at::empty({std::max<int64_t>(size, 1)},
                    at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value))),
        p(t.data_ptr<T>()), n(size) {}
  T* data() { return p; }
  T* begin() { return p; }
  T* end() { return p + n; }
  T& operator[](int64_t i) { return p[i]; }
};

// band tiles (use_band_tiles): query rows per block, widest window, query blocks per
// forward task
constexpr int64_t kBandBM = 64, kBandMaxW = 1024, kBandChunk = 8;

struct Geometry {
  int64_t B, Lq, Lk, H, D, R, mlen;
  int64_t c;  // row constant: the pair (i, j) reads r's row j - i + c
  int64_t dlo, dhi;  // allowed distances d = i + mlen - j: dlo <= d <= dhi (window / band)
  double softmax_scale;
  const bool* kpm = nullptr;  // [B, Lk]
  int64_t kpm_s0 = 0, kpm_s1 = 0;
  const bool* mask = nullptr;  // [B, H, Lq, Lk] (expanded view)
  int64_t ms[4] = {0, 0, 0, 0};
  Dropout drop;
  int64_t BM, BN;
  bool band = false;  // a narrow window: band tiles (use_band_tiles), heads innermost
  int64_t splits = 1;  // backward: tasks per (batch, head), each over its share of query blocks

  // key range of query rows [i0, i0 + m): [jlo, jhi]
  void key_range(int64_t i0, int64_t m, int64_t* jlo, int64_t* jhi) const {
    *jlo = std::max<int64_t>(0, dhi >= kInf ? 0 : i0 + mlen - dhi);
    *jhi = std::min<int64_t>(Lk - 1, dlo <= -kInf ? Lk - 1 : i0 + m - 1 + mlen - dlo);
  }

  // -inf at the masked pairs of the scores tile S [m, n] (ld lds)
  template <typename T>
  void apply_masks(int64_t b, int64_t h, int64_t i0, int64_t m, int64_t j0, int64_t n, T* S,
                   int64_t lds) const {
    const T ninf = -std::numeric_limits<T>::infinity();
    for (int64_t a = 0; a < m; ++a) {
      const int64_t i = i0 + a;
      T* s = S + a * lds;
      // window: j in [i + mlen - dhi, i + mlen - dlo]
      const int64_t lo = dhi >= kInf ? 0 : i + mlen - dhi - j0;
      const int64_t hi = dlo <= -kInf ? n - 1 : i + mlen - dlo - j0;
      for (int64_t t = 0; t < std::min<int64_t>(lo, n); ++t) s[t] = ninf;
      for (int64_t t = std::max<int64_t>(hi + 1, 0); t < n; ++t) s[t] = ninf;
      if (mask) {
        const bool* mr = mask + b * ms[0] + h * ms[1] + i * ms[2] + j0 * ms[3];
        for (int64_t t = 0; t < n; ++t)
          if (mr[t * ms[3]]) s[t] = ninf;
      }
    }
    if (kpm) {
      const bool* kr = kpm + b * kpm_s0 + j0 * kpm_s1;
      for (int64_t t = 0; t < n; ++t)
        if (kr[t * kpm_s1])
          for (int64_t a = 0; a < m; ++a) S[a * lds + t] = ninf;
    }
  }
  // whether query i may attend key j: a pair (0 <= j < Lk) inside the window / band that
  // neither attn_mask nor key_padding_mask masks
  bool allowed(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (j < 0 || j >= Lk) return false;
    const int64_t d = i + mlen - j;
    if (d < dlo || d > dhi) return false;
    if (mask && mask[b * ms[0] + h * ms[1] + i * ms[2] + j * ms[3]]) return false;
    return !(kpm && kpm[b * kpm_s0 + j * kpm_s1]);
  }
  bool tile_needs_masks(int64_t i0, int64_t m, int64_t j0, int64_t n) const {
    if (kpm || mask) return true;
    // every pair inside the window: d in [i0 + mlen - (j0 + n - 1), i0 + m - 1 + mlen - j0]
    const int64_t dmin = i0 + mlen - (j0 + n - 1), dmax = i0 + m - 1 + mlen - j0;
    return dmin < dlo || dmax > dhi;
  }
};

// The rolling window T (or dT) of one query block: row a of the current tile's window holds
// columns [0, m + n - 1) at stride tw; column c is r row P0 + c.
template <typename acc_t>
void shift_window(acc_t* T, int64_t m, int64_t tw, int64_t by, bool zero_new, int64_t width) {
  for (int64_t a = 0; a < m; ++a) {
    acc_t* t = T + a * tw;
    std::memmove(t, t + by, static_cast<size_t>(m - 1) * sizeof(acc_t));
    if (zero_new) std::fill(t + m - 1, t + width, acc_t(0));
  }
}

// Where the window T of one query block starts in its scratch buffer: offset so that column
// BM - 1 of each row, where the n columns each key tile adds begin, is 64-byte aligned (rows
// are tw = BM + BN apart, a multiple of 16 for full blocks). The BLAS writes those columns
// faster when aligned (measured: the window GEMM ~10% faster at T 4,096); the products are the
// same, so results do not change.
constexpr int64_t kWindowPad = 16;  // elements a window buffer holds beyond BM * tw

template <typename acc_t>
acc_t* window_base(Scratch<acc_t>& buf, int64_t BM) {
  constexpr int64_t per_line = 64 / static_cast<int64_t>(sizeof(acc_t));
  return buf.data() + (per_line - (BM - 1) % per_line) % per_line;
}

template <typename scalar_t, typename acc_t>
struct Head {  // the operands of one (batch, head)
  Rows<scalar_t, acc_t> K, V, Rr;
};

// flags[j] for the n rows j0 + j of X (read BN rows at a time through buf): whether the row
// holds a NaN or an inf
template <typename scalar_t, typename acc_t>
void flag_nonfinite_rows(const Rows<scalar_t, acc_t>& X, int64_t n, int64_t BN, acc_t* buf,
                         uint8_t* flags, int64_t j0 = 0) {
  for (int64_t j = 0; j < n; j += BN) {
    const int64_t c = std::min(BN, n - j);
    int64_t ld;
    const acc_t* p = X.get(j0 + j, c, buf, &ld);
    for (int64_t t = 0; t < c; ++t) flags[j + t] = any_nonfinite(p + t * ld, X.D);
  }
}

// C[a] += A[a, t] * X[first + t] for the rows t in bad (read again from X, into row: the tile
// copy holds them zeroed) and the query rows a (query i0 + a, C and A rows D and lda apart)
// whose pair with key key(a, t) the masks allow
template <typename scalar_t, typename acc_t, typename KeyOf>
void add_allowed(const Geometry& g, int64_t b, int64_t h, int64_t i0, int64_t m,
                 const Rows<scalar_t, acc_t>& X, int64_t first, const std::vector<int64_t>& bad,
                 KeyOf key, const acc_t* A, int64_t lda, acc_t* C, acc_t* row) {
  for (const int64_t t : bad) {
    int64_t l;
    const acc_t* x = X.get(first + t, 1, row, &l);
    for (int64_t a = 0; a < m; ++a) {
      if (!g.allowed(b, h, i0 + a, key(a, t))) continue;
      const acc_t p = A[a * lda + t];
      for (int64_t d = 0; d < g.D; ++d) C[a * g.D + d] += p * x[d];
    }
  }
}

// ---- bf16 / fp16 GEMMs on oneDNN's brgemm micro-kernels (AMX on x86)
//
// Where the CPU packs the dtype natively (at::native::cpublas::could_pack: AMX-BF16 for bf16,
// AMX-FP16 for fp16, the check PyTorch's own CPU flash attention makes) and the row code runs
// its AVX-512 variant (cpu_isa.h: ATen's choice or the override), the forward's three GEMMs
// take the operands in the input dtype with fp32 accumulation: (q + u) K^T and (q + vb) Rwin^T
// with q + bias rounded to the input dtype (as load_q rounds it), and P V with P rounded to the
// input dtype, as PyTorch's bf16 flash attention rounds it. The softmax, the window T and the
// output accumulator stay fp32. The backward recomputes the scores the same way (so P matches
// the saved lse) and takes dP = dO V^T from dO and V in the input dtype; its GEMMs with an
// fp32 operand (P, dS, dT) stay on the fp32 BLAS. Elsewhere (and for fp32 / fp64) the tiles go
// through the fp32 BLAS. brgemm reads B in the VNNI layout, pairs of consecutive K-index rows interleaved:
// B[k, n] at ((k / 2) ldb + n) 2 + k % 2, K padded to even with zeros; the tiles are packed
// into it straight from their rows (the transposes of K and r come free with the packing),
// which serves any N and leading dimension, where cpublas::pack takes untransposed panels of
// 16 to 64 columns only.

template <typename T>
constexpr bool kLowp = std::is_same<T, at::BFloat16>::value || std::is_same<T, at::Half>::value;
// the dtypes the brgemm route serves: bf16 / fp16 (VNNI operands) and fp32
template <typename T>
constexpr bool kBrgemmType = kLowp<T> || std::is_same<T, float>::value;

// forward and backward calls that took the brgemm route (txl_kernels::cpu_brgemm_calls, tests)
std::atomic<int64_t> g_brgemm_calls{0};

// ---- fp32 GEMMs: the BLAS or oneDNN's brgemm
//
// fp32 tiles run on oneDNN's fp32 brgemm micro-kernels (cpublas::brgemm, the JIT kernels of
// the CPU's own ISA) where they are faster than the BLAS: measured on an AMD EPYC (Zen 2,
// AVX2), where MKL's sgemm reaches 31-34 GFLOP/s on the kernel's tile shapes and brgemm 37-38
// on contiguous panels (the forward 6-11% faster in all; BENCHMARKS.md). The choice
// (txl_kernels::cpu_fp32_gemm): TXL_KERNELS_CPU_GEMM = "brgemm" or "blas" where set, else
// brgemm on x86 CPUs not made by Intel when the BLAS is MKL (whose own code paths are tuned for
// Intel's), the BLAS elsewhere; read once per process, forced by the test-only op
// cpu_fp32_gemm_override. The route also needs a vector ISA variant (cpu_isa() is not
// "default"), and the first brgemm call is checked: a torch or CPU that cannot run it stays on
// the BLAS.
enum class Fp32Gemm : int { kBlas = 0, kBrgemm = 1 };
constexpr const char* kFp32GemmNames[] = {"blas", "brgemm"};

bool non_intel_x86() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned int a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  char vendor[13];
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  vendor[12] = 0;
  return std::strcmp(vendor, "GenuineIntel") != 0;
#else
  return false;
#endif
}

// Whether fp32 brgemm runs here: one small product, checked against its exact value (once
// per process).
bool fp32_brgemm_probe() {
#ifdef CPUBLAS_BRGEMM_F32F32F32
  try {
    const float A[4] = {1, 2, 3, 4}, B[4] = {5, 6, 7, 8};
    float C[4] = {0, 0, 0, 0};
    at::native::cpublas::brgemm(2, 2, 2, 2, 2, 2, false, A, B, C, /*is_vnni=*/false);
    at::native::cpublas::brgemm_release(/*is_vnni=*/false);
    return C[0] == 19 && C[1] == 22 && C[2] == 43 && C[3] == 50;
  } catch (const std::exception&) {
    return false;
  }
#else
  return false;
#endif
}

bool fp32_brgemm_runs() {
  static const bool runs = fp32_brgemm_probe();
  return runs;
}

int fp32_gemm_default() {
  static const int choice = [] {
    if (!fp32_brgemm_runs()) return 0;
    const char* env = std::getenv("TXL_KERNELS_CPU_GEMM");
    const std::string want = env ? env : "auto";
    if (want == "brgemm") return 1;
    if (want == "blas") return 0;
    TORCH_CHECK_VALUE(want == "auto", "TXL_KERNELS_CPU_GEMM must be \"auto\", \"brgemm\" or "
                      "\"blas\", got \"", want, "\"");
    return non_intel_x86() && MKL_Set_Num_Threads_Local != nullptr ? 1 : 0;
  }();
  return choice;
}

std::atomic<int> g_fp32_gemm{-1};

Fp32Gemm fp32_gemm() {
  int i = g_fp32_gemm.load(std::memory_order_relaxed);
  if (i < 0) {
    int expected = -1;
    g_fp32_gemm.compare_exchange_strong(expected, fp32_gemm_default(),
                                        std::memory_order_relaxed);
    i = g_fp32_gemm.load(std::memory_order_relaxed);
  }
  return static_cast<Fp32Gemm>(i);
}

// fp32 calls with fewer query rows stay on the BLAS: their K^T and r^T panels, packed once
// per call, would serve one 128-row query block per head, and the packing pass
// costs more than brgemm saves (measured on Zen 2: Transformer-XL segments of 64 queries on
// 704 keys 10-25% slower on brgemm).
constexpr int64_t kFp32BrgemmMinRows = 129;

// Whether a call in dtype st with Lq query rows takes the brgemm route (decided once per call
// from what the forward and the backward both see, so that the backward recomputes the
// forward's scores; never in a torch without cpublas::brgemm): bf16 / fp16 where the CPU packs
// them natively (AMX) under the AVX-512 variant, fp32 from kFp32BrgemmMinRows query rows where
// fp32_gemm() says so under a vector variant.
bool brgemm_route(at::ScalarType st, int64_t Lq) {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  if (st == at::kBFloat16 || st == at::kHalf)
    return cpu_isa() == CpuIsa::kAvx512 && at::native::cpublas::could_pack(st);
#endif
  if (st == at::kFloat)
    return Lq >= kFp32BrgemmMinRows && fp32_gemm() == Fp32Gemm::kBrgemm &&
           cpu_isa() != CpuIsa::kDefault;
  return false;
}

// Releases the hardware state (AMX tiles) that this thread's brgemm calls configured (as
// PyTorch does).
template <typename scalar_t>
void brgemm_done() {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  at::native::cpublas::brgemm_release(/*is_vnni=*/kLowp<scalar_t>);
#endif
}

// q + bias, summed in acc_t and rounded to the input dtype (as the reference rounds it)
template <typename acc_t, typename scalar_t>
inline scalar_t q_plus(scalar_t q, scalar_t bias) {
  return static_cast<scalar_t>(static_cast<acc_t>(q) + static_cast<acc_t>(bias));
}

// C[M, N] (ld ldc) = A[M, K] (ld lda) @ B (ld ldb; VNNI for bf16 / fp16), or += with add
template <typename scalar_t>
void brgemm_call(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc,
                 bool add, const scalar_t* A, const scalar_t* B, float* C) {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  if constexpr (kBrgemmType<scalar_t>) {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C,
                                /*is_vnni=*/kLowp<scalar_t>);
    return;
  }
#endif
  TORCH_CHECK(false, "rel_attn_cpu: brgemm called for ", c10::CppTypeToScalarType<scalar_t>::value);
}

// The VNNI leading dimension of a packed X^T panel of n rows: n rounded up to 16, plus 16 where
// that is a multiple of 256 (its k-pair rows would be a multiple of 1 KiB apart and crowd a few
// L1 sets).
inline int64_t vnni_ld(int64_t n) {
  const int64_t ld = (n + 15) / 16 * 16;
  return ld % 256 == 0 ? ld + 16 : ld;
}

// rows pack_transposed reads at a time: its row buffer holds kPackRows * D elements
constexpr int64_t kPackRows = 16;

// fp32 X^T panels are cut into chunks of kPanelCols columns, each [D, kPanelLd] and contiguous:
// a key tile's B operand then spans 64 KiB (16 pages at D = 64) where one panel row per d of
// the whole length (rows ld apart) spans a page per row, and brgemm runs ~12% faster on it
// (measured on Zen 2: 37.6 against 33.0 GFLOP/s for 128 x 256 x 64). kPanelLd: rows 1,088
// bytes apart, not a multiple of 1 KiB.
constexpr int64_t kPanelCols = 256, kPanelLd = kPanelCols + 16;

// The leading dimension and the size of a packed X^T of n rows (K = Dp): VNNI pairs for
// bf16 / fp16, chunks for fp32.
template <typename scalar_t>
int64_t panel_ld(int64_t n) {
  return kLowp<scalar_t> ? vnni_ld(n) : kPanelLd;
}
template <typename scalar_t>
int64_t panel_elems(int64_t n, int64_t Dp) {
  return kLowp<scalar_t> ? Dp * vnni_ld(n) : (n + kPanelCols - 1) / kPanelCols * Dp * kPanelLd;
}

// X^T of X's rows [0, n) [n, D] packed for brgemm: bf16 / fp16 in VNNI pairs,
// out[((d / 2) ld + j) 2 + d % 2] = X[j, d] (d padded to even with zeros), a tile of rows
// [j0, j0 + c) then at out + 2 j0 with ld_b = ld; fp32 in chunks of kPanelCols columns,
// out[(j / kPanelCols) D ld + d ld + j % kPanelCols] = X[j, d] (ld = kPanelLd). One pass per
// call: each (batch, head)'s K and each head's r, read by every query block.
template <typename scalar_t, typename Rw>
void pack_transposed(const Rw& X, int64_t n, int64_t D, int64_t ld, scalar_t* out,
                     scalar_t* row) {
  if constexpr (std::is_same<scalar_t, float>::value) {
    constexpr int64_t J = kPackRows;  // rows at a time: 64 contiguous bytes per panel row
    const float* xs[J];
    for (int64_t j0 = 0; j0 < n; j0 += J) {
      const int64_t nj = std::min(J, n - j0);
      for (int64_t jj = 0; jj < nj; ++jj) xs[jj] = X.raw(j0 + jj, row + jj * D);
      // kPackRows divides kPanelCols: the rows j0.. lie in one chunk
      float* o = out + j0 / kPanelCols * D * ld + j0 % kPanelCols;
      for (int64_t d = 0; d < D; ++d)
        for (int64_t jj = 0; jj < nj; ++jj) o[d * ld + jj] = xs[jj][d];
    }
  } else {
    using W = uint32_t;  // one pair (d, d + 1) of 16-bit values
    static_assert(sizeof(scalar_t) == 2, "bf16 / fp16 here");
    const int64_t Dh = D / 2;
    W* o = reinterpret_cast<W*>(out);
    // kPackRows rows at a time, so that each panel row is written 64 contiguous bytes at a time
    constexpr int64_t J = kPackRows;
    const scalar_t* xs[J];
    for (int64_t j0 = 0; j0 < n; j0 += J) {
      const int64_t nj = std::min(J, n - j0);
      for (int64_t jj = 0; jj < nj; ++jj) xs[jj] = X.raw(j0 + jj, row + jj * D);
      for (int64_t e = 0; e < Dh; ++e)
        for (int64_t jj = 0; jj < nj; ++jj)
          std::memcpy(o + e * ld + j0 + jj, xs[jj] + 2 * e, sizeof(W));
      if (D % 2)
        for (int64_t jj = 0; jj < nj; ++jj) {
          scalar_t pair[2] = {xs[jj][D - 1], scalar_t(0)};
          std::memcpy(o + Dh * ld + j0 + jj, pair, sizeof(W));
        }
    }
  }
}

// The route's two per-tile element loops, compiled for AVX-512 (the route runs only under
// that variant) so that they vectorise:
// o[2 d + e] = xe[d], rows x0 and x1 of a VNNI pair interleaved
TXL_TARGET_AVX512 void interleave_pair(const uint16_t* x0, const uint16_t* x1, int64_t D,
                                       uint16_t* o) {
  for (int64_t d = 0; d < D; ++d) {
    o[2 * d] = x0[d];
    o[2 * d + 1] = x1[d];
  }
}
// o[t] = bf16(s[t]), rounded to nearest even with NaN kept (a quiet NaN), as c10::BFloat16
TXL_TARGET_AVX512 void round_to_bf16(const float* s, int64_t n, uint16_t* o) {
  for (int64_t t = 0; t < n; ++t) {
    uint32_t u;
    std::memcpy(&u, s + t, sizeof u);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    o[t] = static_cast<uint16_t>(s[t] != s[t] ? 0x7FC0u : r);
  }
}

// s = 2^(s - mx) (0 at -inf) and o = bf16(s), row by row while s is in L1; returns the sum
TXL_TARGET_AVX512 float exp2_sum_bf16(float* s, int64_t n, float mx, uint16_t* o) {
  const float sum = rows::exp2_sum<v16f>(s, n, mx);
  round_to_bf16(s, n, o);
  return sum;
}

// n rows in P V's B layout: rows t, t + 1 interleaved (row t's element d at (t / 2) 2 D + 2 d +
// t % 2), an odd last row paired with zeros. read(t, buf) gives row t (buf: D elements it may
// fill, one of two so that a pair's rows can both live there).
template <typename scalar_t, typename Read>
void pack_pairs(int64_t n, int64_t D, scalar_t* out, scalar_t* row0, scalar_t* row1,
                const scalar_t* zero, Read&& read) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t t = 0; t < n; t += 2) {
    const scalar_t* x0 = read(t, row0);
    const scalar_t* x1 = t + 1 < n ? read(t + 1, row1) : zero;
    interleave_pair(reinterpret_cast<const uint16_t*>(x0), reinterpret_cast<const uint16_t*>(x1),
                    D, o + t * D);
  }
}

// One thread's brgemm operands: (q + u) and (q + vb) of the current query block (and its
// output gradient rows, in the backward), the packed V tile, and P in the input dtype (bf16 /
// fp16; fp32 reads V's rows and P = S as they are).
template <typename scalar_t>
struct LowpGemm {
  static constexpr bool kVnni = kLowp<scalar_t>;  // B operands in VNNI pairs
  int64_t D, Dp;  // head dim, and the K of the q GEMMs (rounded up to even in VNNI)
  float sc;       // softmax_scale * log2(e): the scores' factor (scores_tile applies it)
  Scratch<scalar_t> qu, qv, go, b, p, row0, row1, zero;
  // the forward's V of the current (batch, head) in pv's layout (pack_pairs), vn rows
  const scalar_t* vp = nullptr;
  int64_t vn = 0;
  // the current (batch, head)'s packed K^T and r^T panels (pack_transposed) and their ld
  const scalar_t* kt = nullptr;
  const scalar_t* rt = nullptr;
  int64_t ldk = 0, ldr = 0;

  LowpGemm(int64_t BM, int64_t BN, int64_t D_, float sc_)
      : D(D_), Dp(kVnni ? (D_ + 1) / 2 * 2 : D_), sc(sc_), qu(BM * Dp), qv(BM * Dp),
        go(BM * Dp),
        b((BN + 1) * D),
        p(kVnni ? BM * (BN + 1) : 0), row0(D_), row1(D_), zero(D_) {
    std::fill(zero.begin(), zero.end(), scalar_t(0));
  }

  // qu, qv = q + u, q + vb of query rows [0, m) (q rows ldq apart), zero-padded to Dp
  void load(const scalar_t* q, int64_t ldq, const scalar_t* u, const scalar_t* vb, int64_t m) {
    for (int64_t a = 0; a < m; ++a) {
      scalar_t* ou = qu.data() + a * Dp;
      scalar_t* ov = qv.data() + a * Dp;
      for (int64_t d = 0; d < D; ++d) {
        ou[d] = q_plus<float>(q[a * ldq + d], u[d]);
        ov[d] = q_plus<float>(q[a * ldq + d], vb[d]);
      }
      if (Dp > D) ou[D] = ov[D] = scalar_t(0);
    }
  }

  // go = the rows [0, m) of dout (rows ldo apart), zero-padded to Dp
  void load_dout(const scalar_t* dout, int64_t ldo, int64_t m) {
    for (int64_t a = 0; a < m; ++a) {
      std::memcpy(go.data() + a * Dp, dout + a * ldo, D * sizeof(scalar_t));
      if (Dp > D) go[a * Dp + D] = scalar_t(0);
    }
  }

  // C[m, n] (ld ldc) = A[m, Dp] @ X[j0, j0 + n)^T, X^T packed at Xt (ld ldx; fp32: one
  // product per chunk the columns touch)
  void abt(const scalar_t* A, int64_t m, const scalar_t* Xt, int64_t ldx, int64_t j0,
           int64_t n, float* C, int64_t ldc) {
    if constexpr (!kVnni) {
      for (int64_t j = j0; j < j0 + n;) {
        const int64_t c = j / kPanelCols, e = std::min(j0 + n, (c + 1) * kPanelCols);
        brgemm_call<scalar_t>(m, e - j, Dp, Dp, ldx, ldc, false, A,
                              Xt + c * Dp * ldx + (j - c * kPanelCols), C + (j - j0));
        j = e;
      }
      return;
    }
    brgemm_call<scalar_t>(m, n, Dp, Dp, ldx, ldc, false, A, Xt + 2 * j0, C);
  }

  // where row a of P goes for a tile of n columns, its column n (when n is odd) set to 0
  uint16_t* p_row(int64_t a, int64_t n) {
    const int64_t np = (n + 1) / 2 * 2;
    uint16_t* o = reinterpret_cast<uint16_t*>(p.data() + a * np);
    if (np > n) o[n] = 0;
    return o;
  }

  // acc[m, D] += P @ X[j0, j0 + n), P = S[m, n] (ld lds) rounded to the input dtype (unless
  // p_written: the caller wrote P's rows through p_row); the rows t with flags[t] (when flags)
  // enter as zeros and are listed in bad (for add_allowed). X's rows come from vp where it
  // holds this tile's pairs, else are packed here.
  template <typename Rw>
  void pv(const float* S, int64_t lds, int64_t m, const Rw& X, int64_t j0, int64_t n,
          const uint8_t* flags, std::vector<int64_t>& bad, float* acc, bool p_written) {
    if constexpr (!kVnni) {  // fp32: S as it is, X's rows from vp (contiguous) or X
      bad.clear();
      int64_t ldx = D;
      const float* x = vp && !flags ? vp + j0 * D : X.get(j0, n, b.data(), &ldx);
      if (flags) x = zero_flagged_rows(x, &ldx, n, D, flags, b.data(), bad);
      brgemm_call<scalar_t>(m, D, n, lds, ldx, D, true, S, x, acc);
      return;
    }
    const int64_t np = (n + 1) / 2 * 2;
    bad.clear();
    if (!p_written) {
      for (int64_t a = 0; a < m; ++a) {
        uint16_t* o = p_row(a, n);
        if constexpr (std::is_same<scalar_t, at::BFloat16>::value) {
          round_to_bf16(S + a * lds, n, o);
        } else {
          scalar_t* pa = reinterpret_cast<scalar_t*>(o);
          for (int64_t t = 0; t < n; ++t) pa[t] = static_cast<scalar_t>(S[a * lds + t]);
        }
      }
    }
    // the head's packed pairs: a tile that starts on a pair, without flagged rows, whose odd
    // last row is the head's (paired with zeros there)
    const bool head_pairs = vp && !flags && j0 % 2 == 0 && (n % 2 == 0 || j0 + n == vn);
    const scalar_t* B = head_pairs ? vp + j0 * D : b.data();
    if (!head_pairs)
      pack_pairs(n, D, b.data(), row0.data(), row1.data(), zero.data(),
                 [&](int64_t t, scalar_t* buf) -> const scalar_t* {
                   if (!flags || !flags[t]) return X.raw(j0 + t, buf);
                   bad.push_back(t);
                   return zero.data();
                 });
    brgemm_call<scalar_t>(m, D, np, np, D, D, true, p.data(), B, acc);
  }
};

// T[a0:a1, c0:c1) = (q + vb)[a0:a1] @ r[P0 + c]^T over the columns whose rows exist (others 0)
// (with lp: lp's qv rows on brgemm)
template <typename scalar_t, typename acc_t>
void fill_window(const Rows<scalar_t, acc_t>& Rr, int64_t R, const acc_t* qv, int64_t a0,
                 int64_t a1, int64_t D, int64_t P0, int64_t c0, int64_t c1, acc_t* T,
                 int64_t tw, acc_t* rbuf, LowpGemm<scalar_t>* lp = nullptr) {
  if (a1 <= a0 || c1 <= c0) return;
  const int64_t pa = std::max<int64_t>(P0 + c0, 0), pb = std::min<int64_t>(P0 + c1, R);
  const bool any = pb > pa;
  const int64_t ca = any ? pa - P0 : c1, cb = any ? pb - P0 : c1;
  for (int64_t a = a0; a < a1; ++a) {
    std::fill(T + a * tw + c0, T + a * tw + ca, acc_t(0));
    std::fill(T + a * tw + cb, T + a * tw + c1, acc_t(0));
  }
  if (!any) return;
  if constexpr (kBrgemmType<scalar_t>) {
    if (lp) {
      lp->abt(lp->qv.data() + a0 * lp->Dp, a1 - a0, lp->rt, lp->ldr, pa, pb - pa,
              T + a0 * tw + (pa - P0), tw);
      return;
    }
  }
  if constexpr (std::is_same<acc_t, float>::value) {
    if (Rr.packed && pa == 0 && pb == R) {  // every row of the table: the packed copy
      Rr.packed->compute(a1 - a0, qv + a0 * D, D, T + a0 * tw + (pa - P0), tw);
      return;
    }
  }
  int64_t ldr;
  const acc_t* rp = Rr.get(pa, pb - pa, rbuf, &ldr);
  gemm_rm<acc_t>(false, true, a1 - a0, pb - pa, D, 1, qv + a0 * D, D, rp, ldr, 0,
                 T + a0 * tw + (pa - P0), tw);
}

// Advance the window T to the key tile [j0, j0 + n) of query rows [i0, i0 + m): its columns
// [0, m + n - 1) are r rows P0.., and row a reads columns [m - 1 - a, m - 1 - a + n). Each tile
// computes the n columns that are new to it (all m + n - 1 on the first tile) for every row,
// except where no row of the query block will ever read them: on the first tile rows a < a1
// read no column below m - a1, on the last tile rows a >= a0 none from m - 1 - a0 + n on (the
// window's two corner triangles, m (m - 1) / 2 products each), skipped by groups of kRowGroup
// rows (a few percent of the BD products at Lk ~ 8 m).
constexpr int64_t kRowGroup = 32;

template <typename scalar_t, typename acc_t>
void advance_window(const Rows<scalar_t, acc_t>& Rr, int64_t R, const acc_t* qv, int64_t m,
                    int64_t D, int64_t P0, int64_t n, int64_t BN, bool first, bool last,
                    acc_t* T, int64_t tw, acc_t* rbuf, LowpGemm<scalar_t>* lp = nullptr) {
  if (!first) shift_window(T, m, tw, BN, false, 0);
  const int64_t c0 = first ? 0 : m - 1, c1 = m - 1 + n;
  if (!first && !last) {
    fill_window(Rr, R, qv, 0, m, D, P0, c0, c1, T, tw, rbuf, lp);
    return;
  }
  for (int64_t a0 = 0; a0 < m; a0 += kRowGroup) {
    const int64_t a1 = std::min(m, a0 + kRowGroup);
    const int64_t lo = first ? std::max(c0, m - a1) : c0;
    const int64_t hi = last ? std::min(c1, m - 1 - a0 + n) : c1;
    fill_window(Rr, R, qv, a0, a1, D, P0, lo, hi, T, tw, rbuf, lp);
  }
}

// (q + bias) rounded to the input dtype, as the reference does, then to acc_t and times mult:
// [m, D]
template <typename scalar_t, typename acc_t>
void load_q(const scalar_t* q, int64_t ldq, const scalar_t* bias, int64_t m, int64_t D,
            acc_t mult, acc_t* out) {
  for (int64_t a = 0; a < m; ++a)
    for (int64_t d = 0; d < D; ++d)
      out[a * D + d] = mult * static_cast<acc_t>(q_plus<acc_t>(q[a * ldq + d], bias[d]));
}

// The scores tile S = softmax_scale * log2(e) * (AC + BD) with -inf at masked pairs, T advanced to
// this tile (last: no later key tile for these query rows). qu and qv come multiplied by
// softmax_scale * log2(e), so the GEMMs give the scaled terms in log2 units and one pass adds BD's
// skewed rows (and takes the row maxima into rmax, when given). With lp, both GEMMs run on
// brgemm from lp's rows of q + u and q + vb (qu and qv unused), unscaled (q + bias is rounded
// to the input dtype, which the factor must not touch), and that pass applies the factor.
template <typename scalar_t, typename acc_t>
void scores_tile(const Geometry& g, const Head<scalar_t, acc_t>& hd, int64_t b, int64_t h,
                 int64_t i0, int64_t m, int64_t j0, int64_t n, bool first, bool last,
                 const acc_t* qu, const acc_t* qv, acc_t* S, acc_t* T, int64_t tw, acc_t* kbuf,
                 acc_t* rbuf, acc_t* rmax, LowpGemm<scalar_t>* lp = nullptr) {
  const int64_t D = g.D;
  bool done = false;
  if constexpr (kBrgemmType<scalar_t>) {
    if (lp) {
      lp->abt(lp->qu.data(), m, lp->kt, lp->ldk, j0, n, S, g.BN);
      done = true;
    }
  }
  if (!done) {
    int64_t ldk;
    const acc_t* kp = hd.K.get(j0, n, kbuf, &ldk);
    gemm_rm<acc_t>(false, true, m, n, D, 1, qu, D, kp, ldk, 0, S, g.BN);
  }
  const int64_t P0 = j0 - (i0 + m - 1) + g.c;
  advance_window(hd.Rr, g.R, qv, m, D, P0, n, g.BN, first, last, T, tw, rbuf, lp);
  const acc_t c = lp ? static_cast<acc_t>(lp->sc) : acc_t(1);  // the factor not yet applied
  if (!g.tile_needs_masks(i0, m, j0, n)) {
    for (int64_t a = 0; a < m; ++a) {
      acc_t* s = S + a * g.BN;
      const acc_t* t = T + a * tw + (m - 1 - a);
      if (rmax)
        rmax[a] = add_max(s, t, n, c);
      else
        add_row(s, t, n, c);
    }
    return;
  }
  for (int64_t a = 0; a < m; ++a) add_row(S + a * g.BN, T + a * tw + (m - 1 - a), n, c);
  g.apply_masks(b, h, i0, m, j0, n, S, g.BN);
  if (rmax)
    for (int64_t a = 0; a < m; ++a) rmax[a] = row_max(S + a * g.BN, n);
}

template <typename scalar_t, typename acc_t>
Head<scalar_t, acc_t> head_rows(const at::Tensor& k, const at::Tensor& v, const at::Tensor& r,
                                const c10::optional<at::Tensor>* mem, int64_t b, int64_t h) {
  Head<scalar_t, acc_t> hd;
  const int64_t D = k.size(3);
  auto seg = [&](Rows<scalar_t, acc_t>& rw, const at::Tensor& t) {
    rw.base = t.data_ptr<scalar_t>() + b * t.stride(0) + h * t.stride(2);
    rw.ld = t.stride(1);
    rw.D = D;
  };
  seg(hd.K, k);
  seg(hd.V, v);
  hd.Rr.base = r.data_ptr<scalar_t>() + h * r.stride(1);
  hd.Rr.ld = r.stride(0);
  hd.Rr.D = D;
  if (mem && mem[0].has_value()) {
    for (int w = 0; w < 2; ++w) {
      Rows<scalar_t, acc_t>& rw = w == 0 ? hd.K : hd.V;
      const at::Tensor& data = *mem[2 * w];
      const at::Tensor& sc = *mem[2 * w + 1];
      rw.M = data.size(1);
      rw.mem = reinterpret_cast<const uint8_t*>(data.data_ptr()) + b * data.stride(0) +
               h * data.stride(2);
      rw.mem_ld = data.stride(1);
      rw.mem_fp8 = data.scalar_type() == at::kFloat8_e4m3fn;
      const int64_t so = b * sc.stride(0) + h * sc.stride(2);
      if (sc.scalar_type() == at::kFloat)
        rw.scale_f = sc.data_ptr<float>() + so;
      else
        rw.scale_h = sc.data_ptr<at::Half>() + so;
      rw.scale_ld = sc.stride(1);
    }
  }
  return hd;
}

// Rows of D elements ld apart (one page each in [B, T, H, D]) defeat the hardware
// prefetcher: fetch rows [0, n) ahead in software.
template <typename scalar_t>
void prefetch_rows(const scalar_t* x, int64_t ld, int64_t n, int64_t D) {
  for (int64_t t = 0; t < n; ++t) prefetch_span(x + t * ld, D);
}

// Band tiles read each k / v row once per query block that sees it (W / BM + 1 times), and
// a [B, T, H, D] tensor holds one head's row per H * D elements (a page per row at H * D =
// 1,024 fp32): the backward, which runs (batch, head) tasks, first copies the head's k and v
// rows into dense [Lk, D] buffers, the forward the rows of its chunk of query blocks, and
// X then reads from there (rows j0 .. j0 + n - 1, X.first = j0).
template <typename scalar_t, typename acc_t>
void head_copy(Rows<scalar_t, acc_t>& X, int64_t j0, int64_t n, scalar_t* buf) {
  constexpr int64_t ahead = 8;  // rows fetched ahead of the copy
  const scalar_t* src = X.base + (j0 - X.first) * X.ld;
  prefetch_rows(src, X.ld, std::min(n, ahead), X.D);
  for (int64_t t = 0; t < n; ++t) {
    if (t + ahead < n) prefetch_rows(src + (t + ahead) * X.ld, X.ld, 1, X.D);
    std::memcpy(buf + t * X.D, src + t * X.ld, static_cast<size_t>(X.D) * sizeof(scalar_t));
  }
  X.base = buf;
  X.ld = X.D;
  X.first = j0;
}

// Band tiles over a short fp32 r (every block then reads all its rows, e.g. a window's own
// table): r^T packed once into pk for the task's blocks (fill_window multiplies the packed copy).
template <typename scalar_t, typename acc_t>
void pack_short_table(const Geometry& g, Rows<scalar_t, acc_t>& Rr, PackedBT& pk) {
  if constexpr (std::is_same<scalar_t, float>::value) {
    if (g.band && g.R <= g.BM + g.BN && PackedBT::available()) {
      pk.pack(Rr.base, Rr.ld, g.R, g.D, g.BM);
      Rr.packed = &pk;
    }
  }
}

// ---- forward

template <typename scalar_t>
void forward_impl(const Geometry& g, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& r, const at::Tensor& u,
                  const at::Tensor& vb, const c10::optional<at::Tensor>* mem, at::Tensor& out,
                  at::Tensor& lse) {
  using acc_t = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
  const int64_t B = g.B, H = g.H, Lq = g.Lq, D = g.D, BM = g.BM, BN = g.BN;
  const int64_t nqb = (Lq + BM - 1) / BM, tw = BM + BN;
  scalar_t* outp = out.data_ptr<scalar_t>();
  acc_t* lsep = lse.data_ptr<acc_t>();
  // Tasks (b, h, query block) in order, dealt round-robin to one lane per thread (lane p runs
  // tasks p, p + lanes, ...): the threads work on neighbouring query blocks of one (batch,
  // head) at a time and share its K, V and r rows in the last-level cache, where contiguous
  // chunks would have each thread stream another head's (at T = 16,384 two heads' K, V and r
  // are 32 MB). Band tasks, chunks of query blocks, run (b, chunk, h) instead: the chunk's
  // q and out rows are read and written for every head while their pages are at hand. Each
  // task writes only its own rows: results do not depend on the lanes or the order.
  // bf16 / fp16 GEMMs on brgemm where the CPU supports them (decided once for the call)
  const bool lowp = brgemm_route(q.scalar_type(), Lq);
  if (lowp) g_brgemm_calls.fetch_add(1, std::memory_order_relaxed);
  // Band tiles without 8-bit memory (and off the brgemm route, which packs each head's k once
  // for the call): a task is a chunk of kBandChunk query blocks of one head, whose k and v
  // rows it first copies out (head_copy), flagging the non-finite v rows.
  const bool copy = g.band && !(mem && mem[0].has_value()) && !lowp;
  const int64_t C = copy ? kBandChunk : 1, nch = (nqb + C - 1) / C;
  const int64_t ntask = B * H * nch, Lk = g.Lk;
  // the v rows that hold a NaN or an inf, per (batch, head), flagged in one pass before the
  // tasks where any tile can have masked pairs (read by those tiles only)
  const bool may_mask = g.kpm || g.mask || g.dlo > -kInf || g.dhi < kInf;
  std::vector<uint8_t> vflags(may_mask && !copy ? B * H * Lk : 0);
  if (may_mask && !copy)
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      Scratch<acc_t> buf(BN * D);
      for (int64_t bh = begin; bh < end; ++bh) {
        const auto hd = head_rows<scalar_t, acc_t>(k, v, r, mem, bh / H, bh % H);
        flag_nonfinite_rows(hd.V, Lk, BN, buf.data(), vflags.data() + bh * Lk);
      }
    });
  const int64_t lanes = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntask));
  // on the brgemm route each (batch, head)'s K^T and V and each head's r^T packed once for all
  // query blocks: V in pv's pairs (bf16 / fp16) or its rows contiguous (fp32)
  const int64_t Dp = kLowp<scalar_t> ? (D + 1) / 2 * 2 : D, ldk = panel_ld<scalar_t>(Lk),
                ldr = panel_ld<scalar_t>(g.R), ksz = panel_elems<scalar_t>(Lk, Dp),
                rsz = panel_elems<scalar_t>(g.R, Dp);
  const int64_t vsz = (Lk + 1) / 2 * 2 * D;
  at::Tensor kt, rt, vt;
  if constexpr (kBrgemmType<scalar_t>) {
    if (lowp) {
      const int64_t nkv = 2 * B * H;  // K^T panels, then V
      kt = at::empty({B * H, ksz}, q.options());
      vt = at::empty({B * H, vsz}, q.options());
      rt = at::empty({H, rsz}, q.options());
      at::parallel_for(0, nkv + H, 1, [&](int64_t begin, int64_t end) {
        Scratch<scalar_t> row(kPackRows * D), zero(D);
        std::fill(zero.begin(), zero.end(), scalar_t(0));
        for (int64_t i = begin; i < end; ++i) {
          const int64_t bh = i < nkv ? i % (B * H) : i - nkv;
          const auto hd = head_rows<scalar_t, acc_t>(k, v, r, mem, bh / H, bh % H);
          if (i < B * H)
            pack_transposed(hd.K, Lk, D, ldk, kt.data_ptr<scalar_t>() + i * ksz, row.data());
          else if (i < nkv && kLowp<scalar_t>)
            pack_pairs(Lk, D, vt.data_ptr<scalar_t>() + bh * vsz, row.data(), row.data() + D,
                       zero.data(), [&](int64_t t, scalar_t* buf) { return hd.V.raw(t, buf); });
          else if (i < nkv)
            for (int64_t t = 0; t < Lk; ++t)
              std::memcpy(vt.data_ptr<scalar_t>() + bh * vsz + t * D, hd.V.raw(t, row.data()),
                          D * sizeof(scalar_t));
          else
            pack_transposed(hd.Rr, g.R, D, ldr, rt.data_ptr<scalar_t>() + bh * rsz, row.data());
        }
      });
    }
  }
  at::parallel_for(0, lanes, 1, [&](int64_t lane_begin, int64_t lane_end) {
    SequentialBlas one_thread;
    Scratch<acc_t> qu(BM * D), qv(BM * D), S(BM * BN), T(BM * tw + kWindowPad), acc(BM * D),
        kbuf(BN * D), vbuf(BN * D), rbuf((BM + BN) * D), mx(BM), l(BM), tmax(BM),
        z(g.drop.on ? BM * BN : 0), row(D);
    const int64_t crows = copy ? C * BM + BN : 0;  // a chunk's key rows: at most C BM + W - 1
    Scratch<scalar_t> kc(crows * D), vc(crows * D);
    std::vector<uint8_t> cflags(crows);
    PackedBT rpack;  // r^T of a short table (pack_short_table)
    std::vector<int64_t> bad_v;
    const acc_t sc = static_cast<acc_t>(g.softmax_scale * kLog2e);
    std::unique_ptr<LowpGemm<scalar_t>> lp;
    if (lowp) lp = std::make_unique<LowpGemm<scalar_t>>(BM, BN, D, static_cast<float>(sc));
    // bf16 P rounded as the exponentials are taken (no dropout factor comes between)
    const bool p_direct =
        lp && std::is_same<scalar_t, at::BFloat16>::value && !g.drop.on;
    for (int64_t lane = lane_begin; lane < lane_end; ++lane) {
      for (int64_t task = lane; task < ntask; task += lanes) {
        const int64_t b = task / (H * nch);
        const int64_t h = g.band ? task % H : (task / nch) % H;
        const int64_t ch = g.band ? (task / H) % nch : task % nch;
        auto hd = head_rows<scalar_t, acc_t>(k, v, r, mem, b, h);
        // the v flags of keys vfirst.. (the whole head's, or the chunk's rows)
        const uint8_t* vflag = may_mask && !copy ? vflags.data() + (b * H + h) * Lk : nullptr;
        int64_t vfirst = 0;
        const int64_t qb0 = ch * C, qb1 = std::min(nqb, qb0 + C);
        if (copy) {
          int64_t cjlo, cjhi;
          g.key_range(qb0 * BM, std::min(Lq, qb1 * BM) - qb0 * BM, &cjlo, &cjhi);
          if (cjhi >= cjlo) {
            head_copy(hd.K, cjlo, cjhi + 1 - cjlo, kc.data());
            head_copy(hd.V, cjlo, cjhi + 1 - cjlo, vc.data());
            flag_nonfinite_rows(hd.V, cjhi + 1 - cjlo, BN, vbuf.data(), cflags.data(), cjlo);
          }
          vflag = cflags.data();
          vfirst = cjlo;
          pack_short_table(g, hd.Rr, rpack);
        }
        if (lp) {
          lp->kt = kt.data_ptr<scalar_t>() + (b * H + h) * ksz;
          lp->rt = rt.data_ptr<scalar_t>() + h * rsz;
          lp->ldk = ldk;
          lp->ldr = ldr;
          lp->vp = vt.data_ptr<scalar_t>() + (b * H + h) * vsz;
          lp->vn = Lk;
        }
        for (int64_t qb = qb0; qb < qb1; ++qb) {
          const int64_t i0 = qb * BM, m = std::min(BM, Lq - i0);
          const scalar_t* qp = q.data_ptr<scalar_t>() + b * q.stride(0) + h * q.stride(2) +
                               i0 * q.stride(1);
          const scalar_t* up = u.data_ptr<scalar_t>() + h * u.stride(0);
          const scalar_t* vbp = vb.data_ptr<scalar_t>() + h * vb.stride(0);
          if (lp) {
            lp->load(qp, q.stride(1), up, vbp, m);
          } else {
            load_q(qp, q.stride(1), up, m, D, sc, qu.data());
            load_q(qp, q.stride(1), vbp, m, D, sc, qv.data());
          }
          // the task's next block's q rows, read while this block computes
          if (qb + 1 < qb1)
            prefetch_rows(qp + BM * q.stride(1), q.stride(1), std::min(BM, Lq - i0 - BM), D);
          std::fill(acc.begin(), acc.end(), acc_t(0));
          std::fill(mx.begin(), mx.end(), -std::numeric_limits<acc_t>::infinity());
          std::fill(l.begin(), l.end(), acc_t(0));
          int64_t jlo, jhi;
          g.key_range(i0, m, &jlo, &jhi);
          for (int64_t j0 = jlo; j0 <= jhi; j0 += BN) {
            const int64_t n = std::min(BN, jhi + 1 - j0);
            scores_tile(g, hd, b, h, i0, m, j0, n, j0 == jlo, j0 + BN > jhi, qu.data(), qv.data(),
                        S.data(), window_base(T, BM), tw, kbuf.data(), rbuf.data(),
                        tmax.data(), lp.get());
            if (g.drop.on) g.drop.keep_scale(b * H + h, Lq, i0, m, j0, n, z.data(), BN);
            for (int64_t a = 0; a < m; ++a) {
              acc_t* s = S.data() + a * BN;
              const acc_t mnew = std::max(mx[a], tmax[a]);
              if (mnew == -std::numeric_limits<acc_t>::infinity()) {
                std::fill(s, s + n, acc_t(0));
                if (p_direct) std::fill_n(lp->p_row(a, n), n, uint16_t(0));
                continue;
              }
              const acc_t alpha = std::exp2(mx[a] - mnew);
              acc_t sum;
              if constexpr (kLowp<scalar_t>) {
                sum = p_direct ? exp2_sum_bf16(s, n, mnew, lp->p_row(a, n))
                               : exp2_sum(s, n, mnew);
              } else {
                sum = exp2_sum(s, n, mnew);
              }
              l[a] = l[a] * alpha + sum;
              mx[a] = mnew;
              if (alpha != acc_t(1)) scale_row(acc.data() + a * D, alpha, D);
              if (g.drop.on) mul_rows(s, z.data() + a * BN, n);
            }
            // a tile with masked pairs: its non-finite v rows reach only the rows allowed them
            const bool masked = g.tile_needs_masks(i0, m, j0, n);
            const uint8_t* vfl = masked ? vflag + (j0 - vfirst) : nullptr;
            bool done = false;
            if constexpr (kBrgemmType<scalar_t>) {
              if (lp) {
                lp->pv(S.data(), BN, m, hd.V, j0, n, vfl, bad_v, acc.data(), p_direct);
                done = true;
              }
            }
            if (!done) {
              int64_t ldv;
              const acc_t* vp = hd.V.get(j0, n, vbuf.data(), &ldv);
              if (masked) vp = zero_flagged_rows(vp, &ldv, n, D, vfl, vbuf.data(), bad_v);
              gemm_rm<acc_t>(false, false, m, D, n, 1, S.data(), BN, vp, ldv, 1, acc.data(), D);
            }
            if (masked)
              add_allowed(g, b, h, i0, m, hd.V, j0, bad_v,
                          [j0](int64_t, int64_t t) { return j0 + t; }, S.data(), BN, acc.data(),
                          row.data());
          }
          for (int64_t a = 0; a < m; ++a) {
            scalar_t* o = outp + ((b * Lq + i0 + a) * H + h) * D;
            const bool any = l[a] > acc_t(0);
            const acc_t inv = any ? acc_t(1) / l[a] : acc_t(0);
            for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[a * D + d] * inv);
            lsep[(b * H + h) * Lq + i0 + a] =
                any ? (mx[a] + std::log2(l[a])) * static_cast<acc_t>(kLn2)
                    : std::numeric_limits<acc_t>::infinity();
          }
        }
      }
    }
    if (lp) brgemm_done<scalar_t>();
  });
}

// ---- backward

template <typename scalar_t>
void backward_impl(const Geometry& g, const at::Tensor& dout, const at::Tensor& q,
                   const at::Tensor& k, const at::Tensor& v, const at::Tensor& r,
                   const at::Tensor& u, const at::Tensor& vb, const at::Tensor& out,
                   const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                   at::Tensor& dr, at::Tensor& du, at::Tensor& dvb) {
  using acc_t = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
  const int64_t B = g.B, H = g.H, Lq = g.Lq, Lk = g.Lk, D = g.D, R = g.R, BM = g.BM,
                BN = g.BN;
  const int64_t nqb = (Lq + BM - 1) / BM, tw = BM + BN, S_ = g.splits;
  // fp32 (fp64) accumulators: dq [B, H, Lq, D]; per (b, h, split) dk / dv [Lk, D], dr [R, D],
  // du / dvb [D]
  acc_t* dqp = dq.data_ptr<acc_t>();
  acc_t* dkp = dk.data_ptr<acc_t>();
  acc_t* dvp = dv.data_ptr<acc_t>();
  acc_t* drp = dr.data_ptr<acc_t>();
  acc_t* dup = du.data_ptr<acc_t>();
  acc_t* dvbp = dvb.data_ptr<acc_t>();
  const acc_t* lsep = lse.data_ptr<acc_t>();
  // the brgemm route (as the forward's): the scores' two GEMMs, recomputed as the forward
  // computed them, and dP = dO V^T (bf16 / fp16 operands that are exact, or fp32; fp32
  // accumulation); the other GEMMs (fp32 operands P, dS, dT) stay on the BLAS
  const bool lowp = brgemm_route(q.scalar_type(), Lq);
  if (lowp) g_brgemm_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t Dp = kLowp<scalar_t> ? (D + 1) / 2 * 2 : D, ldkt = panel_ld<scalar_t>(Lk),
                ldrt = panel_ld<scalar_t>(R);
  at::parallel_for(0, B * H * S_, 1, [&](int64_t begin, int64_t end) {
    SequentialBlas one_thread;
    // the task's K^T, V^T and r^T panels (pack_transposed), when on the brgemm route
    std::unique_ptr<LowpGemm<scalar_t>> lp;
    Scratch<scalar_t> kt(lowp ? panel_elems<scalar_t>(Lk, Dp) : 0),
        vt(lowp ? panel_elems<scalar_t>(Lk, Dp) : 0), rt(lowp ? panel_elems<scalar_t>(R, Dp) : 0),
        prow(lowp ? kPackRows * D : 0);
    if (lowp)
      lp = std::make_unique<LowpGemm<scalar_t>>(BM, BN, D,
                                                static_cast<float>(g.softmax_scale * kLog2e));
    // qu, qv: (q + u), (q + vb) for the gradients; qus, qvs: times softmax_scale * log2(e), for the
    // scores in log2 units
    Scratch<acc_t> qu(BM * D), qv(BM * D), qus(BM * D), qvs(BM * D), S(BM * BN), dP(BM * BN),
        T(BM * tw + kWindowPad), dT(BM * tw), dqu(BM * D), dqv(BM * D), dO(BM * D),
        kbuf(BN * D), vbuf(BN * D), rbuf((BM + BN) * D), delta(BM),
        z(g.drop.on ? BM * BN : 0), row(D);
    std::vector<int64_t> bad_k, bad_v, bad_r;
    std::vector<uint8_t> kflag(Lk), vflag(Lk), rflag(R);
    // band tiles: the task's k and v rows copied to [Lk, D] (head_copy), r^T of a short table
    // (pack_short_table)
    Scratch<scalar_t> kc(g.band ? Lk * D : 0), vc(g.band ? Lk * D : 0);
    PackedBT rpack;
    // sc: the scores' factor, softmax_scale * log2(e) (log2 units); ds_scale: softmax_scale
    // alone, for dS = softmax_scale * P (dP - delta)
    const acc_t sc = static_cast<acc_t>(g.softmax_scale * kLog2e);
    const acc_t ds_scale = static_cast<acc_t>(g.softmax_scale);
    for (int64_t task = begin; task < end; ++task) {
      // split sp of (b, h) takes the query blocks qb = sp (mod splits): balanced under causal
      // masks, and a fixed assignment for a given thread count
      const int64_t bh = task / S_, sp = task % S_, b = bh / H, h = bh % H;
      auto hd = head_rows<scalar_t, acc_t>(k, v, r, nullptr, b, h);
      if (g.band) {
        head_copy(hd.K, 0, Lk, kc.data());
        head_copy(hd.V, 0, Lk, vc.data());
        pack_short_table(g, hd.Rr, rpack);
      }
      acc_t* dkh = dkp + task * Lk * D;
      acc_t* dvh = dvp + task * Lk * D;
      acc_t* drh = drp + task * R * D;
      flag_nonfinite_rows(hd.K, Lk, BN, kbuf.data(), kflag.data());
      flag_nonfinite_rows(hd.V, Lk, BN, vbuf.data(), vflag.data());
      flag_nonfinite_rows(hd.Rr, R, BN, rbuf.data(), rflag.data());
      if constexpr (kBrgemmType<scalar_t>) {
        if (lp) {
          pack_transposed(hd.K, Lk, D, ldkt, kt.data(), prow.data());
          pack_transposed(hd.V, Lk, D, ldkt, vt.data(), prow.data());
          pack_transposed(hd.Rr, R, D, ldrt, rt.data(), prow.data());
          lp->kt = kt.data();
          lp->rt = rt.data();
          lp->ldk = ldkt;
          lp->ldr = ldrt;
        }
      }
      for (int64_t qb = sp; qb < nqb; qb += S_) {
        const int64_t i0 = qb * BM, m = std::min(BM, Lq - i0);
        int64_t jlo, jhi;
        g.key_range(i0, m, &jlo, &jhi);
        if (jlo > jhi) continue;  // no key: zero gradients
        const scalar_t* qp = q.data_ptr<scalar_t>() + b * q.stride(0) + h * q.stride(2) +
                             i0 * q.stride(1);
        const scalar_t* up = u.data_ptr<scalar_t>() + h * u.stride(0);
        const scalar_t* vbp = vb.data_ptr<scalar_t>() + h * vb.stride(0);
        load_q(qp, q.stride(1), up, m, D, acc_t(1), qu.data());
        load_q(qp, q.stride(1), vbp, m, D, acc_t(1), qv.data());
        load_q(qp, q.stride(1), up, m, D, sc, qus.data());
        load_q(qp, q.stride(1), vbp, m, D, sc, qvs.data());
        if (lp) {
          lp->load(qp, q.stride(1), up, vbp, m);
          lp->load_dout(dout.data_ptr<scalar_t>() + b * dout.stride(0) + i0 * dout.stride(1) +
                            h * dout.stride(2),
                        dout.stride(1), m);
        }
        for (int64_t a = 0; a < m; ++a) {
          const scalar_t* go = dout.data_ptr<scalar_t>() + b * dout.stride(0) +
                               (i0 + a) * dout.stride(1) + h * dout.stride(2);
          const scalar_t* o = out.data_ptr<scalar_t>() + b * out.stride(0) +
                              (i0 + a) * out.stride(1) + h * out.stride(2);
          acc_t s = 0;
          for (int64_t d = 0; d < D; ++d) {
            dO[a * D + d] = static_cast<acc_t>(go[d]);
            s += dO[a * D + d] * static_cast<acc_t>(o[d]);
          }
          delta[a] = s;
        }
        std::fill(dqu.begin(), dqu.end(), acc_t(0));
        std::fill(dqv.begin(), dqv.end(), acc_t(0));
        std::fill(dT.begin(), dT.end(), acc_t(0));
        const acc_t* lrow = lsep + bh * Lq + i0;
        for (int64_t j0 = jlo; j0 <= jhi; j0 += BN) {
          const int64_t n = std::min(BN, jhi + 1 - j0);
          const bool last = j0 + BN > jhi;
          scores_tile(g, hd, b, h, i0, m, j0, n, j0 == jlo, last, qus.data(), qvs.data(),
                      S.data(), window_base(T, BM), tw, kbuf.data(), rbuf.data(),
                      static_cast<acc_t*>(nullptr), lp.get());
          // P = exp(S - lse), 0 at masked pairs / rows. The difference is taken in natural
          // units, S rounded to them as the forward rounded its lse ((max + log2 sum) * ln 2):
          // a saturated row's top score then cancels its lse exactly (P = 1), where lse *
          // log2(e) is off by an ulp of the scores (at scores of 1e20 in fp64, 2^16384)
          for (int64_t a = 0; a < m; ++a) {
            acc_t* s = S.data() + a * BN;
            if (std::isinf(lrow[a])) {
              std::fill(s, s + n, acc_t(0));
            } else {
              scale_row(s, static_cast<acc_t>(kLn2), n);
              exp_diff(s, n, lrow[a]);
            }
          }
          int64_t ldk, ldv;
          const acc_t* kp = hd.K.get(j0, n, kbuf.data(), &ldk);
          const acc_t* vp = hd.V.get(j0, n, vbuf.data(), &ldv);
          // a tile with masked pairs: its non-finite k / v rows reach only the rows allowed them
          const bool masked = g.tile_needs_masks(i0, m, j0, n);
          bad_k.clear();
          bad_v.clear();
          if (masked) {
            kp = zero_flagged_rows(kp, &ldk, n, D, kflag.data() + j0, kbuf.data(), bad_k);
            vp = zero_flagged_rows(vp, &ldv, n, D, vflag.data() + j0, vbuf.data(), bad_v);
          }
          const auto key = [j0](int64_t, int64_t t) { return j0 + t; };
          // dP = dO V^T (the flagged v rows' columns recomputed below where allowed, else 0)
          bool done = false;
          if constexpr (kBrgemmType<scalar_t>) {
            if (lp) {
              lp->abt(lp->go.data(), m, vt.data(), lp->ldk, j0, n, dP.data(), BN);
              for (const int64_t t : bad_v)
                for (int64_t a = 0; a < m; ++a) dP[a * BN + t] = acc_t(0);
              done = true;
            }
          }
          if (!done)
            gemm_rm<acc_t>(false, true, m, n, D, 1, dO.data(), D, vp, ldv, 0, dP.data(), BN);
          for (const int64_t t : bad_v) {
            int64_t l1;
            const acc_t* x = hd.V.get(j0 + t, 1, row.data(), &l1);
            for (int64_t a = 0; a < m; ++a) {
              if (!g.allowed(b, h, i0 + a, j0 + t)) continue;
              acc_t sum = 0;
              for (int64_t d = 0; d < D; ++d) sum += dO[a * D + d] * x[d];
              dP[a * BN + t] = sum;
            }
          }
          if (g.drop.on) {
            g.drop.keep_scale(bh, Lq, i0, m, j0, n, z.data(), BN);
            for (int64_t a = 0; a < m; ++a) mul_rows(dP.data() + a * BN, z.data() + a * BN, n);
          }
          // dS = softmax_scale * P (dP - delta), into dP; the dropped P (for dV) into S
          for (int64_t a = 0; a < m; ++a) {
            acc_t* s = S.data() + a * BN;
            acc_t* dp = dP.data() + a * BN;
            ds_row(dp, s, n, ds_scale, delta[a]);
            if (g.drop.on) mul_rows(s, z.data() + a * BN, n);
          }
          // dV += Pd^T dO ; dq_u += dS K ; dK += dS^T (q + u)
          gemm_rm<acc_t>(true, false, n, D, m, 1, S.data(), BN, dO.data(), D, 1, dvh + j0 * D,
                         D);
          gemm_rm<acc_t>(false, false, m, D, n, 1, dP.data(), BN, kp, ldk, 1, dqu.data(), D);
          add_allowed(g, b, h, i0, m, hd.K, j0, bad_k, key, dP.data(), BN, dqu.data(),
                      row.data());
          gemm_rm<acc_t>(true, false, n, D, m, 1, dP.data(), BN, qu.data(), D, 1,
                         dkh + j0 * D, D);
          // dT[a, m - 1 - a + x] += dS[a, x]
          for (int64_t a = 0; a < m; ++a) {
            add_row(dT.data() + a * tw + (m - 1 - a), dP.data() + a * BN, n, acc_t(1));
          }
          // flush the window columns no later tile touches: [0, BN), or all on the last tile
          const int64_t P0 = j0 - (i0 + m - 1) + g.c;
          const int64_t cend = last ? m + n - 1 : BN;
          const int64_t pa = std::max<int64_t>(P0, 0), pb = std::min<int64_t>(P0 + cend, R);
          if (pb > pa) {
            int64_t ldr;
            const acc_t* rp = hd.Rr.get(pa, pb - pa, rbuf.data(), &ldr);
            // r rows that hold a NaN or an inf reach only the pairs (query i0 + a, key
            // p + i0 + a - c) that the masks allow; dT is 0 everywhere else
            rp = zero_flagged_rows(rp, &ldr, pb - pa, D, rflag.data() + pa, rbuf.data(), bad_r);
            gemm_rm<acc_t>(false, false, m, D, pb - pa, 1, dT.data() + (pa - P0), tw, rp, ldr,
                           1, dqv.data(), D);
            add_allowed(g, b, h, i0, m, hd.Rr, pa, bad_r,
                        [&](int64_t a, int64_t t) { return pa + t + i0 + a - g.c; },
                        dT.data() + (pa - P0), tw, dqv.data(), row.data());
            gemm_rm<acc_t>(true, false, pb - pa, D, m, 1, dT.data() + (pa - P0), tw, qv.data(),
                           D, 1, drh + pa * D, D);
          }
          if (!last) shift_window(dT.data(), m, tw, BN, true, m - 1 + BN);
        }
        acc_t* dqh = dqp + (bh * Lq + i0) * D;
        acc_t* duh = dup + task * D;
        acc_t* dvbh = dvbp + task * D;
        for (int64_t a = 0; a < m; ++a)
          for (int64_t d = 0; d < D; ++d) {
            dqh[a * D + d] = dqu[a * D + d] + dqv[a * D + d];
            duh[d] += dqu[a * D + d];
            dvbh[d] += dqv[a * D + d];
          }
      }
    }
    if (lp) brgemm_done<scalar_t>();
  });
}

// ---- checks and entry points

void check_input(const char* name, const at::Tensor& t, int64_t dim, const at::Tensor& q) {
  TORCH_CHECK(t.device().is_cpu(), "rel_attn_cpu: ", name, " must be a CPU tensor, got ",
              t.device());
  TORCH_CHECK(t.dim() == dim, "rel_attn_cpu: ", name, " must be ", dim, "-D, got ", t.dim(),
              "-D ", t.sizes());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "rel_attn_cpu: ", name, " has dtype ",
              t.scalar_type(), ", q has ", q.scalar_type());
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "rel_attn_cpu: ", name,
              " must have a contiguous last dimension (stride(-1) == 1), got strides ",
              t.strides());
}

// Local attention, a window of W = dhi - dlo + 1 keys narrow against Lk: each query block
// needs only its BM + W - 1 keys. Blocks of kBandBM queries with one key tile spanning them
// keep the tiles' unused corners small (W = 257: 80% of a 64 x 320 tile is inside the
// window, 50% of a 256 x 256 one); 32- and 128-row blocks measured slower at window
// (128, 128). How the forward and backward then read k, v and r: head_copy,
// pack_short_table and forward_impl's task order.

void use_band_tiles(Geometry& g) {
  if (g.dlo <= -kInf || g.dhi >= kInf) return;
  const int64_t W = g.dhi - g.dlo + 1;
  if (W > kBandMaxW || g.Lk < 4 * W) return;
  g.band = true;
  g.BM = std::min<int64_t>(kBandBM, g.Lq);
  g.BN = (g.BM + W - 1 + 15) / 16 * 16;
}

Geometry make_geometry(const at::Tensor& q, int64_t Lk, const at::Tensor& r, double softmax_scale,
                       int64_t wl, int64_t wr, const c10::optional<at::Tensor>& kpm,
                       const c10::optional<at::Tensor>& mask,
                       const c10::optional<at::Tensor>& band, double dropout_p,
                       const c10::optional<at::Tensor>& seed,
                       c10::optional<int64_t> r_first_distance) {
  Geometry g;
  g.B = q.size(0);
  g.Lq = q.size(1);
  g.H = q.size(2);
  g.D = q.size(3);
  g.Lk = Lk;
  g.R = r.size(0);
  g.mlen = Lk - g.Lq;
  // int64 throughout: any r_first_distance the op is given stays exact here
  g.c = r_first_distance.has_value() ? *r_first_distance - Lk + g.Lq : g.Lq - 1;
  TORCH_CHECK(g.mlen >= 0, "rel_attn_cpu: need Lk >= Lq, got Lq=", g.Lq, " and Lk=", Lk);
  g.softmax_scale = softmax_scale;
  g.dhi = wl < 0 ? kInf : wl;
  g.dlo = wr < 0 ? -kInf : -wr;
  bool dense = mask.has_value();
  if (band.has_value()) {
    TORCH_CHECK(mask.has_value(), "rel_attn_cpu: attn_mask_band needs attn_mask");
    TORCH_CHECK(band->scalar_type() == at::kInt && band->numel() == 3 && band->is_cpu(),
                "rel_attn_cpu: attn_mask_band must be an int32 [3] CPU tensor, got ",
                band->scalar_type(), " ", band->sizes());
    const at::Tensor bc = band->contiguous();
    const int32_t* bp = bc.data_ptr<int32_t>();
    if (bp[0] != 0) {  // the mask is the band -right <= d <= left: bounds, no mask reads
      dense = false;
      g.dhi = std::min<int64_t>(g.dhi, bp[1]);
      g.dlo = std::max<int64_t>(g.dlo, -static_cast<int64_t>(bp[2]));
    }
  }
  if (kpm.has_value()) {
    TORCH_CHECK(kpm->scalar_type() == at::kBool && kpm->dim() == 2 && kpm->size(0) == g.B &&
                    kpm->size(1) == Lk,
                "rel_attn_cpu: key_padding_mask must be bool [B, Lk] = [", g.B, ", ", Lk,
                "], got ", kpm->scalar_type(), " ", kpm->sizes());
    g.kpm = kpm->data_ptr<bool>();
    g.kpm_s0 = kpm->stride(0);
    g.kpm_s1 = kpm->stride(1);
  }
  if (dense) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(0) == g.B &&
                    mask->size(1) == g.H && mask->size(2) == g.Lq && mask->size(3) == Lk,
                "rel_attn_cpu: attn_mask must be bool [B, H, Lq, Lk] = [", g.B, ", ", g.H, ", ",
                g.Lq, ", ", Lk, "] (an expanded view), got ", mask->scalar_type(), " ",
                mask->sizes());
    g.mask = mask->data_ptr<bool>();
    for (int i = 0; i < 4; ++i) g.ms[i] = mask->stride(i);
  }
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "rel_attn_cpu: dropout_p must be in [0, 1), got ",
              dropout_p);
  if (dropout_p > 0.0) {
    TORCH_CHECK(seed.has_value() && seed->scalar_type() == at::kLong && seed->numel() == 2 &&
                    seed->is_cpu(),
                "rel_attn_cpu: dropout_p > 0 needs dropout_seed, an int64 [2] (seed, offset) "
                "CPU tensor");
    const at::Tensor sc = seed->contiguous();
    g.drop.on = true;
    g.drop.seed = static_cast<uint64_t>(sc.data_ptr<int64_t>()[0]);
    g.drop.offset = static_cast<uint64_t>(sc.data_ptr<int64_t>()[1]);
    g.drop.set(dropout_p);
  }
  // query blocks of 128 rows (the forward widens them for long key ranges), key tiles of 256
  // (multiples of 16): the BLAS packs each key tile's rows once per 128 queries, and S, T and
  // the packed panels fit in a 512 KiB L2
  g.BM = std::min<int64_t>(128, g.Lq);
  g.BN = 256;
  use_band_tiles(g);
  return g;
}

void check_main(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& r, const at::Tensor& u, const at::Tensor& vb, int64_t M) {
  TORCH_CHECK(q.device().is_cpu(), "rel_attn_cpu: q must be a CPU tensor, got ", q.device());
  TORCH_CHECK(q.dim() == 4, "rel_attn_cpu: q must be 4-D [B, Lq, H, D], got ", q.sizes());
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf,
              "rel_attn_cpu: q must be float32, float64, bfloat16 or float16, got ", st);
  check_input("q", q, 4, q);
  check_input("k", k, 4, q);
  check_input("v", v, 4, q);
  check_input("r", r, 3, q);
  check_input("r_w_bias", u, 2, q);
  check_input("r_r_bias", vb, 2, q);
  const int64_t B = q.size(0), H = q.size(2), D = q.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(2) == H && k.size(3) == D, "rel_attn_cpu: k must be [",
              B, ", Lk, ", H, ", ", D, "], got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "rel_attn_cpu: v must have k's shape ", k.sizes(),
              ", got ", v.sizes());
  TORCH_CHECK(r.size(1) == H && r.size(2) == D, "rel_attn_cpu: r must be [R, ", H, ", ", D,
              "], got ", r.sizes());
  TORCH_CHECK(u.size(0) == H && u.size(1) == D && vb.size(0) == H && vb.size(1) == D,
              "rel_attn_cpu: r_w_bias and r_r_bias must be [", H, ", ", D, "], got ",
              u.sizes(), " and ", vb.sizes());
  TORCH_CHECK(q.size(1) >= 1 && k.size(1) + M >= 1 && B >= 1 && H >= 1 && D >= 1,
              "rel_attn_cpu: empty dimension in q ", q.sizes(), " / k ", k.sizes());
}

// The forward written into out ([B, Lq, H, D], contiguous; inference: no autograd), which may
// be q itself (then the attention needs no buffer of its own): every task reads its query rows
// (load_q / LowpGemm::load) before it writes them, and no task reads another's. Returns lse.
at::Tensor rel_attn_cpu_fwd_out(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& r,
    const at::Tensor& u, const at::Tensor& vb, double softmax_scale, int64_t wl, int64_t wr,
    const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& band, double dropout_p,
    const c10::optional<at::Tensor>& seed, const c10::optional<at::Tensor>& mem_k,
    const c10::optional<at::Tensor>& mem_k_scale, const c10::optional<at::Tensor>& mem_v,
    const c10::optional<at::Tensor>& mem_v_scale, c10::optional<int64_t> r_first_distance,
    at::Tensor& out) {
  TORCH_CHECK(out.device() == q.device() && out.scalar_type() == q.scalar_type() &&
                  out.sizes() == q.sizes() && out.is_contiguous(),
              "rel_attn_cpu: out must be a contiguous ", q.scalar_type(), " tensor of q's "
              "shape ", q.sizes(), " on q's device, got ", out.scalar_type(), " ", out.sizes(),
              out.is_contiguous() ? "" : " (not contiguous)", " on ", out.device());
  // out may be q (then q is contiguous too: its rows are out's); no other input may share
  // out's memory
  at::assert_no_partial_overlap(out, q);
  for (const at::Tensor* t : {&k, &v, &r, &u, &vb}) at::assert_no_overlap(out, *t);
  for (const c10::optional<at::Tensor>* t : {&kpm, &mask, &mem_k, &mem_v})
    if (t->has_value()) at::assert_no_overlap(out, **t);
  const c10::optional<at::Tensor> mem[4] = {mem_k, mem_k_scale, mem_v, mem_v_scale};
  const int n_mem = mem_k.has_value() + mem_k_scale.has_value() + mem_v.has_value() +
                    mem_v_scale.has_value();
  TORCH_CHECK_VALUE(n_mem == 0 || n_mem == 4, "rel_attn_cpu: mem_k, mem_k_scale, mem_v and "
              "mem_v_scale must be given together (an 8-bit memory) or not at all");
  int64_t M = 0;
  if (n_mem == 4) {
    M = mem_k->size(1);
    for (int w = 0; w < 4; w += 2) {
      const at::Tensor& d = *mem[w];
      const at::Tensor& s = *mem[w + 1];
      const char* nm = w == 0 ? "mem_k" : "mem_v";
      TORCH_CHECK(d.is_cpu() && s.is_cpu(), "rel_attn_cpu: ", nm, " must be on the CPU");
      TORCH_CHECK((d.scalar_type() == at::kChar || d.scalar_type() == at::kFloat8_e4m3fn) &&
                      d.dim() == 4 && d.size(0) == q.size(0) && d.size(1) == M &&
                      d.size(2) == q.size(2) && d.size(3) == q.size(3) && d.stride(3) == 1,
                  "rel_attn_cpu: ", nm, " must be int8 / float8_e4m3fn [B, M, H, D] with "
                  "stride(-1) == 1, got ", d.scalar_type(), " ", d.sizes());
      TORCH_CHECK((s.scalar_type() == at::kFloat || s.scalar_type() == at::kHalf) &&
                      s.dim() == 3 && s.size(0) == d.size(0) && s.size(1) == M &&
                      s.size(2) == d.size(2),
                  "rel_attn_cpu: ", nm, "_scale must be float32 / float16 [B, M, H], got ",
                  s.scalar_type(), " ", s.sizes());
    }
  }
  check_main(q, k, v, r, u, vb, M);
  Geometry g = make_geometry(q, M + k.size(1), r, softmax_scale, wl, wr, kpm, mask, band, dropout_p,
                             seed, r_first_distance);
  // long key ranges: query blocks of 256 rows, so each block's stream of K, V and r rows
  // (beyond the L2 cache at these lengths) serves twice the queries (measured: ~5% faster at
  // T = 4,096, ~3% slower at T = 1,024, whose rows mostly stay in the caches); not on the
  // brgemm route, whose fp32 row passes stay in L2 only at 128 rows (measured there: 10%
  // faster than 256 rows in bf16 at T = 4,096, 20% at T = 1,024)
  if (g.Lk >= 2048 && !g.band && !brgemm_route(q.scalar_type(), g.Lq))
    g.BM = std::min<int64_t>(256, g.Lq);
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor lse = at::empty({g.B, g.H, g.Lq}, q.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rel_attn_cpu_fwd",
                                  [&] { forward_impl<scalar_t>(g, q, k, v, r, u, vb, mem, out, lse); });
  return lse;
}

std::tuple<at::Tensor, at::Tensor> rel_attn_cpu_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& r,
    const at::Tensor& u, const at::Tensor& vb, double softmax_scale, int64_t wl, int64_t wr,
    const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& band, double dropout_p,
    const c10::optional<at::Tensor>& seed, const c10::optional<at::Tensor>& mem_k,
    const c10::optional<at::Tensor>& mem_k_scale, const c10::optional<at::Tensor>& mem_v,
    const c10::optional<at::Tensor>& mem_v_scale, c10::optional<int64_t> r_first_distance) {
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = rel_attn_cpu_fwd_out(q, k, v, r, u, vb, softmax_scale, wl, wr, kpm, mask, band,
                                        dropout_p, seed, mem_k, mem_k_scale, mem_v, mem_v_scale,
                                        r_first_distance, out);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
rel_attn_cpu_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& r, const at::Tensor& u,
                 const at::Tensor& vb, const at::Tensor& out, const at::Tensor& lse,
                 double softmax_scale, int64_t wl, int64_t wr, const c10::optional<at::Tensor>& kpm,
                 const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& band,
                 bool /*deterministic: the CPU backward always is*/, double dropout_p,
                 const c10::optional<at::Tensor>& seed, c10::optional<int64_t> r_first_distance) {
  check_main(q, k, v, r, u, vb, 0);
  check_input("dout", dout, 4, q);
  check_input("out", out, 4, q);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "rel_attn_cpu: dout and out must have q's shape ", q.sizes(), ", got ",
              dout.sizes(), " and ", out.sizes());
  Geometry g = make_geometry(q, k.size(1), r, softmax_scale, wl, wr, kpm, mask, band, dropout_p,
                             seed, r_first_distance);
  // enough tasks for every thread: split each (b, h) pair's query blocks when there are fewer
  // pairs than threads (each split then holds its own [Lk, D] / [R, D] accumulators)
  const int64_t pairs = g.B * g.H, nqb = (g.Lq + g.BM - 1) / g.BM;
  g.splits = std::max<int64_t>(
      1, std::min<int64_t>(nqb, (at::get_num_threads() + pairs - 1) / pairs));
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(lse.scalar_type() == acc && lse.dim() == 3 && lse.size(0) == g.B &&
                  lse.size(1) == g.H && lse.size(2) == g.Lq,
              "rel_attn_cpu: lse must be ", acc, " [B, H, Lq], got ", lse.scalar_type(), " ",
              lse.sizes());
  const at::Tensor lsec = lse.contiguous();
  auto o = q.options().dtype(acc);
  const int64_t S = g.splits;
  at::Tensor dq = at::zeros({g.B, g.H, g.Lq, g.D}, o);
  at::Tensor dk = at::zeros({g.B, g.H, S, g.Lk, g.D}, o), dv = at::zeros_like(dk),
             dr = at::zeros({g.B, g.H, S, g.R, g.D}, o), du = at::zeros({g.B, g.H, S, g.D}, o),
             dvb = at::zeros_like(du);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rel_attn_cpu_bwd",
                                  [&] {
                                    backward_impl<scalar_t>(g, dout, q, k, v, r, u, vb, out,
                                                            lsec, dq, dk, dv, dr, du, dvb);
                                  });
  // sums over the splits (dim 2), then over the batch (dim 0), in a fixed order
  auto ordered_sum = [](const at::Tensor& t, int64_t dim) {
    if (t.size(dim) == 1) return t.select(dim, 0);
    at::Tensor s = t.select(dim, 0).clone();
    for (int64_t i = 1; i < t.size(dim); ++i) s.add_(t.select(dim, i));
    return s;
  };
  auto batch_sum = [&](const at::Tensor& t) { return ordered_sum(t, 0); };
  dk = ordered_sum(dk, 2);
  dv = ordered_sum(dv, 2);
  dr = ordered_sum(dr, 2);
  du = ordered_sum(du, 2);
  dvb = ordered_sum(dvb, 2);
  const auto st = q.scalar_type();
  return {dq.transpose(1, 2).to(st).contiguous(), dk.transpose(1, 2).to(st).contiguous(),
          dv.transpose(1, 2).to(st).contiguous(), batch_sum(dr).transpose(0, 1).to(st).contiguous(),
          batch_sum(du).to(st), batch_sum(dvb).to(st)};
}

// How many threads the kernels' at::parallel_for runs on at the current torch thread count:
// the number of chunks one parallel_for over that many tasks is split into (1 where the
// extension was compiled without OpenMP, whose pragma at::parallel_for's header relies on).
int64_t rel_attn_cpu_threads() {
  std::atomic<int64_t> chunks{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { ++chunks; });
  return chunks.load();
}

// How the forward's GEMMs run for dtype at the current ISA variant: "brgemm (AMX)" (bf16 /
// fp16 operands, fp32 accumulation), "fp32 tiles" (bf16 / fp16 converted to fp32 for the
// BLAS), "brgemm (fp32)" (fp32 on oneDNN's brgemm, for calls of kFp32BrgemmMinRows query rows
// or more) or "native" (fp32 on the BLAS, fp64).
std::string cpu_lowp_route(at::ScalarType dtype) {
  if (dtype == at::kFloat && brgemm_route(dtype, kFp32BrgemmMinRows)) return "brgemm (fp32)";
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return "native";
  return brgemm_route(dtype, 0) ? "brgemm (AMX)" : "fp32 tiles";
}

// The fp32 GEMM choice ("blas" or "brgemm"; the route also needs a vector ISA variant).
std::string cpu_fp32_gemm() { return kFp32GemmNames[static_cast<int>(fp32_gemm())]; }

// tests: force the fp32 GEMM choice ("" restores the process's own); returns the one in use
std::string cpu_fp32_gemm_override(const std::string& which) {
  int want = which.empty() ? fp32_gemm_default() : -1;
  for (int i = 0; i < 2; ++i)
    if (which == kFp32GemmNames[i]) want = i;
  TORCH_CHECK_VALUE(want >= 0, "cpu_fp32_gemm_override: which must be \"blas\", \"brgemm\" "
                    "or \"\" (the process's own choice), got \"", which, "\"");
  TORCH_CHECK_VALUE(want == 0 || fp32_brgemm_runs(), "cpu_fp32_gemm_override: fp32 brgemm "
                    "does not run in this torch build on this CPU");
  g_fp32_gemm.store(want, std::memory_order_relaxed);
  return cpu_fp32_gemm();
}

// Forward and backward calls so far that took the brgemm route (tests read it before and
// after a call).
int64_t cpu_brgemm_calls() { return g_brgemm_calls.load(); }

}  // namespace

// The attention ops' schemas, as txl_kernels/_op.py spells them (tests/test_op.py compares):
// the Python package defines them on import (its CUDA kernels, fake and autograd need no C++
// build), so they are defined here only where nothing has (a process that loads this library
// without the package: TorchScript or AOTInductor in C++, torch.ops.load_library).
const char* const kRelAttnSchemas[] = {
    "rel_attn_fwd(Tensor q, Tensor k, Tensor v, Tensor r, Tensor r_w_bias, Tensor r_r_bias, "
    "float softmax_scale, int window_left, int window_right, Tensor? key_padding_mask=None, "
    "Tensor? attn_mask=None, Tensor? attn_mask_band=None, float dropout_p=0., "
    "Tensor? dropout_seed=None, Tensor? mem_k=None, Tensor? mem_k_scale=None, "
    "Tensor? mem_v=None, Tensor? mem_v_scale=None, int? r_first_distance=None) "
    "-> (Tensor, Tensor)",
    "rel_attn_fwd.out(Tensor q, Tensor k, Tensor v, Tensor r, Tensor r_w_bias, "
    "Tensor r_r_bias, float softmax_scale, int window_left, int window_right, "
    "Tensor? key_padding_mask=None, Tensor? attn_mask=None, Tensor? attn_mask_band=None, "
    "float dropout_p=0., Tensor? dropout_seed=None, Tensor? mem_k=None, "
    "Tensor? mem_k_scale=None, Tensor? mem_v=None, Tensor? mem_v_scale=None, "
    "int? r_first_distance=None, *, Tensor(a!) out) -> Tensor",
    "rel_attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor r, Tensor r_w_bias, "
    "Tensor r_r_bias, Tensor out, Tensor lse, float softmax_scale, int window_left, "
    "int window_right, Tensor? key_padding_mask=None, Tensor? attn_mask=None, "
    "Tensor? attn_mask_band=None, bool deterministic=True, float dropout_p=0., "
    "Tensor? dropout_seed=None, int? r_first_distance=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "rel_attn_decode(Tensor q, Tensor k, Tensor v, Tensor r, Tensor r_w_bias, "
    "Tensor r_r_bias, float softmax_scale, int window_left=-1, Tensor? mem_k=None, "
    "Tensor? mem_k_scale=None, Tensor? mem_v=None, Tensor? mem_v_scale=None, "
    "int? r_first_distance=None) -> Tensor",
};

struct DefineRelAttnOps {
  DefineRelAttnOps() {
    if (c10::Dispatcher::singleton().findSchema({"txl_kernels::rel_attn_fwd", ""})) return;
    lib = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "txl_kernels",
                                           std::nullopt, __FILE__, __LINE__);
    for (const char* s : kRelAttnSchemas) lib->def(s);
  }
  std::unique_ptr<torch::Library> lib;
};
const DefineRelAttnOps define_rel_attn_ops;

TORCH_LIBRARY_FRAGMENT(txl_kernels, m) {
  m.def("rel_attn_cpu_threads() -> int", &rel_attn_cpu_threads);
  m.def("cpu_lowp_route(ScalarType dtype) -> str", &cpu_lowp_route);
  m.def("cpu_fp32_gemm() -> str", &cpu_fp32_gemm);
  m.def("cpu_fp32_gemm_override(str which) -> str", &cpu_fp32_gemm_override);
  m.def("cpu_brgemm_calls() -> int", &cpu_brgemm_calls);
}

TORCH_LIBRARY_IMPL(txl_kernels, CPU, m) {
  m.impl("rel_attn_fwd", &rel_attn_cpu_fwd);
  m.impl("rel_attn_fwd.out", &rel_attn_cpu_fwd_out);
  m.impl("rel_attn_bwd", &rel_attn_cpu_bwd);
}

}  // namespace txl_kernels
