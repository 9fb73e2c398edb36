// One Transformer-XL decoder layer (RelPartialLearnableDecoderLayer, eval mode) for ONE new
// token per batch entry, on CPUs: the LM's decoding step as one call per layer instead of a
// dozen Python-dispatched ops. Same ATen ops, in the same order, as the Python layer
// (txl_kernels/models/mem_transformer.py: RelPartialLearnableDecoderLayer.forward_cached), so
// the result is the same bit for bit; the attention is decode_attention (decode_attention.h).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace txl_kernels {

// x [B, d_model]: the layer's input (the new token's hidden state per batch entry).
// qkv_w [3 * H * D, d_model] (no bias), o_w [d_model, H * D] (no bias); ln1 (the attention's
// LayerNorm) / ln2 (the feed-forward's) weight and bias [d_model] with their eps; ff1_w
// [d_inner, d_model], ff1_b [d_inner], ff2_w [d_model, d_inner], ff2_b [d_model]; pre_lnorm as
// the model. keys / values [Lc, B, H * D] (Lc >= 1, last dimension contiguous): the K/V cache's
// rows for this layer; their LAST row receives this token's key / value, the attention reads
// all Lc rows (after the optional 8-bit memory, as in decode_attention). r [M + Lc, H, D],
// u / vb [H, D], softmax_scale, lo as in decode_attention. All tensors float32 or float64 (one
// dtype) on the CPU, except the 8-bit memory. Returns the layer's output [B, d_model].
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& qkv_w, const at::Tensor& o_w,
                        const at::Tensor& ln1_w, const at::Tensor& ln1_b, double eps1,
                        const at::Tensor& ff1_w, const at::Tensor& ff1_b,
                        const at::Tensor& ff2_w, const at::Tensor& ff2_b,
                        const at::Tensor& ln2_w, const at::Tensor& ln2_b, double eps2,
                        bool pre_lnorm, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& r, const at::Tensor& u, const at::Tensor& vb,
                        double softmax_scale, int64_t lo,
                        const std::optional<at::Tensor>& k_mem = std::nullopt,
                        const std::optional<at::Tensor>& k_scale = std::nullopt,
                        const std::optional<at::Tensor>& v_mem = std::nullopt,
                        const std::optional<at::Tensor>& v_scale = std::nullopt);

}  // namespace txl_kernels
