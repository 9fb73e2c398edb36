// Transformer-XL segment-memory update: shared declarations of the C++ (CPU) and CUDA parts.
//
// For layer l with memory M_l [mlen, bsz, d] and hidden states H_l [qlen, bsz, d]:
//     end = mlen + max(0, qlen - ext_len),  beg = max(0, end - mem_len)
//     new_mem_l = cat([M_l, H_l], 0)[beg:end]          (a fresh contiguous tensor)
// Row t of new_mem_l is row s = beg + t of the concatenation: M_l[s] if s < mlen, else
// H_l[s - mlen]. Every kernel below is a pure copy, so results equal the formula bit for bit.
#pragma once

#include <cstdint>

namespace txl_kernels {

// One layer's copy job. All fields are 8 bytes, so a [num_layers, kDescFields] int64 tensor
// is bit-compatible with an array of LayerDesc (the CUDA kernel reads it that way).
struct LayerDesc {
  int64_t mem_ptr;  // const scalar_t* (0 when the layer has no memory)
  int64_t hid_ptr;  // const scalar_t*
  int64_t out_ptr;  // scalar_t*, contiguous [n, bsz, d]
  int64_t mlen;     // rows of memory
  int64_t beg;      // first row of cat([mem, hid]) that is kept
  int64_t n;        // rows kept (end - beg)
  int64_t bsz;
  int64_t d;
  int64_t mem_s0, mem_s1, mem_s2;  // element strides of the memory
  int64_t hid_s0, hid_s1, hid_s2;  // element strides of the hidden states
};

constexpr int kDescFields = static_cast<int>(sizeof(LayerDesc) / sizeof(int64_t));
static_assert(sizeof(LayerDesc) == 14 * sizeof(int64_t), "LayerDesc must be 14 int64 fields");

#ifdef __CUDACC__
#define TXL_HOST_DEVICE __host__ __device__
#else
#define TXL_HOST_DEVICE
#endif

// Source of output row r = (t, b) of one layer: row s = beg + t of cat([mem, hid], 0), i.e.
// mem[s, b] if s < mlen else hid[s - mlen, b]. Returns its first element and sets *stride to
// its element stride along d. Shared by the CPU loop and the CUDA kernel.
template <typename scalar_t>
TXL_HOST_DEVICE inline const scalar_t* row_source(const LayerDesc& L, int64_t r,
                                                  int64_t* stride) {
  const int64_t t = r / L.bsz;
  const int64_t b = r - t * L.bsz;
  const int64_t s = L.beg + t;
  if (s < L.mlen) {
    *stride = L.mem_s2;
    return reinterpret_cast<const scalar_t*>(L.mem_ptr) + s * L.mem_s0 + b * L.mem_s1;
  }
  *stride = L.hid_s2;
  return reinterpret_cast<const scalar_t*>(L.hid_ptr) + (s - L.mlen) * L.hid_s0 +
         b * L.hid_s1;
}

#ifdef TXL_WITH_CUDA
// Launch ONE kernel that performs every layer's copy. desc_device points to num_layers
// LayerDesc in device memory. dtype is a c10::ScalarType (as int, to keep this header free of
// torch includes). vec_bytes is 16 when every row of every layer may be copied as aligned
// 16-byte vectors (contiguous rows, 16-byte aligned pointers and strides), else 0 (element
// copies with arbitrary strides). max_rows / max_vecs: the largest n * bsz and row length (in
// vectors or elements) over the layers, used to size the grid.
void launch_update_mems_cuda(const LayerDesc* desc_device, int64_t num_layers, int64_t max_rows,
                             int64_t max_vecs, int vec_bytes, int dtype, int device_index);
#endif

}  // namespace txl_kernels
