// What the attention, the quantised matmul and the norm use: a row of any float dtype to
// float32.
//
// The C++ of kernels/cpu_ops.py: these headers (common.h, attention.h, quant_matmul.h,
// rms_norm.h) hold the ops and are included by cpu_ops.cpp, the one translation unit
// (torch's headers cost most of the ~30 s build, so the ops are compiled together rather
// than each on its own).
#pragma once

#include <ATen/ATen.h>

#include <bit>
#include <cstdint>
#include <type_traits>

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

// One float32 row to T, rounded to nearest even as static_cast<T> rounds. bfloat16 on the
// bits (a NaN becomes the quiet NaN c10 gives), so the loop vectorises (c10::BFloat16's own
// conversion, a call per element, does not).
template <typename T>
static inline void row_from_float(const float* __restrict__ src, T* __restrict__ dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<T>(src[d]);
}

template <>
inline void row_from_float<c10::BFloat16>(const float* __restrict__ src, c10::BFloat16* __restrict__ dst, int64_t n) {
  const uint32_t* __restrict__ in = reinterpret_cast<const uint32_t*>(src);
  uint16_t* __restrict__ out = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) {
    const uint32_t u = in[d];
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    out[d] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);
  }
}

// exp for float32 that the compiler vectorises (std::exp stays a scalar call): Cephes'
// expf, range-reduced by powers of two with ln 2 split in two, a degree-6 polynomial; within
// ~2 ulp of std::exp on [-87.3, 88.7] (clamped there). k = round(x / ln 2) by the 1.5 * 2^23
// trick: std::floor, as Cephes has it, kept GCC from vectorising the loop at all.
static inline float vec_exp(float x) {
  x = x < -87.3365f ? -87.3365f : (x > 88.7228f ? 88.7228f : x);  // (std::min/max take references: not vectorised)
  const float k = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
}

// x rounded to R (to nearest even) and back to float32; bfloat16 on the bits (finite x).
template <typename R>
static inline float round_to(float x) {
  if constexpr (std::is_same_v<R, float>) {
    return x;
  } else if constexpr (std::is_same_v<R, c10::BFloat16>) {  // round to nearest even on the bits (finite x)
    uint32_t u = std::bit_cast<uint32_t>(x);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return std::bit_cast<float>(u);
  } else {
    return static_cast<float>(static_cast<R>(x));
  }
}
