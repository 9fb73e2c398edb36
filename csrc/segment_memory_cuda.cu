// CUDA part of the segment-memory update: ONE kernel launch copies every layer; ONE kernel
// launch quantises every buffer's new rows for the 8-bit K/V cache.
//
// Grid: blockIdx.y = layer, blockIdx.x (grid-stride) = rows (t, b) of that layer's output.
// Block: threadIdx.x walks along d (as 16-byte vectors when the host says every row allows it,
// else as single elements with an arbitrary stride), threadIdx.y picks the row.
// Only c10 CUDA headers are used (c10/cuda/CUDAStream.h, CUDAGuard.h): ATen/cuda/CUDAContext.h
// would pull in cuSPARSE/cuBLAS headers that a bare nvcc toolkit does not have.
#include <cstdint>

#include <ATen/Dispatch.h>
#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include "segment_memory.h"

namespace txl_kernels {
namespace {

// vec_t is either scalar_t itself (element copies, any strides) or a 16-byte vector type
// (the host has checked contiguous rows and 16-byte alignment of every pointer and row start).
template <typename scalar_t, typename vec_t>
__global__ void update_mems_kernel(const LayerDesc* __restrict__ descs) {
  constexpr int64_t kVec = static_cast<int64_t>(sizeof(vec_t) / sizeof(scalar_t));
  static_assert(sizeof(vec_t) % sizeof(scalar_t) == 0, "vector must hold whole elements");
  const LayerDesc L = descs[blockIdx.y];
  const int64_t rows = L.n * L.bsz;
  const int64_t width = L.d / kVec;  // vectors (or elements) per row
  auto* out = reinterpret_cast<scalar_t*>(L.out_ptr);
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; r < rows;
       r += row_step) {
    int64_t sd;
    const scalar_t* src = row_source<scalar_t>(L, r, &sd);
    scalar_t* dst = out + r * L.d;
    if constexpr (kVec > 1) {
      const auto* vsrc = reinterpret_cast<const vec_t*>(src);
      auto* vdst = reinterpret_cast<vec_t*>(dst);
      for (int64_t c = threadIdx.x; c < width; c += blockDim.x) vdst[c] = vsrc[c];
    } else {
      for (int64_t c = threadIdx.x; c < width; c += blockDim.x) dst[c] = src[c * sd];
    }
  }
}

// One warp per (row, batch, head): the lanes stride along d, reduce |x| to the head's absmax
// with shuffles, lane 0 stores the scale, every lane its quantised values. Grid: blockIdx.y =
// job (buffer), blockIdx.x (grid-stride) = groups of warps over that job's heads.
template <typename scalar_t, typename quant_t, typename scale_t>
__global__ void quantize_append_kernel(const QuantDesc* __restrict__ descs) {
  const QuantDesc Q = descs[blockIdx.y];
  const int64_t heads_total = Q.n * Q.bsz * Q.heads;
  const int lane = threadIdx.x & 31;
  const int64_t warps = blockDim.x / 32;
  const int64_t step = static_cast<int64_t>(gridDim.x) * warps;
  const int64_t width = Q.heads * Q.d;
  auto* data = reinterpret_cast<quant_t*>(Q.data_ptr) + Q.dst_row * Q.bsz * width;
  auto* scales = reinterpret_cast<scale_t*>(Q.scale_ptr) + Q.dst_row * Q.bsz * Q.heads;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32; g < heads_total;
       g += step) {
    const int64_t r = g / Q.heads, h = g - r * Q.heads;  // r = (t, b) row of the source
    const int64_t t = r / Q.bsz, b = r - t * Q.bsz;
    const scalar_t* x = reinterpret_cast<const scalar_t*>(Q.src_ptr) + t * Q.src_s0 +
                        b * Q.src_s1 + h * Q.d * Q.src_s2;
    float absmax = 0.0f;
    for (int64_t c = lane; c < Q.d; c += 32)
      absmax = nan_max(fabsf(static_cast<float>(x[c * Q.src_s2])), absmax);
    for (int off = 16; off > 0; off >>= 1)
      absmax = nan_max(__shfl_xor_sync(0xffffffffu, absmax, off), absmax);
    float s;
    const scale_t stored = head_scale<quant_t, scale_t>(absmax, &s);
    if (lane == 0) scales[g] = stored;
    quant_t* out = data + r * width + h * Q.d;
    for (int64_t c = lane; c < Q.d; c += 32)
      out[c] = quantize_value<quant_t>(static_cast<float>(x[c * Q.src_s2]), s);
  }
}

int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

}  // namespace

void launch_quantize_append_cuda(const QuantDesc* desc_device, int64_t num, int64_t max_heads,
                                 int src_dtype, int quant_dtype, int scale_dtype,
                                 int device_index) {
  TORCH_CHECK(num >= 1 && num <= 65535,
              "kv_cache_quantize_append (CUDA): number of buffers must be in [1, 65535], got ",
              num);
  if (max_heads <= 0) return;
  constexpr int64_t kThreads = 256, kWarps = kThreads / 32;
  const int64_t gx = std::min<int64_t>((max_heads + kWarps - 1) / kWarps, 65535);
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(num));
  const auto index = static_cast<c10::DeviceIndex>(device_index);
  c10::cuda::CUDAGuard guard(index);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(index);
  AT_DISPATCH_FLOATING_TYPES_AND2(c10::ScalarType::Half, c10::ScalarType::BFloat16,
                                  static_cast<c10::ScalarType>(src_dtype),
                                  "kv_cache_quantize_append_cuda", [&] {
    dispatch_quant(quant_dtype, scale_dtype, [&](auto q0, auto s0) {
      quantize_append_kernel<scalar_t, decltype(q0), decltype(s0)>
          <<<grid, kThreads, 0, stream>>>(desc_device);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void launch_update_mems_cuda(const LayerDesc* desc_device, int64_t num_layers, int64_t max_rows,
                             int64_t max_vecs, int vec_bytes, int dtype, int device_index) {
  TORCH_CHECK(num_layers >= 1 && num_layers <= 65535,
              "update_mems (CUDA): number of layers must be in [1, 65535], got ", num_layers);
  TORCH_CHECK(vec_bytes == 0 || vec_bytes == 16, "update_mems (CUDA): vec_bytes must be 0 or 16");
  if (max_rows <= 0 || max_vecs <= 0) return;  // nothing to copy in any layer

  constexpr int64_t kThreads = 256;
  const int64_t bx = std::min<int64_t>(kThreads, std::max<int64_t>(32, next_pow2(max_vecs)));
  const int64_t by = kThreads / bx;
  const int64_t gx = std::min<int64_t>((max_rows + by - 1) / by, 65535);
  const dim3 block(static_cast<unsigned>(bx), static_cast<unsigned>(by));
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(num_layers));

  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index));
  const auto st = static_cast<c10::ScalarType>(dtype);
  AT_DISPATCH_FLOATING_TYPES_AND3(c10::ScalarType::Half, c10::ScalarType::BFloat16,
                                  c10::ScalarType::Byte, st, "update_mems_cuda", [&] {
    if (vec_bytes == 16) {
      update_mems_kernel<scalar_t, uint4><<<grid, block, 0, stream>>>(desc_device);
    } else {
      update_mems_kernel<scalar_t, scalar_t><<<grid, block, 0, stream>>>(desc_device);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace txl_kernels
