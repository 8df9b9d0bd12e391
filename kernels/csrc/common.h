// What the attention, the quantised matmul and the norm use: a row of any float dtype to
// float32.
//
// The C++ of kernels/cpu_ops.py: these headers (common.h, attention.h, quant_matmul.h,
// rms_norm.h) hold the ops and are included by cpu_ops.cpp, the one translation unit
// (torch's headers cost most of the ~30 s build, so the ops are compiled together rather
// than each on its own).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// One row to float32. bfloat16 is the top half of a float32: a shift the compiler
// vectorises (c10::BFloat16's own conversion does not).
template <typename T>
static inline void row_to_float(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

template <>
inline void row_to_float<c10::BFloat16>(const c10::BFloat16* __restrict__ src, float* __restrict__ dst, int64_t n) {
  const uint16_t* __restrict__ raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* __restrict__ out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<uint32_t>(raw[d]) << 16;
}
