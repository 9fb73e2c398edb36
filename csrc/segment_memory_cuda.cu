// CUDA part of the segment-memory update: ONE kernel launch copies every layer.
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

int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

}  // namespace

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
  AT_DISPATCH_FLOATING_TYPES_AND2(c10::ScalarType::Half, c10::ScalarType::BFloat16, st,
                                  "update_mems_cuda", [&] {
    if (vec_bytes == 16) {
      update_mems_kernel<scalar_t, uint4><<<grid, block, 0, stream>>>(desc_device);
    } else {
      update_mems_kernel<scalar_t, scalar_t><<<grid, block, 0, stream>>>(desc_device);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace txl_kernels
