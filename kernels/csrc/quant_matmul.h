// Few-row matmuls over 4-bit and 8-bit weights (quant_matmul): y [R, N] = x [R, K] @ W^T
// with W's codes read where they lie and never widened into a dense copy.
//
// Why not torch's _weight_int4pack_mm_for_cpu / _weight_int8pack_mm: both take bfloat16
// activations only, round the scales to bfloat16, and their cost grows by ~15-20% of a
// one-row call with every further row, so a speculative step's few verified rows left them
// for the dense copy. Here one pass over a weight block serves every row: the codes are
// widened once and each row adds two FMAs per pair of codes, in float32, whatever the
// activation dtype.
//
// Each row's arithmetic is the same whatever the number of rows beside it (rows are taken
// in chunks of at most MAX_ROWS, and a chunk's size changes no row's order of operations):
// a row's output is bit-identical alone and in a batch.
//
// Layouts (packed by backends/torch_linear.py, QuantMatmulLinear):
// - 4-bit: codes [N/16, K/2, 16] uint8, byte j of pair p holds column j's codes k = 2p (low
//   nibble) and 2p + 1 (high); sm [N/16, K/group, 2, 16] float16: per group the 16 columns'
//   scales, then their offsets, so w = code * scale + offset (offset = -zero * scale). GGUF's
//   Q4_0 / Q4_1 store both in float16: exact; float16 halves what float32 scales read.
//   Per group, sum_k x_k w_k = scale * sum_k x_k code_k + offset * sum_k x_k: the inner loop
//   is one FMA per code.
// - 8-bit: codes [N/16, K, 16] int8 (symmetric: the stored code minus 128), sm [N/16,
//   K/group, 16] float16: w = code * scale (one group of K: per channel).
#pragma once

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace qmm {

typedef float f16v __attribute__((vector_size(64)));     // 16 float32 lanes (AVX-512, or two AVX2 halves)
typedef int32_t i16v __attribute__((vector_size(64)));

#if defined(__AVX512F__)
constexpr int MAX_ROWS = 8;  // 3 accumulators a row in 32 registers
#else
constexpr int MAX_ROWS = 4;  // 16 registers of 8 lanes
#endif

// 16 bytes widened to 16 int32 lanes, zero- (uint8) or sign-extended (int8). GCC 12 makes
// byte-by-byte scalar code of __builtin_convertvector from 8-bit lanes, so: intrinsics.
template <bool SIGNED>
static inline i16v widen16(const void* p) {
  i16v v;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m512i w = SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  std::memcpy(&v, &w, sizeof(v));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m256i w0 = SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  const __m128i b1 = _mm_srli_si128(b, 8);
  const __m256i w1 = SIGNED ? _mm256_cvtepi8_epi32(b1) : _mm256_cvtepu8_epi32(b1);
  std::memcpy(&v, &w0, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &w1, 32);
#else
  using B = std::conditional_t<SIGNED, int8_t, uint8_t>;
  const B* b = static_cast<const B*>(p);
  for (int j = 0; j < 16; ++j) v[j] = b[j];
#endif
  return v;
}

// 16 float16 scales to float32 (exact).
static inline f16v load16h(const at::Half* p) {
  f16v v;
#if defined(__AVX512F__)
  const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &w, sizeof(v));
#elif defined(__F16C__)
  const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&v, &w0, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &w1, 32);
#else
  for (int j = 0; j < 16; ++j) v[j] = static_cast<float>(p[j]);
#endif
  return v;
}

// One 16-column block, R rows, 4-bit codes. xf [R][K] float32 rows, xs [R][G] their
// per-group sums; out [R] pointers to the rows' 16 outputs (float32).
template <int R>
static inline void block4(const float* __restrict__ xf, const float* __restrict__ xs, int64_t K, int64_t G,
                          int64_t group, const uint8_t* __restrict__ w, const at::Half* __restrict__ sm,
                          float* __restrict__ out) {
  f16v acc[R];
  for (int r = 0; r < R; ++r) acc[r] = f16v{};
  const int64_t pairs = group / 2;
  for (int64_t g = 0; g < G; ++g) {
    f16v lo_acc[R], hi_acc[R];  // even and odd codes apart: two independent FMA chains a row
    for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = f16v{};
    const uint8_t* wp = w + g * pairs * 16;
    const float* xg = xf + g * group;
    for (int64_t p = 0; p < pairs; ++p) {
      const i16v v = widen16<false>(wp + p * 16);
      const f16v lo = __builtin_convertvector(v & 15, f16v);
      const f16v hi = __builtin_convertvector(v >> 4, f16v);
      for (int r = 0; r < R; ++r) {
        lo_acc[r] += xg[r * K + 2 * p] * lo;
        hi_acc[r] += xg[r * K + 2 * p + 1] * hi;
      }
    }
    const f16v scale = load16h(sm + g * 32), offset = load16h(sm + g * 32 + 16);
    for (int r = 0; r < R; ++r) acc[r] += (lo_acc[r] + hi_acc[r]) * scale + xs[r * G + g] * offset;
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * 16, &acc[r], sizeof(f16v));
}

// One 16-column block, R rows, signed 8-bit codes with one scale per column and group.
template <int R>
static inline void block8(const float* __restrict__ xf, int64_t K, int64_t G, int64_t group,
                          const int8_t* __restrict__ w, const at::Half* __restrict__ scales, float* __restrict__ out) {
  f16v acc[R];
  for (int r = 0; r < R; ++r) acc[r] = f16v{};
  for (int64_t g = 0; g < G; ++g) {
    f16v a0[R], a1[R];  // even and odd k apart: two independent FMA chains a row
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = f16v{};
    const int64_t end = (g + 1) * group;
    int64_t k = g * group;
    for (; k + 1 < end; k += 2) {
      const f16v w0 = __builtin_convertvector(widen16<true>(w + k * 16), f16v);
      const f16v w1 = __builtin_convertvector(widen16<true>(w + (k + 1) * 16), f16v);
      for (int r = 0; r < R; ++r) {
        a0[r] += xf[r * K + k] * w0;
        a1[r] += xf[r * K + k + 1] * w1;
      }
    }
    if (k < end) {  // an odd group (one group of odd K)
      const f16v w0 = __builtin_convertvector(widen16<true>(w + k * 16), f16v);
      for (int r = 0; r < R; ++r) a0[r] += xf[r * K + k] * w0;
    }
    const f16v scale = load16h(scales + g * 16);
    for (int r = 0; r < R; ++r) acc[r] += (a0[r] + a1[r]) * scale;
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * 16, &acc[r], sizeof(f16v));
}

template <int R, typename T>
static void run_chunk(int bits, const float* xf, const float* xs, int64_t K, int64_t G, int64_t group,
                      const void* codes, const at::Half* sm, T* y, int64_t N, int64_t nb0, int64_t nb1) {
  float out[R * 16];
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    if (bits == 4) {
      block4<R>(xf, xs, K, G, group, static_cast<const uint8_t*>(codes) + nb * (K / 2) * 16, sm + nb * G * 32, out);
    } else {
      block8<R>(xf, K, G, group, static_cast<const int8_t*>(codes) + nb * K * 16, sm + nb * G * 16, out);
    }
    for (int r = 0; r < R; ++r) {
      T* dst = y + r * N + nb * 16;
      for (int j = 0; j < 16; ++j) dst[j] = static_cast<T>(out[r * 16 + j]);  // rounded once, to y's dtype
    }
  }
}

// rows r0 .. r0 + n (n <= MAX_ROWS) of column blocks nb0 .. nb1 (outside the dtype dispatch:
// a preprocessor directive cannot sit inside its macro's argument)
template <typename T>
static void run_rows(int n, int bits, const float* xf, const float* xs, int64_t K, int64_t G, int64_t group,
                     const void* codes, const at::Half* sm, T* y, int64_t N, int64_t nb0, int64_t nb1) {
  switch (n) {
#define QMM_CASE(C) \
  case C: run_chunk<C>(bits, xf, xs, K, G, group, codes, sm, y, N, nb0, nb1); break;
    QMM_CASE(1) QMM_CASE(2) QMM_CASE(3) QMM_CASE(4)
#if defined(__AVX512F__)
    QMM_CASE(5) QMM_CASE(6) QMM_CASE(7) QMM_CASE(8)
#endif
#undef QMM_CASE
    default: TORCH_CHECK(false, "quant_matmul: unreachable chunk size");
  }
}

}  // namespace qmm

// x [R, K] (float32, bfloat16 or float16) times the packed weight: y [R, N] in x's dtype.
// bits 4: codes [N/16, K/2, 16] uint8 and sm [N/16, K/group, 2, 16] float16; bits 8: codes
// [N/16, K, 16] int8 and sm [N/16, K/group, 16] float16.
inline at::Tensor quant_matmul(at::Tensor x, at::Tensor codes, at::Tensor sm, int64_t bits, int64_t group) {
  RECORD_FUNCTION("tokenloom::quant_matmul", std::vector<c10::IValue>());
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quant_matmul: x must be [rows, in] on the CPU");
  TORCH_CHECK(bits == 4 || bits == 8, "quant_matmul: bits must be 4 or 8");
  TORCH_CHECK(sm.scalar_type() == at::kHalf && sm.is_contiguous(), "quant_matmul: float16 contiguous scales");
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 3 && codes.size(2) == 16, "quant_matmul: codes [N/16, ., 16]");
  const int64_t R = x.size(0), K = x.size(1), N = codes.size(0) * 16;
  int64_t G = 1;
  if (bits == 4) {
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.size(1) * 2 == K, "quant_matmul: 4-bit codes [N/16, K/2, 16] uint8");
    TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0, "quant_matmul: an even group that divides K");
    G = K / group;
    TORCH_CHECK(sm.numel() == N * G * 2, "quant_matmul: 4-bit sm [N/16, K/group, 2, 16]");
  } else {
    TORCH_CHECK(codes.scalar_type() == at::kChar && codes.size(1) == K, "quant_matmul: 8-bit codes [N/16, K, 16] int8");
    TORCH_CHECK(group > 0 && K % group == 0 && (group % 2 == 0 || group == K), "quant_matmul: a group that divides K");
    G = K / group;
    TORCH_CHECK(sm.numel() == N * G, "quant_matmul: 8-bit sm [N/16, K/group, 16]");
  }
  auto out = at::empty({R, N}, x.options());
  const void* cp = codes.data_ptr();
  const at::Half* smp = sm.data_ptr<at::Half>();
  const int64_t NB = N / 16;
  const auto xc = x.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_matmul", [&] {
    // the rows in float32 once (exact), and (4-bit) each row's per-group sums, summed in order
    std::vector<float> xf(R * K), xs(bits == 4 ? R * G : 0);  // (8-bit: no offsets, no sums)
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    for (int64_t r = 0; r < R; ++r) row_to_float(xp + r * K, xf.data() + r * K, K);
    if (bits == 4) {
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
          for (int64_t k = g * group; k < (g + 1) * group; ++k) s += xf[r * K + k];
          xs[r * G + g] = s;
        }
      }
    }
    scalar_t* yp = out.data_ptr<scalar_t>();
    // each worker takes a range of column blocks for all rows: a block's codes are read once a chunk
    at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
      for (int64_t r0 = 0; r0 < R; r0 += qmm::MAX_ROWS) {
        const int n = static_cast<int>(std::min<int64_t>(qmm::MAX_ROWS, R - r0));
        const float* xr = xf.data() + r0 * K;
        const float* xsr = xs.data() + r0 * G;
        scalar_t* yr = yp + r0 * N;
        qmm::run_rows(n, static_cast<int>(bits), xr, xsr, K, G, group, cp, smp, yr, N, nb0, nb1);
      }
    });
  });
  return out;
}
