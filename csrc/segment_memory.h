// Transformer-XL segment-memory update: shared declarations of the C++ (CPU) and CUDA parts.
//
// For layer l with memory M_l [mlen, bsz, d] and hidden states H_l [qlen, bsz, d]:
//     end = mlen + max(0, qlen - ext_len),  beg = max(0, end - mem_len)
//     new_mem_l = cat([M_l, H_l], 0)[beg:end]          (a fresh contiguous tensor)
// Row t of new_mem_l is row s = beg + t of the concatenation: M_l[s] if s < mlen, else
// H_l[s - mlen]. Every kernel below is a pure copy, so results equal the formula bit for bit.
//
// 8-bit K/V cache (kv_cache_quantize_append): per (token, head) absmax quantisation of new rows
// into int8 / float8_e4m3fn buffers with one fp32 / fp16 scale per (token, head), the values of
// txl_kernels.quant.quantize_per_token bit for bit (quantize_head below, shared by both parts).
#pragma once

#include <cstdint>
#include <cmath>
#include <type_traits>

#include <c10/core/ScalarType.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

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

// One buffer's quantise-and-append job: rows [0, n) of a source [n, bsz, heads * d] (element
// strides src_s0, src_s1, src_s2) go, quantised per (row, batch, head), to rows
// [dst_row, dst_row + n) of a contiguous data buffer [cap, bsz, heads * d] and a contiguous
// scale buffer [cap, bsz, heads]. All fields 8 bytes (a [num, kQuantDescFields] int64 table).
struct QuantDesc {
  int64_t src_ptr;    // const scalar_t*
  int64_t data_ptr;   // quant_t* (int8_t or c10::Float8_e4m3fn)
  int64_t scale_ptr;  // scale_t* (float or c10::Half)
  int64_t n;          // rows appended
  int64_t bsz;
  int64_t heads;
  int64_t d;          // head dim
  int64_t dst_row;
  int64_t src_s0, src_s1, src_s2;
};

constexpr int kQuantDescFields = static_cast<int>(sizeof(QuantDesc) / sizeof(int64_t));
static_assert(sizeof(QuantDesc) == 11 * sizeof(int64_t), "QuantDesc must be 11 int64 fields");

template <typename quant_t>
struct QuantMax;
template <>
struct QuantMax<int8_t> {
  static constexpr float value = 127.0f;
};
template <>
struct QuantMax<c10::Float8_e4m3fn> {
  static constexpr float value = 448.0f;
};

// max that propagates NaN (as torch.amax does).
TXL_HOST_DEVICE inline float nan_max(float a, float b) { return a > b || a != a ? a : b; }

// The scale of a head whose largest |value| (in fp32) is absmax: absmax / qmax as scale_t,
// returned as stored and (via *s) as the fp32 value the data is divided by. float16: a finite
// positive absmax / qmax is clamped into [2^-24, 65504] (the smallest positive and largest
// finite float16) and rounded up, so the scale neither underflows to 0 nor overflows to inf
// and no value exceeds qmax through the scale's rounding (txl_kernels.quant's _fp16_scale).
template <typename quant_t, typename scale_t>
TXL_HOST_DEVICE inline scale_t head_scale(float absmax, float* s) {
  float want = absmax / QuantMax<quant_t>::value;
  scale_t stored;
  if constexpr (std::is_same<scale_t, c10::Half>::value) {
    constexpr float kTiny = 5.9604644775390625e-08f;  // 2^-24
    constexpr float kMax = 65504.0f;
    if (want > 0.0f && want <= 3.4028234663852886e+38f) {  // finite positive
      want = want < kTiny ? kTiny : (want > kMax ? kMax : want);
      stored = c10::Half(want);
      if (static_cast<float>(stored) < want)  // the next float16 up (below 65504 here)
        stored = c10::Half(static_cast<unsigned short>(stored.x + 1), c10::Half::from_bits());
    } else {
      stored = c10::Half(want);
    }
  } else {
    stored = static_cast<scale_t>(want);
  }
  *s = static_cast<float>(stored);
  return stored;
}

// One value: round(x / s) clamped to +-qmax (int8: to nearest even; fp8: the nearest e4m3
// value, c10's conversion, the one torch's .to() uses); 0 where the scale is not > 0.
// The clamp keeps NaN, as torch.clamp does.
template <typename quant_t>
TXL_HOST_DEVICE inline quant_t quantize_value(float x, float s) {
  constexpr float qmax = QuantMax<quant_t>::value;
  float y = s > 0.0f ? x / s : 0.0f;
  y = y < -qmax ? -qmax : (y > qmax ? qmax : y);
  if constexpr (std::is_same<quant_t, int8_t>::value) {
    return static_cast<int8_t>(nearbyintf(y));
  } else {
    return quant_t(y);
  }
}

// Calls f(quant_t{}, scale_t{}) for the 8-bit data dtype (int8 or float8_e4m3fn) and the scale
// dtype (float32 or float16), both c10::ScalarType values as int (checked by the caller).
template <typename F>
inline void dispatch_quant(int quant_dtype, int scale_dtype, F&& f) {
  const bool fp32 = static_cast<c10::ScalarType>(scale_dtype) == c10::ScalarType::Float;
  if (static_cast<c10::ScalarType>(quant_dtype) == c10::ScalarType::Char) {
    if (fp32) f(int8_t{}, float{}); else f(int8_t{}, c10::Half{});
  } else {
    if (fp32) f(c10::Float8_e4m3fn{}, float{}); else f(c10::Float8_e4m3fn{}, c10::Half{});
  }
}

#ifdef TXL_WITH_CUDA
// Launch ONE kernel that quantises and appends every buffer's rows (QuantDesc table in device
// memory). src_dtype / quant_dtype / scale_dtype are c10::ScalarType values (as int);
// max_heads: the largest n * bsz * heads over the jobs.
void launch_quantize_append_cuda(const QuantDesc* desc_device, int64_t num, int64_t max_heads,
                                 int src_dtype, int quant_dtype, int scale_dtype,
                                 int device_index);

// Launch ONE kernel that performs every layer's copy. desc_device points to num_layers
// LayerDesc in device memory. dtype is a c10::ScalarType (as int, to keep this header free of
// ATen includes). vec_bytes is 16 when every row of every layer may be copied as aligned
// 16-byte vectors (contiguous rows, 16-byte aligned pointers and strides), else 0 (element
// copies with arbitrary strides). max_rows / max_vecs: the largest n * bsz and row length (in
// vectors or elements) over the layers, used to size the grid.
void launch_update_mems_cuda(const LayerDesc* desc_device, int64_t num_layers, int64_t max_rows,
                             int64_t max_vecs, int vec_bytes, int dtype, int device_index);
#endif

}  // namespace txl_kernels
