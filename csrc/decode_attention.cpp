// One query row against the cached keys, on CPUs (see decode_attention.h). Three passes over
// the rows of the cache, each reading them in their storage order (all heads of a key row
// together): the scores (both dot products per head), ATen's softmax over them (vectorised),
// and the probability-weighted sum of the value rows. No [Lk, B, H, D] temporary: the torch
// fallback (txl_kernels.models.mem_transformer.decode_attention_torch) writes one per product.
#include "decode_attention.h"

#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace txl_kernels {
namespace {

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TXL_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define TXL_CLONES
#endif
#if defined(__GNUC__)
#define TXL_ALWAYS_INLINE __attribute__((always_inline))
#else
#define TXL_ALWAYS_INLINE
#endif

template <typename T>
using acc_t = std::conditional_t<std::is_same<T, double>::value, double, float>;

// a . x + c . y over n elements in A, with 8 independent partial sums (vectorisable without
// reassociation flags; one horizontal sum for both products)
template <typename T, typename A>
inline A dot2(const T* a, const T* x, const T* c, const T* y, int64_t n) {
  A part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int l = 0; l < 8; ++l) {
      part[l] += static_cast<A>(a[d + l]) * static_cast<A>(x[d + l]);
      part[l] += static_cast<A>(c[d + l]) * static_cast<A>(y[d + l]);
    }
  }
  A tail = 0;
  for (; d < n; ++d) {
    tail += static_cast<A>(a[d]) * static_cast<A>(x[d]);
    tail += static_cast<A>(c[d]) * static_cast<A>(y[d]);
  }
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]))
         + tail;
}

// Rows are read kAhead ahead of use: the passes stream the cache from memory (it does not
// stay in cache from one decoding step to the next), and a software prefetch keeps more of
// those reads in flight than the hardware prefetcher does for these short rows.
constexpr int64_t kAhead = 12;

template <typename T>
inline void prefetch_row(const T* row, int64_t H, int64_t stride_h, int64_t D) {
  const int64_t line = 64 / static_cast<int64_t>(sizeof(T));
  for (int64_t h = 0; h < H; ++h) {
    const T* x = row + h * stride_h;
    for (int64_t d = 0; d < D; d += line) __builtin_prefetch(x + d);
    __builtin_prefetch(x + D - 1);
  }
}

struct Strides {
  int64_t n, b, h;  // element strides of the row, batch and head dims (the last one is 1)
};

inline Strides strides_of(const at::Tensor& t) {  // [Lk, B, H, D]
  return Strides{t.stride(0), t.stride(1), t.stride(2)};
}

// The two streaming loops, over a range of (batch, key) rows. Plain loops that the compiler
// vectorises; for fp32 on x86-64 with GCC they are also compiled for AVX2 + FMA and picked at
// load time (target_clones), the default build targeting SSE2 only.
template <typename T>
struct Job {
  const T *K, *R, *V, *qu, *qv, *P;
  acc_t<T>* S;
  Strides ks, vs;
  int64_t rs_n, rs_h, H, D, n, lo, Lk;
  acc_t<T> scale;
};

template <typename T>
TXL_ALWAYS_INLINE inline void scores_rows(const Job<T>& J, int64_t i0, int64_t i1) {
  using A = acc_t<T>;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / J.n, j = J.lo + (i - b * J.n);
    const T* krow = J.K + j * J.ks.n + b * J.ks.b;
    const T* rrow = J.R + j * J.rs_n;
    if (j + kAhead < J.Lk) {
      prefetch_row(krow + kAhead * J.ks.n, J.H, J.ks.h, J.D);
      prefetch_row(rrow + kAhead * J.rs_n, J.H, J.rs_h, J.D);
    }
    for (int64_t h = 0; h < J.H; ++h) {
      const A s = dot2<T, A>(krow + h * J.ks.h, J.qu + (b * J.H + h) * J.D,
                             rrow + h * J.rs_h, J.qv + (b * J.H + h) * J.D, J.D);
      J.S[(b * J.H + h) * J.n + (j - J.lo)] = s * J.scale;
    }
  }
}

template <typename T>
TXL_ALWAYS_INLINE inline void weighted_rows(const Job<T>& J, int64_t b, acc_t<T>* acc) {
  using A = acc_t<T>;
  for (int64_t j = J.lo; j < J.Lk; ++j) {
    const T* vrow = J.V + j * J.vs.n + b * J.vs.b;
    if (j + kAhead < J.Lk) prefetch_row(vrow + kAhead * J.vs.n, J.H, J.vs.h, J.D);
    for (int64_t h = 0; h < J.H; ++h) {
      const A p = static_cast<A>(J.P[(b * J.H + h) * J.n + (j - J.lo)]);
      const T* x = vrow + h * J.vs.h;
      A* y = acc + h * J.D;
      for (int64_t d = 0; d < J.D; ++d) y[d] += p * static_cast<A>(x[d]);
    }
  }
}

TXL_CLONES void scores_rows_f32(const Job<float>& J, int64_t i0, int64_t i1) {
  scores_rows<float>(J, i0, i1);
}
TXL_CLONES void weighted_rows_f32(const Job<float>& J, int64_t b, float* acc) {
  weighted_rows<float>(J, b, acc);
}
inline void scores_rows_any(const Job<float>& J, int64_t i0, int64_t i1) {
  scores_rows_f32(J, i0, i1);
}
inline void scores_rows_any(const Job<double>& J, int64_t i0, int64_t i1) {
  scores_rows<double>(J, i0, i1);
}
inline void weighted_rows_any(const Job<float>& J, int64_t b, float* acc) {
  weighted_rows_f32(J, b, acc);
}
inline void weighted_rows_any(const Job<double>& J, int64_t b, double* acc) {
  weighted_rows<double>(J, b, acc);
}

template <typename T>
void decode_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& r, const at::Tensor& u, const at::Tensor& vb, double scale,
                int64_t lo, at::Tensor& out) {
  using A = acc_t<T>;
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Lk = k.size(0);
  const int64_t n = Lk - lo;
  // (q + u), (q + vb) rounded to T, as the torch path computes them: [B, H, D] each
  std::vector<T> qu(B * H * D), qv(B * H * D);
  {
    const T* Q = q.data_ptr<T>();
    const T* U = u.data_ptr<T>();
    const T* VB = vb.data_ptr<T>();
    for (const auto b : c10::irange(B))
      for (const auto h : c10::irange(H))
        for (const auto d : c10::irange(D)) {
          const T x = Q[b * q.stride(0) + h * q.stride(1) + d];
          qu[(b * H + h) * D + d] = static_cast<T>(x + U[h * u.stride(0) + d]);
          qv[(b * H + h) * D + d] = static_cast<T>(x + VB[h * vb.stride(0) + d]);
        }
  }
  at::Tensor scores = at::empty({B, H, n}, q.options().dtype(c10::CppTypeToScalarType<A>()));
  Job<T> J{k.data_ptr<T>(), r.data_ptr<T>(), v.data_ptr<T>(), qu.data(), qv.data(), nullptr,
           scores.data_ptr<A>(), strides_of(k), strides_of(v), r.stride(0), r.stride(1), H, D,
           n, lo, Lk, static_cast<A>(scale)};
  // pass 1: scores [B, H, n] in A
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, H * D));
  at::parallel_for(0, B * n, grain, [&](int64_t i0, int64_t i1) { scores_rows_any(J, i0, i1); });
  // pass 2: the softmax over keys (ATen's vectorised kernel), rounded to T as the torch path
  const at::Tensor prob = at::_softmax(scores, -1, false).to(q.scalar_type());
  J.P = prob.data_ptr<T>();
  // pass 3: out[b, h] = sum_j P[b, h, j] v[j, b, h]
  T* O = out.data_ptr<T>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<A> acc(H * D);
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(acc.begin(), acc.end(), A(0));
      weighted_rows_any(J, b, acc.data());
      for (const auto i : c10::irange(H * D)) O[b * H * D + i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& r, const at::Tensor& u, const at::Tensor& vb,
                            double scale, int64_t lo) {
  const char* who = "decode_attention";
  TORCH_CHECK(q.dim() == 3, who, ": q must be [B, H, D], got ", q.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(k.dim() == 4 && k.size(1) == B && k.size(2) == H && k.size(3) == D, who,
              ": k must be [Lk, ", B, ", ", H, ", ", D, "], got ", k.sizes());
  const int64_t Lk = k.size(0);
  TORCH_CHECK(v.sizes() == k.sizes(), who, ": v must be ", k.sizes(), ", got ", v.sizes());
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
    decode_cpu<scalar_t>(q, k, v, r, u, vb, scale, lo, out);
  });
  return out;
}

}  // namespace txl_kernels
