// Row-wise elementwise ops of a layer, each one pass over its rows where torch takes several
// ops and temporaries: rotate-half RoPE of the q and k heads, and SwiGLU's silu(gate) * up.
// Both round where the torch expressions they replace round, so they give the same values;
// every row runs the same loop, so a row's values do not depend on the row count either.
#pragma once

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <type_traits>
#include <vector>

// One row of N heads of D: y = x * cos + rot(x) * sin, rot(x) = (-x[D/2:], x[:D/2]), each product
// and the sum rounded to float32 on its own, as torch's three elementwise ops round them (so no
// fused multiply-add: GCC contracts a * b + c into one by default), then rounded once to O.
// `rot` is scratch of D floats, `y32` of D.
template <typename T, typename O>
__attribute__((optimize("fp-contract=off"), noinline)) static void rope_row(
    const T* __restrict__ x, const float* __restrict__ cs, const float* __restrict__ sn, O* __restrict__ y,
    int64_t N, int64_t D, float* __restrict__ xf, float* __restrict__ rot, float* __restrict__ y32) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < N; ++h) {
    row_to_float(x + h * D, xf, D);
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      rot[d] = -xf[d + half];
      rot[d + half] = xf[d];
    }
    float* out = std::is_same_v<O, float> ? reinterpret_cast<float*>(y + h * D) : y32;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      const float a = xf[d] * cs[d];
      const float b = rot[d] * sn[d];
      out[d] = a + b;
    }
    if constexpr (!std::is_same_v<O, float>) row_from_float(y32, y + h * D, D);
  }
}

// Rotate-half RoPE as core/attention.py's apply_rope(x, cos, sin).to(out_dtype) computes it:
// x [T, N, D] of any float dtype (heads contiguous within a row; rows may be strided, as the q
// and k heads of the fused qkv projection are), cos and sin float32 [T, 1, D] or [T, D] with
// contiguous rows. Returns a contiguous [T, N, D] in out_dtype.
inline at::Tensor rope_rows(at::Tensor x, at::Tensor cos, at::Tensor sin, at::ScalarType out_dtype) {
  RECORD_FUNCTION("tokenloom::rope_rows", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x: [T, N, D], heads contiguous in a row");
  TORCH_CHECK(x.size(2) % 2 == 0, "x: an even head dim");
  const int64_t T = x.size(0), N = x.size(1), D = x.size(2), xs = x.stride(0);
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == T * D && t->stride(-1) == 1 &&
                t->size(0) == T && t->size(-1) == D, "cos, sin: float32 [T, 1, D] or [T, D]");
    TORCH_CHECK(T <= 1 || t->stride(0) == D, "cos, sin: contiguous rows");
  }
  auto y = at::empty({T, N, D}, x.options().dtype(out_dtype));
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_rows", [&] {
    using in_t = scalar_t;
    const in_t* xp = x.data_ptr<in_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "rope_rows_out", [&] {
      scalar_t* yp = y.data_ptr<scalar_t>();
      at::parallel_for(0, T, T * N * D < (1 << 15) ? T : 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(3 * D);
        for (int64_t t = begin; t < end; ++t)
          rope_row(xp + t * xs, cp + t * D, sp + t * D, yp + t * N * D, N, D, scratch.data(), scratch.data() + D,
                   scratch.data() + 2 * D);
      });
    });
  });
  return y;
}

// One row of SwiGLU: silu(g) rounded to R, times u, rounded to R again, as F.silu(gate) * up
// rounds in the model dtype R (float32: no rounding but the float32 one). silu(g) = g / (1 +
// exp(-g)) with vec_exp, within an ulp or two of torch's exp in float32: once rounded to bfloat16
// the two agree but for a rare value on a rounding boundary.
template <typename R>
static inline void silu_mul_row(const R* __restrict__ gate, const R* __restrict__ up, R* __restrict__ out, int64_t F,
                                float* __restrict__ g, float* __restrict__ u) {
  row_to_float(gate, g, F);
  row_to_float(up, u, F);
#pragma omp simd
  for (int64_t i = 0; i < F; ++i) g[i] = round_to<R>(g[i] / (1.f + vec_exp(-g[i]))) * u[i];
  row_from_float(g, out, F);
}

// SwiGLU's silu(gate) * up, row by row: gate, up [T, F] (rows may be strided views, e.g. the
// halves of the fused gate/up projection), any float dtype; F.silu(gate) * up's roundings (see
// silu_mul_row) in one pass instead of two ops and a temporary. Every row runs the same loop, so
// a row's values do not depend on the row count (torch's elementwise ops split a large tensor
// between threads at arbitrary points, and a piece's last elements take a scalar path whose exp
// rounds differently): the batch-invariant mode relies on that.
inline at::Tensor silu_mul(at::Tensor gate, at::Tensor up) {
  RECORD_FUNCTION("tokenloom::silu_mul", std::vector<c10::IValue>());
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && up.scalar_type() == gate.scalar_type(),
              "gate, up: [T, F] alike");
  TORCH_CHECK(gate.stride(1) == 1 && up.stride(1) == 1, "gate, up: contiguous rows");
  const int64_t T = gate.size(0), F = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  auto out = at::empty({T, F}, gate.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate.data_ptr<scalar_t>();
    const scalar_t* upp = up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, T * F < (1 << 15) ? T : 1, [&](int64_t begin, int64_t end) {
      std::vector<float> g(F), u(F);
      for (int64_t r = begin; r < end; ++r) silu_mul_row(gp + r * gs, upp + r * us, op + r * F, F, g.data(), u.data());
    });
  });
  return out;
}

// The index of each row's largest value, as torch.argmax(x, dim=-1) picks it: the first index
// holding the maximum, and a row with a NaN gives its first NaN. x [B, V] of any float dtype,
// contiguous rows; returns int64 [B]. One pass for the maximum (16 running maxima the compiler
// vectorises) and one for its first index: torch's own argmax reduction, which carries an
// index with every compare, took 4-10 ms for 64 rows of a 49152-token vocabulary (2 threads),
// as long as a twentieth of a decode step.
template <typename T>
static int64_t argmax_row(const T* __restrict__ x, int64_t V) {
  constexpr int64_t W = 16;
  float m[W];
  int32_t nans[W];
  for (int64_t i = 0; i < W; ++i) {
    m[i] = -INFINITY;
    nans[i] = 0;
  }
  int64_t v = 0;
  for (; v + W <= V; v += W) {
#pragma omp simd
    for (int64_t i = 0; i < W; ++i) {
      const float f = static_cast<float>(x[v + i]);
      nans[i] |= f != f;
      m[i] = f > m[i] ? f : m[i];
    }
  }
  float best = -INFINITY;
  bool nan = false;
  for (int64_t i = 0; i < W; ++i) {
    best = m[i] > best ? m[i] : best;
    nan |= nans[i] != 0;
  }
  for (int64_t i = v; i < V; ++i) {
    const float f = static_cast<float>(x[i]);
    nan |= f != f;
    best = f > best ? f : best;
  }
  for (int64_t i = 0; i < V; ++i) {
    const float f = static_cast<float>(x[i]);
    if (nan ? f != f : f == best) return i;
  }
  return 0;  // (every value -inf: the first, as torch gives)
}

inline at::Tensor argmax_rows(at::Tensor x) {
  RECORD_FUNCTION("tokenloom::argmax_rows", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, "x: [B, V] with contiguous rows, V > 0");
  const int64_t B = x.size(0), V = x.size(1), xs = x.stride(0);
  auto out = at::empty({B}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, B, B * V < (1 << 16) ? B : 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) op[b] = argmax_row(xp + b * xs, V);
    });
  });
  return out;
}
