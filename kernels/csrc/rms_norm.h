// The residual add fused with RMSNorm, in the order and dtypes F.rms_norm rounds in.
#pragma once

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <vector>

// h [T, d] float32, updated in place to h + delta (delta: [T, d] of any float dtype, may be a
// strided view, or absent); returns RMSNorm(h) * weight as (h * rsqrt(mean(h^2) + eps)) * weight
// in out_dtype, the order F.rms_norm rounds in.
inline at::Tensor add_rms_norm(at::Tensor h, c10::optional<at::Tensor> delta, at::Tensor weight, double eps,
                               at::ScalarType out_dtype) {
  RECORD_FUNCTION("tokenloom::add_rms_norm", std::vector<c10::IValue>());
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "h: contiguous float32 [T, d]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == h.size(1),
              "weight: float32 [d]");
  const int64_t T = h.size(0), d = h.size(1);
  auto x = at::empty({T, d}, h.options().dtype(out_dtype));
  float* hp = h.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const bool has_delta = delta.has_value() && delta->defined();
  if (has_delta) {
    TORCH_CHECK(delta->dim() == 2 && delta->size(0) == T && delta->size(1) == d && delta->stride(1) == 1,
                "delta: [T, d] with contiguous rows");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "add_rms_norm", [&] {
    using out_t = scalar_t;
    out_t* xp = x.data_ptr<out_t>();
    auto body = [&](auto* dp, int64_t dstride) {
      at::parallel_for(0, T, T * d < (1 << 16) ? T : 1, [&](int64_t begin, int64_t end) {
        std::vector<float> tmp(dp ? d : 0);
        for (int64_t r = begin; r < end; ++r) {
          float* hr = hp + r * d;
          if (dp) {
            row_to_float(dp + r * dstride, tmp.data(), d);
_Pragma("omp simd")
            for (int64_t i = 0; i < d; ++i) hr[i] += tmp[i];
          }
          float ss = 0.f;
_Pragma("omp simd reduction(+ : ss)")
          for (int64_t i = 0; i < d; ++i) ss += hr[i] * hr[i];
          const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
          for (int64_t i = 0; i < d; ++i) xp[r * d + i] = static_cast<out_t>((hr[i] * inv) * wp[i]);
        }
      });
    };
    if (!has_delta) {
      body(static_cast<const float*>(nullptr), 0);
    } else {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, delta->scalar_type(), "add_rms_norm_delta", [&] {
        body(delta->data_ptr<scalar_t>(), delta->stride(0));
      });
    }
  });
  return x;
}
