// One query row against the cached keys, on CPUs (see decode_attention.h). Three passes over
// the rows of the cache, each reading them in their storage order (all heads of a key row
// together): the scores (both dot products per head), ATen's softmax over them (vectorised),
// and the probability-weighted sum of the value rows. No [Lk, B, H, D] temporary: the torch
// fallback (txl_kernels.cached_attention.decode_attention_torch) writes one per product.
#include "decode_attention.h"

#include <torch/library.h>

#include "cpu_isa.h"
#include "cpu_simd.h"
#include "segment_memory.h"

#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace txl_kernels {
namespace {

// The fp32 loops are also compiled for AVX2 + FMA and for AVX-512, the variant picked at run
// time from ATen's own choice (cpu_isa.h).

template <typename T>
using acc_t = std::conditional_t<std::is_same<T, double>::value, double, float>;

// Element d of a key / value row as T: a T row as it is; an 8-bit row dequantised as
// txl_kernels.quant.dequantize_per_token does (the fp32 product of value and scale, rounded
// to T).
template <typename T>
TXL_ALWAYS_INLINE inline T load(const T* x, float) { return *x; }
template <typename T>
TXL_ALWAYS_INLINE inline T load(const int8_t* x, float s) {
  return static_cast<T>(static_cast<float>(*x) * s);
}
template <typename T>
TXL_ALWAYS_INLINE inline T load(const c10::Float8_e4m3fn* x, float s) {
  return static_cast<T>(kFp8Values[x->x] * s);
}

// fp32 rows are processed 8 at a time in GCC / Clang vector types (one AVX register in the
// AVX2 clones, two SSE registers in the default build): the compilers do not vectorise the
// scalar loops below well enough for these short rows (D ~ 41-64).
#ifdef TXL_VEC8
TXL_ALWAYS_INLINE inline v8f load8(const float* x, float) {
  v8f v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
TXL_ALWAYS_INLINE inline v8f load8(const int8_t* x, float s) {
  v8i8 b;
  std::memcpy(&b, x, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, v8i32), v8f) * s;
}
TXL_ALWAYS_INLINE inline v8f load8(const c10::Float8_e4m3fn* x, float s) {
  const v8f v = {kFp8Values[x[0].x], kFp8Values[x[1].x], kFp8Values[x[2].x], kFp8Values[x[3].x],
                 kFp8Values[x[4].x], kFp8Values[x[5].x], kFp8Values[x[6].x], kFp8Values[x[7].x]};
  return v * s;
}
#endif

// a . x + c . y over n elements in A (a: a key row of element type X with its scale sa), with
// 8 independent partial sums and one horizontal sum for both products: 8-wide vectors for fp32
// (GCC / Clang), 8 scalar sums otherwise (fp64, other compilers)
template <typename T, typename A, typename X>
TXL_ALWAYS_INLINE inline A dot2(const X* a, float sa, const T* x, const T* c, const T* y,
                                int64_t n) {
  int64_t d = 0;
  A total = 0;
#ifdef TXL_VEC8
  if constexpr (std::is_same<T, float>::value) {
    v8f part = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; d + 8 <= n; d += 8)
      part += load8(a + d, sa) * load8(x + d, 1.0f) + load8(c + d, 1.0f) * load8(y + d, 1.0f);
    total = hsum8(part);
  }
#endif
  A part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; d + 8 <= n; d += 8) {
    for (int l = 0; l < 8; ++l) {
      part[l] += static_cast<A>(load<T>(a + d + l, sa)) * static_cast<A>(x[d + l]);
      part[l] += static_cast<A>(c[d + l]) * static_cast<A>(y[d + l]);
    }
  }
  for (; d < n; ++d) {
    total += static_cast<A>(load<T>(a + d, sa)) * static_cast<A>(x[d]);
    total += static_cast<A>(c[d]) * static_cast<A>(y[d]);
  }
  return total + (((part[0] + part[4]) + (part[1] + part[5])) +
                  ((part[2] + part[6]) + (part[3] + part[7])));
}

// y += p * row (a value row of element type X with its scale s)
template <typename T, typename A, typename X>
TXL_ALWAYS_INLINE inline void axpy(A p, const X* x, float s, A* y, int64_t n) {
  int64_t d = 0;
#ifdef TXL_VEC8
  if constexpr (std::is_same<T, float>::value) {
    for (; d + 8 <= n; d += 8) {
      v8f acc;
      std::memcpy(&acc, y + d, sizeof acc);
      acc += p * load8(x + d, s);
      std::memcpy(y + d, &acc, sizeof acc);
    }
  }
#endif
  for (; d < n; ++d) y[d] += p * static_cast<A>(load<T>(x + d, s));
}

// Rows are read kAhead ahead of use: the passes stream the cache from memory (it does not
// stay in cache from one decoding step to the next), and a software prefetch keeps more of
// those reads in flight than the hardware prefetcher does for these short rows.
constexpr int64_t kAhead = 12;

template <typename X>
TXL_ALWAYS_INLINE inline void prefetch_row(const X* row, int64_t H, int64_t stride_h,
                                           int64_t D) {
  if (stride_h == D) {  // the heads packed in the row (the cache's layout): one span
    prefetch_span(row, H * D);
    return;
  }
  for (int64_t h = 0; h < H; ++h) prefetch_span(row + h * stride_h, D);
}

struct Strides {
  int64_t n, b, h;  // element strides of the row, batch and head dims
};

inline Strides strides_of(const at::Tensor& t) {  // [rows, B, H(, D)]
  return Strides{t.stride(0), t.stride(1), t.stride(2)};
}

// Keys / values: rows [0, M) from the 8-bit memory (data Q [M, B, H, D], scales S [M, B, H]),
// rows [M, Lk) from k / v (T [Lk - M, B, H, D]); M = 0 without a memory.
template <typename T, typename Q, typename S>
struct Job {
  const T *K, *V, *R, *qu, *qv, *P;
  const Q *KQ, *VQ;
  const S *KS, *VS;
  acc_t<T>* scores;
  Strides ks, vs, kqs, vqs, kss, vss;
  int64_t rs_n, rs_h, H, D, n, lo, Lk, M;
  acc_t<T> softmax_scale;
};

// The two streaming loops, over a range of (batch, key) rows. Plain loops that the compiler
// vectorises; for fp32 on x86-64 with GCC they are also compiled for AVX2 + FMA and for
// AVX-512 and the variant is picked at run time (cpu_isa.h), the default build targeting SSE2
// only.
template <typename T, typename Q, typename S>
TXL_ALWAYS_INLINE inline void scores_rows(const Job<T, Q, S>& J, int64_t i0, int64_t i1) {
  using A = acc_t<T>;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / J.n, j = J.lo + (i - b * J.n);
    const T* rrow = J.R + j * J.rs_n;
    const T* qu = J.qu + b * J.H * J.D;
    const T* qv = J.qv + b * J.H * J.D;
    A* out = J.scores + b * J.H * J.n + (j - J.lo);
    if (j + kAhead < J.Lk) prefetch_row(rrow + kAhead * J.rs_n, J.H, J.rs_h, J.D);
    if (j < J.M) {
      const Q* krow = J.KQ + j * J.kqs.n + b * J.kqs.b;
      const S* srow = J.KS + j * J.kss.n + b * J.kss.b;
      if (j + kAhead < J.M) prefetch_row(krow + kAhead * J.kqs.n, J.H, J.kqs.h, J.D);
      for (int64_t h = 0; h < J.H; ++h)
        out[h * J.n] = J.softmax_scale * dot2<T, A>(krow + h * J.kqs.h,
                                             static_cast<float>(srow[h * J.kss.h]),
                                             qu + h * J.D, rrow + h * J.rs_h, qv + h * J.D, J.D);
    } else {
      const T* krow = J.K + (j - J.M) * J.ks.n + b * J.ks.b;
      if (j + kAhead < J.Lk) prefetch_row(krow + kAhead * J.ks.n, J.H, J.ks.h, J.D);
      for (int64_t h = 0; h < J.H; ++h)
        out[h * J.n] = J.softmax_scale * dot2<T, A>(krow + h * J.ks.h, 1.0f, qu + h * J.D,
                                             rrow + h * J.rs_h, qv + h * J.D, J.D);
    }
  }
}

template <typename T, typename Q, typename S>
TXL_ALWAYS_INLINE inline void weighted_rows(const Job<T, Q, S>& J, int64_t b, acc_t<T>* acc) {
  using A = acc_t<T>;
  for (int64_t j = J.lo; j < J.Lk; ++j) {
    const T* p = J.P + b * J.H * J.n + (j - J.lo);
    if (j < J.M) {
      const Q* vrow = J.VQ + j * J.vqs.n + b * J.vqs.b;
      const S* srow = J.VS + j * J.vss.n + b * J.vss.b;
      if (j + kAhead < J.M) prefetch_row(vrow + kAhead * J.vqs.n, J.H, J.vqs.h, J.D);
      for (int64_t h = 0; h < J.H; ++h)
        axpy<T, A>(static_cast<A>(p[h * J.n]), vrow + h * J.vqs.h,
                   static_cast<float>(srow[h * J.vss.h]), acc + h * J.D, J.D);
    } else {
      const T* vrow = J.V + (j - J.M) * J.vs.n + b * J.vs.b;
      if (j + kAhead < J.Lk) prefetch_row(vrow + kAhead * J.vs.n, J.H, J.vs.h, J.D);
      for (int64_t h = 0; h < J.H; ++h)
        axpy<T, A>(static_cast<A>(p[h * J.n]), vrow + h * J.vs.h, 1.0f, acc + h * J.D, J.D);
    }
  }
}

// fp32 entry points, one per ISA variant, called through cpu_isa(); fp64 calls the templates
// directly
#define TXL_FP32_VARIANT(Q, S, NAME, ISA, ATTR)                                              \
  ATTR void scores_##NAME##_##ISA(const Job<float, Q, S>& J, int64_t i0, int64_t i1) {        \
    scores_rows<float, Q, S>(J, i0, i1);                                                    \
  }                                                                                         \
  ATTR void weighted_##NAME##_##ISA(const Job<float, Q, S>& J, int64_t b, float* acc) {       \
    weighted_rows<float, Q, S>(J, b, acc);                                                  \
  }
#define TXL_FP32_LOOPS(Q, S, NAME)                                                          \
  TXL_FP32_VARIANT(Q, S, NAME, default, )                                                   \
  TXL_FP32_VARIANT(Q, S, NAME, avx2, TXL_TARGET_AVX2)                                       \
  TXL_FP32_VARIANT(Q, S, NAME, avx512, TXL_TARGET_AVX512)                                   \
  inline void scores_any(const Job<float, Q, S>& J, int64_t i0, int64_t i1) {               \
    switch (cpu_isa()) {                                                                    \
      case CpuIsa::kAvx512: return scores_##NAME##_avx512(J, i0, i1);                       \
      case CpuIsa::kAvx2: return scores_##NAME##_avx2(J, i0, i1);                           \
      default: return scores_##NAME##_default(J, i0, i1);                                   \
    }                                                                                       \
  }                                                                                         \
  inline void weighted_any(const Job<float, Q, S>& J, int64_t b, float* acc) {              \
    switch (cpu_isa()) {                                                                    \
      case CpuIsa::kAvx512: return weighted_##NAME##_avx512(J, b, acc);                     \
      case CpuIsa::kAvx2: return weighted_##NAME##_avx2(J, b, acc);                         \
      default: return weighted_##NAME##_default(J, b, acc);                                 \
    }                                                                                       \
  }
TXL_FP32_LOOPS(int8_t, float, i8_f32)
TXL_FP32_LOOPS(int8_t, c10::Half, i8_f16)
TXL_FP32_LOOPS(c10::Float8_e4m3fn, float, f8_f32)
TXL_FP32_LOOPS(c10::Float8_e4m3fn, c10::Half, f8_f16)
#undef TXL_FP32_VARIANT
#undef TXL_FP32_LOOPS

template <typename Q, typename S>
inline void scores_any(const Job<double, Q, S>& J, int64_t i0, int64_t i1) {
  scores_rows<double, Q, S>(J, i0, i1);
}
template <typename Q, typename S>
inline void weighted_any(const Job<double, Q, S>& J, int64_t b, double* acc) {
  weighted_rows<double, Q, S>(J, b, acc);
}

template <typename T, typename Q, typename S>
void decode_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& r, const at::Tensor& u, const at::Tensor& vb,
                double softmax_scale, int64_t lo, const at::Tensor* mem, at::Tensor& out) {
  using A = acc_t<T>;
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t M = mem ? mem[0].size(0) : 0, Lk = M + k.size(0);
  const int64_t n = Lk - lo;
  // (q + u), (q + vb) rounded to T, as the torch path computes them: [B, H, D] each
  std::vector<T> qu(B * H * D), qv(B * H * D);
  {
    const T* Q_ = q.data_ptr<T>();
    const T* U = u.data_ptr<T>();
    const T* VB = vb.data_ptr<T>();
    for (const auto b : c10::irange(B))
      for (const auto h : c10::irange(H))
        for (const auto d : c10::irange(D)) {
          const T x = Q_[b * q.stride(0) + h * q.stride(1) + d];
          qu[(b * H + h) * D + d] = static_cast<T>(x + U[h * u.stride(0) + d]);
          qv[(b * H + h) * D + d] = static_cast<T>(x + VB[h * vb.stride(0) + d]);
        }
  }
  at::Tensor scores = at::empty({B, H, n}, q.options().dtype(c10::CppTypeToScalarType<A>()));
  Job<T, Q, S> J{};
  J.K = k.data_ptr<T>();
  J.V = v.data_ptr<T>();
  J.R = r.data_ptr<T>();
  J.qu = qu.data();
  J.qv = qv.data();
  J.scores = scores.data_ptr<A>();
  J.ks = strides_of(k);
  J.vs = strides_of(v);
  if (mem) {
    J.KQ = reinterpret_cast<const Q*>(mem[0].data_ptr());
    J.KS = reinterpret_cast<const S*>(mem[1].data_ptr());
    J.VQ = reinterpret_cast<const Q*>(mem[2].data_ptr());
    J.VS = reinterpret_cast<const S*>(mem[3].data_ptr());
    J.kqs = strides_of(mem[0]);
    J.kss = strides_of(mem[1]);
    J.vqs = strides_of(mem[2]);
    J.vss = strides_of(mem[3]);
  }
  J.rs_n = r.stride(0);
  J.rs_h = r.stride(1);
  J.H = H;
  J.D = D;
  J.n = n;
  J.lo = lo;
  J.Lk = Lk;
  J.M = M;
  J.softmax_scale = static_cast<A>(softmax_scale);
  // pass 1: scores [B, H, n] in A
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, H * D));
  at::parallel_for(0, B * n, grain, [&](int64_t i0, int64_t i1) { scores_any(J, i0, i1); });
  // pass 2: the softmax over keys (ATen's vectorised kernel; the scores are already in T:
  // acc_t<T> is T for the two dtypes dispatched)
  const at::Tensor prob = at::_softmax(scores, -1, false);
  J.P = prob.data_ptr<T>();
  // pass 3: out[b, h] = sum_j P[b, h, j] v[j, b, h]
  T* O = out.data_ptr<T>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<A> acc(H * D);
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(acc.begin(), acc.end(), A(0));
      weighted_any(J, b, acc.data());
      for (const auto i : c10::irange(H * D)) O[b * H * D + i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& r, const at::Tensor& u, const at::Tensor& vb,
                            double softmax_scale, int64_t lo,
                            const std::optional<at::Tensor>& k_mem,
                            const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_mem,
                            const std::optional<at::Tensor>& v_scale) {
  const char* who = "decode_attention";
  TORCH_CHECK(q.dim() == 3, who, ": q must be [B, H, D], got ", q.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(k.dim() == 4 && k.size(1) == B && k.size(2) == H && k.size(3) == D, who,
              ": k must be [Lc, ", B, ", ", H, ", ", D, "], got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), who, ": v must be ", k.sizes(), ", got ", v.sizes());
  const int n_mem = int(k_mem.has_value()) + int(k_scale.has_value()) +
                    int(v_mem.has_value()) + int(v_scale.has_value());
  TORCH_CHECK(n_mem == 0 || n_mem == 4, who,
              ": pass all of k_mem, k_scale, v_mem, v_scale (an 8-bit memory) or none");
  at::Tensor mem[4];
  int64_t M = 0;
  if (n_mem == 4) {
    mem[0] = *k_mem;
    mem[1] = *k_scale;
    mem[2] = *v_mem;
    mem[3] = *v_scale;
    M = mem[0].size(0);
    const auto qd = mem[0].scalar_type(), sd = mem[1].scalar_type();
    TORCH_CHECK(qd == at::kChar || qd == at::kFloat8_e4m3fn, who,
                ": k_mem must be int8 or float8_e4m3fn, got ", qd);
    TORCH_CHECK(sd == at::kFloat || sd == at::kHalf, who,
                ": k_scale must be float32 or float16, got ", sd);
    for (int i = 0; i < 4; i += 2) {
      const char* name = i == 0 ? "k_mem" : "v_mem";
      const char* sname = i == 0 ? "k_scale" : "v_scale";
      TORCH_CHECK(mem[i].dim() == 4 && mem[i].size(0) == M && mem[i].size(1) == B &&
                      mem[i].size(2) == H && mem[i].size(3) == D && mem[i].scalar_type() == qd &&
                      mem[i].device().is_cpu() && (mem[i].stride(3) == 1 || D == 1),
                  who, ": ", name, " must be a CPU ", qd, " tensor [", M, ", ", B, ", ", H,
                  ", ", D, "] with a contiguous last dimension, got ", mem[i].sizes(), " ",
                  mem[i].scalar_type(), " strides ", mem[i].strides());
      TORCH_CHECK(mem[i + 1].dim() == 3 && mem[i + 1].size(0) == M && mem[i + 1].size(1) == B &&
                      mem[i + 1].size(2) == H && mem[i + 1].scalar_type() == sd &&
                      mem[i + 1].device().is_cpu(),
                  who, ": ", sname, " must be a CPU ", sd, " tensor [", M, ", ", B, ", ", H,
                  "], got ", mem[i + 1].sizes(), " ", mem[i + 1].scalar_type());
    }
  }
  const int64_t Lk = M + k.size(0);
  TORCH_CHECK(r.dim() == 3 && r.size(0) == Lk && r.size(1) == H && r.size(2) == D, who,
              ": r must be [", Lk, ", ", H, ", ", D, "], got ", r.sizes());
  TORCH_CHECK(u.dim() == 2 && u.size(0) == H && u.size(1) == D && vb.sizes() == u.sizes(),
              who, ": u and vb must be [", H, ", ", D, "], got ", u.sizes(), " and ",
              vb.sizes());
  TORCH_CHECK(lo >= 0 && lo < Lk, who, ": lo must be in [0, ", Lk, "), got ", lo);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, who,
              ": float32 or float64 tensors only, got ", dtype);
  for (const at::Tensor* t : {&q, &k, &v, &r, &u, &vb}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype, who,
                ": every tensor must be a CPU ", dtype, " tensor, got ", t->scalar_type(),
                " on ", t->device());
    TORCH_CHECK(t->stride(-1) == 1 || t->size(-1) == 1, who,
                ": the last dimension must be contiguous, got strides ", t->strides());
  }
  at::Tensor out = at::empty({B, H, D}, q.options());
  if (B * H * D == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(dtype, "txl_decode_attention_cpu", [&] {
    if (M == 0) {
      decode_cpu<scalar_t, int8_t, float>(q, k, v, r, u, vb, softmax_scale, lo, nullptr, out);
      return;
    }
    dispatch_quant(static_cast<int>(mem[0].scalar_type()), static_cast<int>(mem[1].scalar_type()),
                   [&](auto q0, auto s0) {
                     decode_cpu<scalar_t, decltype(q0), decltype(s0)>(q, k, v, r, u, vb,
                                                                       softmax_scale, lo, mem,
                                                                       out);
                   });
  });
  return out;
}

}  // namespace txl_kernels

namespace txl_kernels {

// The CPU kernel of txl_kernels::rel_attn_decode (txl_kernels/_op.py; its CUDA kernel is the
// Triton split-K decode): q [B, 1, H, D], k / v [B, Lc, H, D] and an optional 8-bit memory
// mem_k / mem_v [B, M, H, D], mem_k_scale / mem_v_scale [B, M, H] (any strides, last dimension
// contiguous: the K/V cache's seq-first rows as transposed views), r row
// r_first_distance - (Lk - 1 - j) serving key j (default: row j), causal, keys before
// Lk - 1 - window_left dropped. Returns [B, 1, H, D].
at::Tensor rel_attn_decode_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& r, const at::Tensor& u, const at::Tensor& vb,
                               double softmax_scale, int64_t window_left,
                               const std::optional<at::Tensor>& mem_k,
                               const std::optional<at::Tensor>& mem_k_scale,
                               const std::optional<at::Tensor>& mem_v,
                               const std::optional<at::Tensor>& mem_v_scale,
                               std::optional<int64_t> r_first_distance) {
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(1) == 1, "rel_attn_decode: q must be [B, 1, H, D] "
                    "(one query row), got ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4 && v.dim() == 4, "rel_attn_decode: k and v must be "
                    "[B, Lc, H, D], got ", k.sizes(), " and ", v.sizes());
  const int64_t M = mem_k.has_value() ? mem_k->size(1) : 0;
  const int64_t Lk = M + k.size(1);
  TORCH_CHECK_VALUE(Lk >= 1, "rel_attn_decode: no key (Lc = 0 and no memory)");
  const int64_t lo = window_left < 0 ? 0 : std::max<int64_t>(0, Lk - 1 - window_left);
  const int64_t shift = r_first_distance.has_value() ? *r_first_distance - (Lk - 1) : 0;
  TORCH_CHECK_VALUE(lo + shift >= 0 && Lk - 1 + shift < r.size(0), "rel_attn_decode: r has ",
                    r.size(0), " rows and r_first_distance=",
                    r_first_distance.has_value() ? std::to_string(*r_first_distance) : "None",
                    ", but the allowed keys (Lk=", Lk, ", window_left=", window_left,
                    ") need rows ", lo + shift, "..", Lk - 1 + shift);
  // the kernel reads row j for key j in [lo, Lk): r's rows from shift on (rows before lo that
  // do not exist are zeros it never reads)
  at::Tensor rows = r;
  if (shift > 0 || r.size(0) != Lk) {
    rows = shift >= 0 ? r.narrow(0, shift, Lk)
                      : at::cat({r.new_zeros({-shift, r.size(1), r.size(2)}),
                                 r.narrow(0, 0, Lk + shift)});
  }
  auto seq_first = [](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (!t.has_value()) return std::nullopt;
    return t->transpose(0, 1);
  };
  return decode_attention(q.select(1, 0), k.transpose(0, 1), v.transpose(0, 1), rows, u, vb,
                          softmax_scale, lo, seq_first(mem_k), seq_first(mem_k_scale),
                          seq_first(mem_v), seq_first(mem_v_scale))
      .unsqueeze(1);
}

}  // namespace txl_kernels

TORCH_LIBRARY_IMPL(txl_kernels, CPU, m) {
  m.impl("rel_attn_decode", &txl_kernels::rel_attn_decode_cpu);
}
