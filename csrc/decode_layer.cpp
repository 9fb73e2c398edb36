// One decoder layer for one new token, on CPUs (see decode_layer.h).
#include "decode_layer.h"

#include "decode_attention.h"

#include <torch/library.h>

#include <initializer_list>
#include <utility>

namespace txl_kernels {

namespace {

void check_2d(const char* who, const char* name, const at::Tensor& t, int64_t rows,
              int64_t cols, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, who, ": ", name,
              " must be [", rows, ", ", cols, "], got ", t.sizes());
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, who, ": ", name,
              " must be a CPU ", dtype, " tensor, got ", t.scalar_type(), " on ", t.device());
}

void check_1d(const char* who, const char* name, const at::Tensor& t, int64_t n,
              at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, who, ": ", name, " must be [", n, "], got ",
              t.sizes());
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, who, ": ", name,
              " must be a CPU ", dtype, " tensor, got ", t.scalar_type(), " on ", t.device());
}

}  // namespace

at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& qkv_w, const at::Tensor& o_w,
                        const at::Tensor& ln1_w, const at::Tensor& ln1_b, double eps1,
                        const at::Tensor& ff1_w, const at::Tensor& ff1_b,
                        const at::Tensor& ff2_w, const at::Tensor& ff2_b,
                        const at::Tensor& ln2_w, const at::Tensor& ln2_b, double eps2,
                        bool pre_lnorm, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& r, const at::Tensor& u, const at::Tensor& vb,
                        double softmax_scale, int64_t lo, const std::optional<at::Tensor>& k_mem,
                        const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_mem,
                        const std::optional<at::Tensor>& v_scale) {
  const char* who = "decode_layer";
  TORCH_CHECK(x.dim() == 2, who, ": x must be [B, d_model], got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && (dtype == at::kFloat || dtype == at::kDouble), who,
              ": x must be a float32 or float64 CPU tensor, got ", dtype, " on ", x.device());
  TORCH_CHECK(r.dim() == 3, who, ": r must be [Lk, H, D], got ", r.sizes());
  const int64_t B = x.size(0), dm = x.size(1), H = r.size(1), D = r.size(2), W = H * D;
  const int64_t di = ff1_w.dim() == 2 ? ff1_w.size(0) : -1;
  check_2d(who, "qkv_w", qkv_w, 3 * W, dm, dtype);
  check_2d(who, "o_w", o_w, dm, W, dtype);
  check_2d(who, "ff1_w", ff1_w, di, dm, dtype);
  check_2d(who, "ff2_w", ff2_w, dm, di, dtype);
  check_1d(who, "ff1_b", ff1_b, di, dtype);
  for (const auto& named : {std::make_pair("ff2_b", &ff2_b), std::make_pair("ln1_w", &ln1_w),
                            std::make_pair("ln1_b", &ln1_b), std::make_pair("ln2_w", &ln2_w),
                            std::make_pair("ln2_b", &ln2_b)})
    check_1d(who, named.first, *named.second, dm, dtype);
  for (const auto& named : {std::make_pair("keys", &keys), std::make_pair("values", &values)}) {
    const at::Tensor& t = *named.second;
    TORCH_CHECK(t.dim() == 3 && t.size(0) >= 1 && t.size(1) == B && t.size(2) == W, who, ": ",
                named.first, " must be [Lc >= 1, ", B, ", ", W, "], got ", t.sizes());
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.stride(2) == 1, who,
                ": ", named.first, " must be a CPU ", dtype,
                " tensor with a contiguous last dimension, got ", t.scalar_type(), " on ",
                t.device(), " strides ", t.strides());
  }
  TORCH_CHECK(values.size(0) == keys.size(0), who, ": values must have keys' ", keys.size(0),
              " rows, got ", values.size(0));
  const int64_t Lc = keys.size(0);

  const at::Tensor inp = pre_lnorm ? at::layer_norm(x, {dm}, ln1_w, ln1_b, eps1) : x;
  const at::Tensor heads = at::linear(inp, qkv_w);  // [B, 3W]: q | k | v
  keys.select(0, Lc - 1).copy_(heads.narrow(1, W, W));
  values.select(0, Lc - 1).copy_(heads.narrow(1, 2 * W, W));
  const at::Tensor q = heads.narrow(1, 0, W).view({B, H, D});
  const at::Tensor k4 = keys.unflatten(2, {H, D}), v4 = values.unflatten(2, {H, D});
  const at::Tensor attn = decode_attention(q, k4, v4, r, u, vb, softmax_scale, lo, k_mem, k_scale,
                                           v_mem, v_scale);
  const at::Tensor attn_out = at::linear(attn.view({B, W}), o_w);
  const at::Tensor out =
      pre_lnorm ? x + attn_out : at::layer_norm(x + attn_out, {dm}, ln1_w, ln1_b, eps1);
  const at::Tensor core_in = pre_lnorm ? at::layer_norm(out, {dm}, ln2_w, ln2_b, eps2) : out;
  at::Tensor hidden = at::linear(core_in, ff1_w, ff1_b);
  hidden.relu_();
  const at::Tensor core = at::linear(hidden, ff2_w, ff2_b);
  return pre_lnorm ? core + out : at::layer_norm(out + core, {dm}, ln2_w, ln2_b, eps2);
}

}  // namespace txl_kernels

// keys / values are written (their last row): declared mutable.
TORCH_LIBRARY_FRAGMENT(txl_kernels, m) {
  m.set_python_module("txl_kernels._cpp_ops");
  m.def("decode_layer(Tensor x, Tensor qkv_w, Tensor o_w, Tensor ln1_w, Tensor ln1_b, "
        "float eps1, Tensor ff1_w, Tensor ff1_b, Tensor ff2_w, Tensor ff2_b, Tensor ln2_w, "
        "Tensor ln2_b, float eps2, bool pre_lnorm, Tensor(a!) keys, Tensor(b!) values, "
        "Tensor r, Tensor u, Tensor vb, float softmax_scale, int lo, Tensor? k_mem=None, "
        "Tensor? k_scale=None, Tensor? v_mem=None, Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(txl_kernels, CPU, m) {
  m.impl("decode_layer", &txl_kernels::decode_layer);
}
