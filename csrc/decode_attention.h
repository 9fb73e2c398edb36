// Transformer-XL relative attention of ONE query row per (batch, head) against every cached
// key (the LM's decoding step on CPUs; on GPUs the Triton split-K decode kernel does this).
//
// For batch b, head h, with qu = q + u and qv = q + vb rounded to the input dtype:
//     s_j = softmax_scale * (qu . k[j] + qv . r[j])       for keys j in [lo, Lk)
//     out = sum_j softmax(s)_j v[j]
// Key j uses position row j (at qlen 1 the relative shift vanishes) and no mask applies (a
// left window only moves lo). Accumulation in fp32 (fp64 for double inputs). With an 8-bit
// memory the keys / values are its M rows (dequantised in registers: the fp32 product of
// value and per-(token, head) scale, rounded to the input dtype) followed by k / v's.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace txl_kernels {

// q [B, H, D]; k / v [Lc, B, H, D] (the K/V cache's seq-first rows); r [Lk, H, D] with
// Lk = M + Lc; u / vb [H, D]; any strides with stride(-1) == 1; float32 or float64 CPU tensors
// of one dtype. Optional 8-bit memory (all four or none): k_mem / v_mem [M, B, H, D] int8 or
// float8_e4m3fn, k_scale / v_scale [M, B, H] float32 or float16. Returns out [B, H, D]
// (contiguous, q's dtype).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& r, const at::Tensor& u, const at::Tensor& vb,
                            double softmax_scale, int64_t lo,
                            const std::optional<at::Tensor>& k_mem = std::nullopt,
                            const std::optional<at::Tensor>& k_scale = std::nullopt,
                            const std::optional<at::Tensor>& v_mem = std::nullopt,
                            const std::optional<at::Tensor>& v_scale = std::nullopt);

}  // namespace txl_kernels
