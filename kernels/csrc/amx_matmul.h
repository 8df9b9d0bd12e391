// Many-row matmuls over quant_matmul's packed 4-bit and 8-bit weights on Intel AMX
// (amx_matmul): what a step with more rows than the quantised kernel's threshold runs
// instead of a dense bfloat16 copy of the weight.
//
// Why: above a few rows quant_matmul's cost grows by a row's FMAs per row, and a dense copy
// took over, which reads 2 bytes a weight (4x the 4-bit codes). Here each 16-column block of
// codes is widened, per group, to bfloat16 weights w = code * scale + offset (rounded once to
// bfloat16) in the tile layout AMX reads, in buffers of the thread's own (two pairs of blocks
// of 16 columns x K: 4 x 32 * K bytes, 72 KB at K = 576, in L2; one pair multiplied while the
// next is widened), and TDPBF16PS multiplies bfloat16 rows of x by them with float32 sums:
// the codes are read once a step whatever the row count. The dense copy
// is still built, for prompt chunks above AmxLinear's 64 rows, where oneDNN's GEMM over it wins.
//
// Rounds as a dense bfloat16 copy does (bfloat16 weights and activations, float32 sums), not
// as quant_matmul (float32 weights). The widened weights are the copy's up to a last bit: the
// copy dequantises in float32 from the stored scales (a fused multiply-add here; for GPTQ and
// AWQ a float16 offset folded from the zero point). A step over many rows is not
// batch-invariant either way.
//
// Only where the build targets AMX-BF16 and AVX512-BF16 (-march=native on a Sapphire Rapids
// or later Xeon) and the kernel lets this process use the tile registers (arch_prctl
// ARCH_REQ_XCOMP_PERM): amx_ready() says so; elsewhere the op refuses and the backend keeps
// the dense copy.
#pragma once

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENLOOM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace amx {

#if defined(TOKENLOOM_AMX)
// the tile configuration (palette 1): tiles 0-3 accumulate two 16-row chunks of y for two
// 16-column blocks, 4-5 hold the matching chunks of x (16 rows x 32 bfloat16), 6-7 the two
// blocks' weights (16 pairs of k x 16 columns)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

inline bool permitted() {
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// 16 float32 lo and hi (k = 2p and 2p + 1 of 16 columns) to one tile row: 16 pairs of bfloat16
static inline __m512i pairs(__m512 lo, __m512 hi) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  // (cvtne2ps: lo in lanes 0-15, hi in 16-31; round to nearest even, as the dense copy's .to(bfloat16))
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Tile kb of one 16-column block's weights (k = 32 kb .. 32 kb + 31) as tile rows: out[p][16]
// uint32 (a pair of bfloat16, k = 2p and 2p + 1) for p = 16 kb .. 16 kb + 15; out is the whole
// block's [K/2][16]. 4-bit codes: [K/2][16] bytes, k = 2p in the low nibble, 2p + 1 in the high;
// per group 16 float16 scales, then 16 offsets.
static inline void widen4_tile(const uint8_t* codes, const at::Half* sm, int64_t group, int64_t kb, uint32_t* out) {
  const int64_t g = kb * 32 / group;
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + g * 32)));
  const __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + g * 32 + 16)));
  // a code's float by a 16-entry lookup (vpermps reads an index's low 4 bits: no mask for the
  // low nibble) instead of mask + conversion: the same values, one instruction fewer a pair
  // (one weight alone, 16 rows, out of cache: 0.198 -> 0.185 ms)
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t p = kb * 16; p < kb * 16 + 16; ++p) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + p * 16)));
    const __m512 lo = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, table), scale, offset);
    const __m512 hi = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table), scale, offset);
    _mm512_store_si512(out + p * 16, pairs(lo, hi));
  }
}

// 8-bit codes: [K][16] int8, per group 16 float16 scales
static inline void widen8_tile(const int8_t* codes, const at::Half* sm, int64_t group, int64_t kb, uint32_t* out) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + kb * 32 / group * 16)));
  for (int64_t p = kb * 16; p < kb * 16 + 16; ++p) {
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 2 * p * 16)))), scale);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (2 * p + 1) * 16)))), scale);
    _mm512_store_si512(out + p * 16, pairs(lo, hi));
  }
}
#endif

inline bool ready() {
#if defined(TOKENLOOM_AMX)
  return permitted();
#else
  return false;
#endif
}

}  // namespace amx

// x [R, K] bfloat16 times quant_matmul's packed weight (see quant_matmul.h for the layouts):
// y [R, N] bfloat16, or float32 with float_out. K and the group multiples of 32.
inline at::Tensor amx_matmul(at::Tensor x, at::Tensor codes, at::Tensor sm, int64_t bits, int64_t group,
                             bool float_out = false) {
  RECORD_FUNCTION("tokenloom::amx_matmul", std::vector<c10::IValue>());
  TORCH_CHECK(amx::ready(), "amx_matmul: this build or CPU has no AMX-BF16 (amx_ready() is False)");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "amx_matmul: x must be [rows, in] bfloat16 on the CPU");
  TORCH_CHECK(bits == 4 || bits == 8, "amx_matmul: bits must be 4 or 8");
  TORCH_CHECK(codes.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "amx_matmul: 4-bit codes are uint8, 8-bit codes int8 (quant_matmul's packing)");
  TORCH_CHECK(group > 0, "amx_matmul: group must be positive");
  TORCH_CHECK(sm.scalar_type() == at::kHalf && sm.is_contiguous() && codes.is_contiguous() && codes.dim() == 3 &&
              codes.size(2) == 16, "amx_matmul: quant_matmul's packed codes and float16 scales");
  const int64_t R = x.size(0), K = x.size(1), N = codes.size(0) * 16;
  TORCH_CHECK(K % 32 == 0 && group % 32 == 0 && K % group == 0, "amx_matmul: K and the group multiples of 32");
  TORCH_CHECK(codes.size(1) * (bits == 4 ? 2 : 1) == K, "amx_matmul: codes do not match x's width");
  TORCH_CHECK(sm.numel() == N * (K / group) * (bits == 4 ? 2 : 1), "amx_matmul: scales do not match the codes");
  auto out = at::empty({R, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
#if defined(TOKENLOOM_AMX)
  if (R == 0) return out;
  const int64_t KB = K / 32, Rpad = (R + 31) / 32 * 32, NB = N / 16;
  // x in tiles, [Rpad/16][K/32][16 rows][32 k], 1 KB each, zero rows below R
  std::vector<uint16_t> xt_store(Rpad * K + 32, 0);
  uint16_t* xt = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(xt_store.data()) + 63) & ~uintptr_t(63));
  const auto xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t kb = 0; kb < KB; ++kb)
      std::memcpy(xt + (((r / 16) * KB + kb) * 16 + r % 16) * 32, xp + r * K + kb * 32, 64);
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const at::Half* smp = sm.data_ptr<at::Half>();
  void* yp = out.data_ptr();
  // two 16-column blocks at a time: four accumulator tiles (32 rows x 32 columns), four
  // independent TDPBF16PS chains, and each x tile loaded serves two weight tiles (a 64-row
  // decode step's matmuls on a 2-core Xeon: 20.9 -> 19.3 ms; one weight alone, in cache, about
  // the same: the widening is the larger part there)
  const int64_t NP = (NB + 1) / 2;
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    amx::TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    // the widened weights of two pairs of blocks: the pair being multiplied, and the next one,
    // widened tile by tile inside this pair's k loop (software pipelining). Widening a whole
    // pair and then multiplying it had the two take the sum of their times; spread between the
    // tile instructions they overlap in part (gate_up, 3072 x 576, 1 thread, weights out of
    // cache: 64 rows 0.360 -> 0.253 ms, 16 rows 0.254 -> 0.192 ms)
    const int64_t WB = K / 2 * 16;  // one block's widened weights, in uint32
    std::vector<uint32_t> w_store(4 * WB + 16);
    uint32_t* wbuf = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(w_store.data()) + 63) & ~uintptr_t(63));
    alignas(64) float c[4][16][16];
    // tile kb of block nb into w
    auto widen = [&](int64_t nb, int64_t kb, uint32_t* w) {
      if (bits == 4) {
        amx::widen4_tile(cp + nb * (K / 2) * 16, smp + nb * (K / group) * 32, group, kb, w);
      } else {
        amx::widen8_tile(reinterpret_cast<const int8_t*>(cp) + nb * K * 16, smp + nb * (K / group) * 16, group, kb, w);
      }
    };
    // tile kb of block nb's codes and its group's scales, asked for a pair ahead of their
    // widening (one weight alone, 16 rows, out of cache: 0.185 -> 0.167 ms; 64 rows level)
    auto prefetch = [&](int64_t nb, int64_t kb) {
      const int64_t code_bytes = bits == 4 ? 256 : 512;  // a tile's: 32 k x 16 columns
      const char* codes = reinterpret_cast<const char*>(cp) + (nb * KB + kb) * code_bytes;
      for (int64_t b = 0; b < code_bytes; b += 64) _mm_prefetch(codes + b, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(smp + (nb * (K / group) + kb * 32 / group) * (bits == 4 ? 32 : 16)),
                   _MM_HINT_T0);
    };
    // tile t of c: rows r0 + 16 * (t % 2), columns of block nb + t / 2
    auto store = [&](int64_t r0, int64_t nb, int tiles) {
      for (int t = 0; t < tiles; ++t) {
        for (int i = 0; i < 16; ++i) {
          const int64_t r = r0 + (t % 2) * 16 + i;
          if (r >= R) break;
          const int64_t col = (nb + t / 2) * 16;
          const __m512 v = _mm512_load_ps(c[t][i]);
          if (float_out) {
            _mm512_storeu_ps(static_cast<float*>(yp) + r * N + col, v);
          } else {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(yp) + r * N + col),
                                (__m256i)_mm512_cvtneps_pbh(v));
          }
        }
      }
    };
    for (int64_t kb = 0; kb < KB; ++kb) {  // the first pair, before its k loop
      widen(2 * p0, kb, wbuf);
      if (2 * p0 + 1 < NB) widen(2 * p0 + 1, kb, wbuf + WB);
    }
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb = 2 * p;
      const bool pair = nb + 1 < NB;
      uint32_t* w0 = wbuf + (p - p0) % 2 * 2 * WB;
      uint32_t* w1 = w0 + WB;
      uint32_t* next = wbuf + (p - p0 + 1) % 2 * 2 * WB;  // the next pair's, widened below
      const int64_t next_blocks = p + 1 < p1 ? std::min<int64_t>(2, NB - nb - 2) : 0;
      for (int64_t r0 = 0; r0 < Rpad; r0 += 32) {
        const uint16_t* x0 = xt + (r0 / 16) * KB * 512;
        const uint16_t* x1 = x0 + KB * 512;
        // a last chunk of 16 rows or fewer multiplies its one row tile: half the TDPBF16PS of
        // two (one weight alone, 1-16 rows, one thread: the tile work had been 45% of the time)
        const bool two = r0 + 16 < R;
        // which of the next pair's blocks this chunk widens: both in a single chunk; else the
        // first in chunk 0 and the second in chunk 1
        const int64_t chunk = r0 / 32;
        const int64_t wfirst = Rpad == 32 ? 0 : chunk, wlast = Rpad == 32 ? next_blocks : std::min(chunk + 1, next_blocks);
        _tile_zero(0);
        if (two) _tile_zero(1);
        if (pair) _tile_zero(2);
        if (pair && two) _tile_zero(3);
        for (int64_t kb = 0; kb < KB; ++kb) {  // (the branches are the same every kb)
          _tile_loadd(4, x0 + kb * 512, 64);
          _tile_loadd(6, w0 + kb * 256, 64);
          if (two) _tile_loadd(5, x1 + kb * 512, 64);
          if (pair) _tile_loadd(7, w1 + kb * 256, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two) _tile_dpbf16ps(1, 5, 6);
          if (pair) _tile_dpbf16ps(2, 4, 7);
          if (pair && two) _tile_dpbf16ps(3, 5, 7);
          for (int64_t b = wfirst; b < wlast; ++b) {
            widen(nb + 2 + b, kb, next + b * WB);
            if (nb + 4 + b < NB) prefetch(nb + 4 + b, kb);
          }
        }
        _tile_stored(0, c[0], 64);
        if (two) _tile_stored(1, c[1], 64);
        if (pair) _tile_stored(2, c[2], 64);
        if (pair && two) _tile_stored(3, c[3], 64);
        store(r0, nb, pair ? 4 : 2);  // (rows at or past R are not written: tiles 1 and 3 when !two)
      }
    }
    _tile_release();
  });
#endif
  return out;
}
