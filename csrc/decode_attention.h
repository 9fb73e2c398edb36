// Transformer-XL relative attention of ONE query row per (batch, head) against every cached
// key (the LM's decoding step on CPUs; on GPUs the Triton split-K decode kernel does this).
//
// For batch b, head h, with qu = q + u and qv = q + vb rounded to the input dtype:
//     s_j = scale * (qu . k[j] + qv . r[j])       for keys j in [lo, Lk)
//     out = sum_j softmax(s)_j v[j]
// Key j uses position row j (at qlen 1 the relative shift vanishes) and no mask applies (a
// left window only moves lo). Accumulation in fp32 (fp64 for double inputs).
#pragma once

#include <ATen/ATen.h>

namespace txl_kernels {

// q [B, H, D]; k / v [Lk, B, H, D] (the K/V cache's seq-first rows); r [Lk, H, D]; u / vb
// [H, D]; any strides with stride(-1) == 1; float32 or float64 CPU tensors of one dtype.
// Returns out [B, H, D] (contiguous, q's dtype).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& r, const at::Tensor& u, const at::Tensor& vb,
                            double scale, int64_t lo);

}  // namespace txl_kernels
