// Segment-memory update for Transformer-XL: checks, the CPU implementation, the CUDA dispatch,
// their torch.library registration (torch.ops.txl_kernels.*) and the extension's Python module.
// Built just-in-time by txl_kernels/_build.py; the CUDA part (segment_memory_cuda.cu) is
// compiled in, with -DTXL_WITH_CUDA, only where a CUDA toolkit is found.
//
//   update_mems(hids, mems, mem_len, ext_len) -> list of new memories
//   kv_cache_compact(bufs, src, n): rows [src, src + n) -> [0, n) of every buffer, in place
//   kv_cache_quantize_append(srcs, data_bufs, scale_bufs, dst_row, n_head): the 8-bit cache's
//       append: every source's rows quantised per (token, head) into its 8-bit buffers
//
// The LM's CPU decoding ops (decode_attention.cpp, decode_layer.cpp) register themselves in
// the same `txl_kernels` namespace; their fake (meta) implementations, like these ops', are in
// txl_kernels/_cpp_ops.py.
//
// hids: L tensors [qlen, bsz, d]; mems: empty (no memory) or L tensors, each [mlen, bsz, d] or
// the legacy 1-D empty placeholder torch.empty(0) (no memory for that layer). Per layer:
//   end = mlen + max(0, qlen - ext_len), beg = max(0, end - mem_len),
//   new_mem = cat([mem, hid], 0)[beg:end] as a fresh contiguous tensor (never aliasing inputs).
// Any strides are accepted. The Python wrapper (txl_kernels/memory.py) validates arguments with
// messages naming them; the checks here guard direct callers.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "segment_memory.h"

namespace txl_kernels {
namespace {

bool is_placeholder(const at::Tensor& m) { return m.dim() == 1 && m.numel() == 0; }

template <typename scalar_t>
void copy_layer_cpu(const LayerDesc& L) {
  const int64_t rows = L.n * L.bsz;
  if (rows == 0 || L.d == 0) return;
  auto* out = reinterpret_cast<scalar_t*>(L.out_ptr);
  const int64_t grain = std::max<int64_t>(1, 32768 / L.d);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int64_t sd;
      const scalar_t* src = row_source<scalar_t>(L, r, &sd);
      scalar_t* dst = out + r * L.d;
      if (sd == 1) {
        std::memcpy(dst, src, static_cast<size_t>(L.d) * sizeof(scalar_t));
      } else {
        for (int64_t c = 0; c < L.d; ++c) dst[c] = src[c * sd];
      }
    }
  });
}

#ifdef TXL_WITH_CUDA
// The jobs as an int64 [num, fields] table on device (through pinned memory, asynchronously).
template <typename Desc>
at::Tensor device_table(const std::vector<Desc>& descs, const at::Device& device) {
  const int64_t num = static_cast<int64_t>(descs.size());
  const int64_t fields = static_cast<int64_t>(sizeof(Desc) / sizeof(int64_t));
  at::Tensor host =
      at::empty({num, fields}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(host.data_ptr<int64_t>(), descs.data(), descs.size() * sizeof(Desc));
  return host.to(device, /*non_blocking=*/true);
}

bool aligned16(int64_t ptr) { return ptr % 16 == 0; }

// Whether every row of every layer can be copied as aligned 16-byte vectors.
bool rows_vectorizable(const std::vector<LayerDesc>& descs, int64_t elem) {
  for (const auto& L : descs) {
    if (L.n * L.bsz == 0) continue;
    if ((L.d * elem) % 16 != 0 || !aligned16(L.out_ptr)) return false;
    if (L.hid_s2 != 1 || !aligned16(L.hid_ptr) || (L.hid_s0 * elem) % 16 != 0 ||
        (L.hid_s1 * elem) % 16 != 0)
      return false;
    if (L.mlen > 0 && (L.mem_s2 != 1 || !aligned16(L.mem_ptr) || (L.mem_s0 * elem) % 16 != 0 ||
                       (L.mem_s1 * elem) % 16 != 0))
      return false;
  }
  return true;
}
#endif

// Runs the copy jobs of descs: on CPU one parallel copy per job, on CUDA ONE kernel launch for
// all of them (the update_mems kernel).
void run_copies(std::vector<LayerDesc>& descs, at::ScalarType dtype, const at::Device& device,
                int64_t max_rows, int64_t max_d, const char* what) {
  if (device.is_cpu()) {
    AT_DISPATCH_FLOATING_TYPES_AND3(at::kHalf, at::kBFloat16, at::kByte, dtype, "txl_copy_cpu",
                                    [&] {
      for (const auto& L : descs) copy_layer_cpu<scalar_t>(L);
    });
    return;
  }
#ifdef TXL_WITH_CUDA
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 ||
                  dtype == at::kDouble || dtype == at::kByte,
              what, ": unsupported dtype ", dtype);
  if (max_rows == 0 || max_d == 0) return;
  c10::DeviceGuard guard(device);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  const bool vec = rows_vectorizable(descs, elem);
  const int64_t max_vecs = vec ? max_d * elem / 16 : max_d;
  const int64_t num = static_cast<int64_t>(descs.size());
  at::Tensor table = device_table(descs, device);
  launch_update_mems_cuda(reinterpret_cast<const LayerDesc*>(table.data_ptr<int64_t>()), num,
                          max_rows, max_vecs, vec ? 16 : 0, static_cast<int>(dtype),
                          static_cast<int>(device.index()));
#else
  TORCH_CHECK(false, what, ": this build of the txl_kernels extension has no CUDA kernel "
              "(compiled without a CUDA toolkit); got tensors on ", device);
#endif
}

}  // namespace

std::vector<at::Tensor> update_mems(at::TensorList hids, at::TensorList mems, int64_t mem_len,
                                    int64_t ext_len) {
  TORCH_CHECK(mem_len >= 0, "update_mems: mem_len must be >= 0, got ", mem_len);
  TORCH_CHECK(ext_len >= 0, "update_mems: ext_len must be >= 0, got ", ext_len);
  const int64_t num_layers = static_cast<int64_t>(hids.size());
  TORCH_CHECK(mems.empty() || mems.size() == hids.size(),
              "update_mems: mems must be empty or have one tensor per layer (", num_layers,
              "), got ", mems.size());
  if (num_layers == 0) return {};

  const auto dtype = hids[0].scalar_type();
  const auto device = hids[0].device();
  TORCH_CHECK(device.is_cpu() || device.is_cuda(),
              "update_mems: tensors must be on CPU or CUDA, got ", device);

  std::vector<LayerDesc> descs(num_layers);
  std::vector<at::Tensor> outs;
  outs.reserve(num_layers);
  int64_t max_rows = 0, max_d = 0;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor& h = hids[l];
    TORCH_CHECK(h.dim() == 3, "update_mems: hids[", l, "] must be [qlen, bsz, d], got ",
                h.sizes());
    TORCH_CHECK(h.scalar_type() == dtype, "update_mems: hids[", l, "] has dtype ",
                h.scalar_type(), ", hids[0] has ", dtype);
    TORCH_CHECK(h.device() == device, "update_mems: hids[", l, "] is on ", h.device(),
                ", hids[0] is on ", device);
    const int64_t qlen = h.size(0), bsz = h.size(1), d = h.size(2);
    LayerDesc& L = descs[l];
    L = LayerDesc{};
    L.hid_ptr = reinterpret_cast<int64_t>(h.data_ptr());
    L.hid_s0 = h.stride(0);
    L.hid_s1 = h.stride(1);
    L.hid_s2 = h.stride(2);
    int64_t mlen = 0;
    if (!mems.empty() && !is_placeholder(mems[l])) {
      const at::Tensor& m = mems[l];
      TORCH_CHECK(m.dim() == 3 && m.size(1) == bsz && m.size(2) == d, "update_mems: mems[", l,
                  "] must be [mlen, ", bsz, ", ", d, "] to match hids[", l, "], got ", m.sizes());
      TORCH_CHECK(m.scalar_type() == dtype, "update_mems: mems[", l, "] has dtype ",
                  m.scalar_type(), ", hids has ", dtype);
      TORCH_CHECK(m.device() == device, "update_mems: mems[", l, "] is on ", m.device(),
                  ", hids is on ", device);
      mlen = m.size(0);
      if (mlen > 0) {
        L.mem_ptr = reinterpret_cast<int64_t>(m.data_ptr());
        L.mem_s0 = m.stride(0);
        L.mem_s1 = m.stride(1);
        L.mem_s2 = m.stride(2);
      }
    }
    const int64_t end = mlen + std::max<int64_t>(0, qlen - ext_len);
    const int64_t beg = std::max<int64_t>(0, end - mem_len);
    L.mlen = mlen;
    L.beg = beg;
    L.n = end - beg;
    L.bsz = bsz;
    L.d = d;
    outs.push_back(at::empty({L.n, bsz, d}, h.options()));
    L.out_ptr = reinterpret_cast<int64_t>(outs.back().data_ptr());
    max_rows = std::max(max_rows, L.n * bsz);
    max_d = std::max(max_d, d);
  }

  run_copies(descs, dtype, device, max_rows, max_d, "update_mems");
  return outs;
}

// K/V-cache compaction for the Transformer-XL LM's cache: in every buffer (contiguous
// [cap, ...]), rows [src, src + n) move to rows [0, n). The two ranges must not overlap
// (src >= n, or n == 0). A pure copy, done on bytes, so the buffers may differ in dtype (an
// 8-bit cache moves its int8 / fp8 data and its scales together): ONE copy job per buffer,
// one launch on CUDA for all of them.
void kv_cache_compact(at::TensorList bufs, int64_t src, int64_t n) {
  TORCH_CHECK(src >= 0 && n >= 0, "kv_cache_compact: src and n must be >= 0, got src=", src,
              ", n=", n);
  TORCH_CHECK(n == 0 || src >= n, "kv_cache_compact: rows [", src, ", ", src + n,
              ") overlap their destination [0, ", n, ")");
  if (bufs.empty() || n == 0 || src == 0) return;
  const auto device = bufs[0].device();
  TORCH_CHECK(device.is_cpu() || device.is_cuda(),
              "kv_cache_compact: buffers must be on CPU or CUDA, got ", device);
  std::vector<LayerDesc> descs(bufs.size());
  int64_t max_rows = 0, max_d = 0;
  for (size_t l = 0; l < bufs.size(); ++l) {
    const at::Tensor& b = bufs[l];
    TORCH_CHECK(b.dim() >= 2 && b.is_contiguous(), "kv_cache_compact: bufs[", l,
                "] must be a contiguous [cap, ...] tensor, got ", b.sizes());
    TORCH_CHECK(b.device() == device, "kv_cache_compact: bufs[", l, "] is on ", b.device(),
                ", bufs[0] is on ", device);
    TORCH_CHECK(src + n <= b.size(0), "kv_cache_compact: rows [", src, ", ", src + n,
                ") exceed bufs[", l, "] with ", b.size(0), " rows");
    // one row = the bytes of one cache row (every batch entry): n rows of row_bytes bytes
    const int64_t row_bytes = b.stride(0) * static_cast<int64_t>(b.element_size());
    LayerDesc& L = descs[l];
    L = LayerDesc{};
    L.hid_ptr = reinterpret_cast<int64_t>(b.data_ptr()) + src * row_bytes;
    L.hid_s0 = row_bytes;
    L.hid_s1 = row_bytes;
    L.hid_s2 = 1;
    L.out_ptr = reinterpret_cast<int64_t>(b.data_ptr());
    L.mlen = 0;
    L.beg = 0;
    L.n = n;
    L.bsz = 1;
    L.d = row_bytes;
    max_rows = std::max(max_rows, L.n);
    max_d = std::max(max_d, L.d);
  }
  run_copies(descs, at::kByte, device, max_rows, max_d, "kv_cache_compact");
}

namespace {

template <typename scalar_t, typename quant_t, typename scale_t>
void quantize_append_cpu(const QuantDesc& Q) {
  const int64_t rows = Q.n * Q.bsz;
  if (rows == 0 || Q.heads == 0 || Q.d == 0) return;
  const int64_t width = Q.heads * Q.d;
  auto* data = reinterpret_cast<quant_t*>(Q.data_ptr) + Q.dst_row * Q.bsz * width;
  auto* scales = reinterpret_cast<scale_t*>(Q.scale_ptr) + Q.dst_row * Q.bsz * Q.heads;
  const int64_t grain = std::max<int64_t>(1, 16384 / width);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r / Q.bsz, b = r - t * Q.bsz;
      const auto* src = reinterpret_cast<const scalar_t*>(Q.src_ptr) + t * Q.src_s0 +
                        b * Q.src_s1;
      for (int64_t h = 0; h < Q.heads; ++h) {
        const scalar_t* x = src + h * Q.d * Q.src_s2;
        float absmax = 0.0f;
        for (int64_t c = 0; c < Q.d; ++c) {
          absmax = nan_max(std::fabs(static_cast<float>(x[c * Q.src_s2])), absmax);
        }
        float s;
        scales[r * Q.heads + h] = head_scale<quant_t, scale_t>(absmax, &s);
        quant_t* out = data + r * width + h * Q.d;
        for (int64_t c = 0; c < Q.d; ++c)
          out[c] = quantize_value<quant_t>(static_cast<float>(x[c * Q.src_s2]), s);
      }
    }
  });
}

}  // namespace

// The 8-bit K/V cache's append: srcs[i] ([n, bsz, n_head * d], any strides, one floating
// dtype) quantised per (row, batch, head) into rows [dst_row, dst_row + n) of data_bufs[i]
// (contiguous [cap, bsz, n_head * d], int8 or float8_e4m3fn) and scale_bufs[i] (contiguous
// [cap, bsz, n_head], float32 or float16). One job per buffer; ONE launch for all on CUDA.
void kv_cache_quantize_append(at::TensorList srcs, at::TensorList data_bufs,
                              at::TensorList scale_bufs, int64_t dst_row, int64_t n_head) {
  const char* who = "kv_cache_quantize_append";
  TORCH_CHECK(srcs.size() == data_bufs.size() && srcs.size() == scale_bufs.size(), who,
              ": srcs, data_bufs and scale_bufs must have one length, got ", srcs.size(), ", ",
              data_bufs.size(), ", ", scale_bufs.size());
  TORCH_CHECK(n_head >= 1 && dst_row >= 0, who, ": need n_head >= 1 and dst_row >= 0, got ",
              n_head, ", ", dst_row);
  if (srcs.empty()) return;
  const auto src_dtype = srcs[0].scalar_type();
  const auto quant = data_bufs[0].scalar_type();
  const auto scale = scale_bufs[0].scalar_type();
  const auto device = srcs[0].device();
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), who, ": tensors must be on CPU or CUDA, got ",
              device);
  TORCH_CHECK(quant == at::kChar || quant == at::kFloat8_e4m3fn, who,
              ": data buffers must be int8 or float8_e4m3fn, got ", quant);
  TORCH_CHECK(scale == at::kFloat || scale == at::kHalf, who,
              ": scale buffers must be float32 or float16, got ", scale);
  std::vector<QuantDesc> descs(srcs.size());
  int64_t max_heads = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor &x = srcs[i], &q = data_bufs[i], &sc = scale_bufs[i];
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == src_dtype && x.device() == device, who,
                ": srcs[", i, "] must be [n, bsz, width] ", src_dtype, " on ", device, ", got ",
                x.sizes(), " ", x.scalar_type(), " on ", x.device());
    const int64_t n = x.size(0), bsz = x.size(1), width = x.size(2);
    TORCH_CHECK(width % n_head == 0, who, ": srcs[", i, "] width ", width,
                " is not a multiple of n_head ", n_head);
    TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(1) == bsz && q.size(2) == width &&
                    q.scalar_type() == quant && q.device() == device,
                who, ": data_bufs[", i, "] must be a contiguous [cap, ", bsz, ", ", width, "] ",
                quant, " tensor on ", device, ", got ", q.sizes(), " ", q.scalar_type());
    TORCH_CHECK(sc.dim() == 3 && sc.is_contiguous() && sc.size(0) == q.size(0) &&
                    sc.size(1) == bsz && sc.size(2) == n_head && sc.scalar_type() == scale &&
                    sc.device() == device,
                who, ": scale_bufs[", i, "] must be a contiguous [", q.size(0), ", ", bsz, ", ",
                n_head, "] ", scale, " tensor on ", device, ", got ", sc.sizes(), " ",
                sc.scalar_type());
    TORCH_CHECK(dst_row + n <= q.size(0), who, ": rows [", dst_row, ", ", dst_row + n,
                ") exceed data_bufs[", i, "] with ", q.size(0), " rows");
    QuantDesc& Q = descs[i];
    Q = QuantDesc{};
    Q.src_ptr = reinterpret_cast<int64_t>(x.data_ptr());
    Q.data_ptr = reinterpret_cast<int64_t>(q.data_ptr());
    Q.scale_ptr = reinterpret_cast<int64_t>(sc.data_ptr());
    Q.n = n;
    Q.bsz = bsz;
    Q.heads = n_head;
    Q.d = width / n_head;
    Q.dst_row = dst_row;
    Q.src_s0 = x.stride(0);
    Q.src_s1 = x.stride(1);
    Q.src_s2 = x.stride(2);
    max_heads = std::max(max_heads, n * bsz * (Q.d > 0 ? n_head : 0));
  }
  if (device.is_cpu()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src_dtype, "txl_quant_cpu", [&] {
      dispatch_quant(static_cast<int>(quant), static_cast<int>(scale), [&](auto q0, auto s0) {
        for (const auto& Q : descs)
          quantize_append_cpu<scalar_t, decltype(q0), decltype(s0)>(Q);
      });
    });
    return;
  }
#ifdef TXL_WITH_CUDA
  if (max_heads == 0) return;
  c10::DeviceGuard guard(device);
  at::Tensor table = device_table(descs, device);
  launch_quantize_append_cuda(reinterpret_cast<const QuantDesc*>(table.data_ptr<int64_t>()),
                              static_cast<int64_t>(descs.size()), max_heads,
                              static_cast<int>(src_dtype), static_cast<int>(quant),
                              static_cast<int>(scale), static_cast<int>(device.index()));
#else
  TORCH_CHECK(false, who, ": this build of the txl_kernels extension has no CUDA kernel "
              "(compiled without a CUDA toolkit); got tensors on ", device);
#endif
}

}  // namespace txl_kernels

// Schemas: the buffers the cache ops write are declared mutable (Tensor(a!)[]), so
// functionalization and torch.compile keep their writes.
TORCH_LIBRARY_FRAGMENT(txl_kernels, m) {
  m.set_python_module("txl_kernels._cpp_ops");
  m.def("update_mems(Tensor[] hids, Tensor[] mems, int mem_len, int ext_len=0) -> Tensor[]");
  m.def("kv_cache_compact(Tensor(a!)[] bufs, int src, int n) -> ()");
  m.def("kv_cache_quantize_append(Tensor[] srcs, Tensor(a!)[] data_bufs, "
        "Tensor(b!)[] scale_bufs, int dst_row, int n_head) -> ()");
}

// One implementation per op: it dispatches on the tensors' device itself (CPU loop or the one
// CUDA launch), so the same function serves both keys.
TORCH_LIBRARY_IMPL(txl_kernels, CPU, m) {
  m.impl("update_mems", &txl_kernels::update_mems);
  m.impl("kv_cache_compact", &txl_kernels::kv_cache_compact);
  m.impl("kv_cache_quantize_append", &txl_kernels::kv_cache_quantize_append);
}

#ifdef TXL_WITH_CUDA
TORCH_LIBRARY_IMPL(txl_kernels, CUDA, m) {
  m.impl("update_mems", &txl_kernels::update_mems);
  m.impl("kv_cache_compact", &txl_kernels::kv_cache_compact);
  m.impl("kv_cache_quantize_append", &txl_kernels::kv_cache_quantize_append);
}
#endif

// The Python module that txl_kernels._build imports: importing it registers the ops above;
// it only says whether the CUDA kernels are compiled in.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "txl_kernels C++/CUDA extension: its ops are torch.ops.txl_kernels.*";
#ifdef TXL_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
