// Many-row matmuls over 4-bit and 8-bit weights with 8-bit activations (q8_matmul): what a step with
// more rows than quant_matmul's threshold runs under `backend.quant_dense = "q8"`, instead of a
// dense bfloat16 copy of the weight.
//
// Why: above a few rows a step is bound by multiply-adds, not by the bytes of the weights.
// Without AMX, a bfloat16 GEMM does 32 multiply-adds per AVX-512 instruction (VDPBF16PS);
// VPDPBUSD does 64 on bytes. So each row's activations are quantised to 8 bits in blocks of
// 32 (a scale d = max|x| / 127 per block, codes round(x / d), as llama.cpp's Q8_1 blocks
// are), the weights' unsigned codes (0..15, or 0..255 for 8-bit ones: GGUF Q8_0's signed
// values plus their zero point 128) are multiplied with them as bytes into int32 sums per
// block, and each block's sum is scaled in float32:
//
//   y = sum over blocks b of  scale_g * d_b * isum_b  +  offset_g * s_b,    s_b = d_b * sum q_b
//
// with scale_g and offset_g the weight group's (w = code * scale + offset), exactly the dot
// product of the dequantised weights with the 8-bit activations. For 8-bit weights (symmetric:
// code = value + 128) the zero point comes off in int32 instead, isum_b - 128 * sum q_b, so
// no large float32 terms cancel: y = sum over b of scale_g * d_b * (isum_b - 128 sum q_b). What it changes against the
// dense copy is the activations' rounding: 8 bits per 32 values instead of bfloat16's 8
// significant bits per value; docs/quantization.md has the perplexity.
//
// Each row's arithmetic is the same whatever the rows beside it (the blocks of a row are
// summed in order, per output, whatever the tile): a row's output is bit-identical alone and
// in a batch, at every row count this kernel runs.
//
// Layouts (packed by backends/torch_linear.py, Q8Linear):
// - codes [N/16, K/4, 16, 4] uint8, one code a byte: byte (c, i) of chunk j is
//   column c's code for k = 4j + i, so one 64-byte load is a VPDPBUSD operand of 4 k x 16
//   columns (for 4-bit codes twice their bytes, half a bfloat16 copy's: unpacking nibbles
//   cost more than reading them);
// - sm [N/16, K/group, 2, 16] float32: per weight group the 16 columns' scales, then offsets
//   (unread for 8-bit weights).
//
// Only where the build targets AVX512-VNNI and AVX512-BW (-march=native on Ice Lake, Zen 4
// and later): ready() says so; elsewhere the op refuses and the backend refuses "q8".
#pragma once

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define TOKENLOOM_VNNI 1
#include <immintrin.h>
#endif

namespace q8 {

constexpr int64_t QK = 32;    // activations per block (one scale)
constexpr int MAX_ROWS = 6;     // rows a tile: 6 x 2 int32 and 6 x 2 float32 accumulators of 32 registers
constexpr int64_t K_BLOCKS = 16;  // blocks of K a pass (16 KB of a column pair's codes: in L1)

inline bool ready() {
#if defined(TOKENLOOM_VNNI)
  return true;
#else
  return false;
#endif
}

#if defined(TOKENLOOM_VNNI)
// Rows [b, e) of x to 8-bit blocks: q [M, K] int8, d [M, K/32] float32 scales, qs [M, K/32] sum q.
template <typename T>
static void quantize_rows(const T* x, int8_t* q, float* d, int32_t* qs, int64_t b, int64_t e, int64_t K) {
  const int64_t G = K / QK;
  std::vector<float> buf(K);
  for (int64_t m = b; m < e; ++m) {
    row_to_float(x + m * K, buf.data(), K);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 a0 = _mm512_loadu_ps(buf.data() + g * QK), a1 = _mm512_loadu_ps(buf.data() + g * QK + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
      const float dd = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, _mm512_set1_ps(id)));  // to nearest even
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, _mm512_set1_ps(id)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + g * QK), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + g * QK + 16), _mm512_cvtsepi32_epi8(q1));
      d[m * G + g] = dd;
      qs[m * G + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
  }
}

// R rows x 32 columns (two 16-column tiles c0, c1 and their scales sm0, sm1), blocks [b0, b1)
// of K, added to f (float32, R x 32, row stride 32): the blocks in order, whatever R.
template <int R, bool SYM8>
static inline void tile(const uint8_t* __restrict__ c0, const uint8_t* __restrict__ c1, const float* __restrict__ sm0,
                        const float* __restrict__ sm1, const int8_t* __restrict__ q, const float* __restrict__ d,
                        const int32_t* __restrict__ qsum, int64_t K, int64_t b0,
                        int64_t b1, int64_t blocks_per_group, float* __restrict__ f_out) {
  const int64_t G = K / QK;
  __m512 f[R][2];
  for (int r = 0; r < R; ++r) {
    f[r][0] = _mm512_loadu_ps(f_out + r * 32);
    f[r][1] = _mm512_loadu_ps(f_out + r * 32 + 16);
  }
  for (int64_t g = b0; g < b1; ++g) {
    __m512i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int64_t j = 8 * g; j < 8 * g + 8; ++j) {  // 4 k a chunk, 8 chunks a block
      const __m512i w0 = _mm512_loadu_si512(c0 + j * 64), w1 = _mm512_loadu_si512(c1 + j * 64);
      for (int r = 0; r < R; ++r) {
        int32_t a;
        std::memcpy(&a, q + r * K + 4 * j, 4);
        const __m512i xa = _mm512_set1_epi32(a);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, xa);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, xa);
      }
    }
    const int64_t wg = g / blocks_per_group;
    const __m512 sc0 = _mm512_loadu_ps(sm0 + wg * 32), of0 = _mm512_loadu_ps(sm0 + wg * 32 + 16);
    const __m512 sc1 = _mm512_loadu_ps(sm1 + wg * 32), of1 = _mm512_loadu_ps(sm1 + wg * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 dr = _mm512_set1_ps(d[r * G + g]);
      if constexpr (SYM8) {  // sum (c - 128) q = isum - 128 sum q, exactly, in int32
        const __m512i z = _mm512_set1_epi32(128 * qsum[r * G + g]);
        f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], z)), _mm512_mul_ps(sc0, dr), f[r][0]);
        f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], z)), _mm512_mul_ps(sc1, dr), f[r][1]);
      } else {
        const __m512 sr = _mm512_set1_ps(d[r * G + g] * static_cast<float>(qsum[r * G + g]));  // s_b
        f[r][0] = _mm512_fmadd_ps(of0, sr, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(sc0, dr), f[r][0]));
        f[r][1] = _mm512_fmadd_ps(of1, sr, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(sc1, dr), f[r][1]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(f_out + r * 32, f[r][0]);
    _mm512_storeu_ps(f_out + r * 32 + 16, f[r][1]);
  }
}

template <typename T, bool SYM8>
static void run(const T* x, const uint8_t* codes, const float* sm, T* y, int64_t M, int64_t N, int64_t K,
                int64_t group) {
  const int64_t G = K / QK, Gw = K / group, bpg = group / QK;
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * G);
  std::vector<int32_t> qs(M * G);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) { quantize_rows(x, q.data(), d.data(), qs.data(), b, e, K); });
  const int64_t tile_bytes = K * 16, tile_sm = Gw * 32;
  at::parallel_for(0, N / 32, 1, [&](int64_t tb, int64_t te) {
    std::vector<float> f(M * 32);  // this column pair's sums, all rows
    for (int64_t t = tb; t < te; ++t) {
      const uint8_t* c0 = codes + 2 * t * tile_bytes;
      const float* s0 = sm + 2 * t * tile_sm;
      std::fill(f.begin(), f.end(), 0.f);
      for (int64_t b0 = 0; b0 < G; b0 += K_BLOCKS) {  // a slice of K whose codes stay in L1 across the rows
        const int64_t b1 = std::min<int64_t>(G, b0 + K_BLOCKS);
        for (int64_t m = 0; m < M; m += MAX_ROWS) {
          const int64_t rows = std::min<int64_t>(MAX_ROWS, M - m);
          const int8_t* qm = q.data() + m * K;
          const float* dm = d.data() + m * G;
          const int32_t* qsm = qs.data() + m * G;
          float* fm = f.data() + m * 32;
          switch (rows) {
#define Q8_TILE(n) \
  case n: tile<n, SYM8>(c0, c0 + tile_bytes, s0, s0 + tile_sm, qm, dm, qsm, K, b0, b1, bpg, fm); break;
            Q8_TILE(6) Q8_TILE(5) Q8_TILE(4) Q8_TILE(3) Q8_TILE(2)
            default: tile<1, SYM8>(c0, c0 + tile_bytes, s0, s0 + tile_sm, qm, dm, qsm, K, b0, b1, bpg, fm); break;
#undef Q8_TILE
          }
        }
      }
      for (int64_t m = 0; m < M; ++m) row_from_float(f.data() + m * 32, y + m * N + 32 * t, 32);
    }
  });
}

template <typename T>
static void dispatch(const T* x, const uint8_t* codes, const float* sm, T* y, int64_t M, int64_t N, int64_t K,
                     int64_t bits, int64_t group) {
  if (bits == 8) run<T, true>(x, codes, sm, y, M, N, K, group);
  else run<T, false>(x, codes, sm, y, M, N, K, group);
}
#endif

}  // namespace q8

// y [M, N] in x's dtype (float32 or bfloat16) = x [M, K] @ W^T, W's 4-bit or symmetric 8-bit
// codes and float32 scales in the layout above, activations rounded to 8 bits in blocks of 32.
inline at::Tensor q8_matmul(at::Tensor x, at::Tensor codes, at::Tensor sm, int64_t bits, int64_t group) {
  RECORD_FUNCTION("tokenloom::q8_matmul", std::vector<c10::IValue>());
  TORCH_CHECK(q8::ready(), "q8_matmul: this build does not target AVX512-VNNI");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "q8_matmul: x must be [rows, in] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "q8_matmul: float32 or bfloat16 x");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 4 && codes.size(2) == 16 &&
                  codes.size(3) == 4, "q8_matmul: codes [N/16, K/4, 16, 4] uint8");
  TORCH_CHECK(bits == 4 || bits == 8, "q8_matmul: bits must be 4 or 8");
  TORCH_CHECK(sm.scalar_type() == at::kFloat && sm.is_contiguous(), "q8_matmul: float32 contiguous scales");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0) * 16;
  TORCH_CHECK(codes.size(1) * 4 == K && K % q8::QK == 0 && N % 32 == 0, "q8_matmul: K a multiple of 32, N of 32");
  TORCH_CHECK(group > 0 && group % q8::QK == 0 && K % group == 0, "q8_matmul: a group of a multiple of 32 dividing K");
  TORCH_CHECK(sm.numel() == N * (K / group) * 2, "q8_matmul: sm [N/16, K/group, 2, 16]");
  x = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(TOKENLOOM_VNNI)
  if (M == 0) return y;
  if (x.scalar_type() == at::kFloat)
    q8::dispatch(x.data_ptr<float>(), codes.data_ptr<uint8_t>(), sm.data_ptr<float>(), y.data_ptr<float>(), M, N, K,
                 bits, group);
  else
    q8::dispatch(x.data_ptr<c10::BFloat16>(), codes.data_ptr<uint8_t>(), sm.data_ptr<float>(),
                 y.data_ptr<c10::BFloat16>(), M, N, K, bits, group);
#endif
  return y;
}
