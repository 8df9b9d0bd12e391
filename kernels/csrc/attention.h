// Decode attention that reads the paged KV cache where it lies: per (sequence, KV head),
// the group's query heads scored against the keys block by block, a float32 softmax, the
// weighted sum of the values; no copy of the cache. paged_decode_attention takes q as it
// is; decode_layer_attention starts from the layer's fused qkv projection (RoPE, the KV
// write, then the same attention).
#pragma once

#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// The G query heads of one KV head (qf [G, D], already scaled) against the first L tokens of
// one sequence, read block by block where they lie (caches [KVH, NB, BS, D]); acc [G, D] gets
// the softmax-weighted values. float32 throughout; scores is scratch of G * L, kf of BS * D.
// Each block's rows are converted once. DC is the head dim when known at compile time (64,
// 128: the loops over d unroll and a head's value accumulator stays in registers for a whole
// block; without that it went through memory for every key, a store-to-load chain that cost
// 3x), or 0 for any other head dim (read from D).
// `start` > 0 (a sliding window): keys before token `start` are not seen (their blocks are
// skipped; the first block's earlier rows get probability 0); `softcap` > 0: each score (q
// already scaled) becomes softcap * tanh(score / softcap) before the softmax (Gemma 2). With
// start 0 and softcap 0 the arithmetic is the plain one, step for step. On AVX-512, head dims
// 64 and 128 take attend_fused (one pass, below) instead; this loop serves the rest.
typedef float vf16 __attribute__((vector_size(64)));  // GCC/Clang vectors: AVX-512, or split for AVX2

// An 8-bit pool's slot (backends/torch_backend.py QuantizedKV): int8 or float8_e4m3fn data
// and one bfloat16 scale per token per head; its value is data * scale computed in the model
// dtype R, as the torch path's dequantisation (data.to(R) * scale.to(R)) rounds it. Both
// conversions to R are exact (|int8| <= 127, e4m3's 3 mantissa bits), so the only rounding is
// the product's: float32 then rounded to R, which is what R's multiply does.
// float8_e4m3fn to float32 on the bits, so the loop vectorises: a normal code's exponent and
// mantissa bits (the 7 below the sign) moved to a float32's and rebiased from e4m3's 7 to 127
// by adding 120 to the exponent field; a subnormal one (exponent field 0) is its mantissa times
// 2^-9, computed as a float; then the sign. Exact for every finite value (the pools hold no
// NaN: writes clamp to +-448). (Reading the bits as a float32 and multiplying by 2^120 gives
// the same values, but through float32 subnormals, which cost a microcode assist per
// instruction: 2.6x the int8 pool's time.)
static inline float fp8_e4m3_to_float(uint8_t raw) {
  const uint32_t bits = raw & 0x7f;
  const float magnitude = bits >= 8 ? std::bit_cast<float>((bits << 20) + (120u << 23))
                                    : static_cast<float>(bits) * 0x1p-9f;
  return std::bit_cast<float>(std::bit_cast<uint32_t>(magnitude) | (static_cast<uint32_t>(raw & 0x80) << 24));
}

#if defined(__AVX512F__)
// round_to for 16 lanes (finite x): bfloat16 by the same integer rounding, float16 by the
// conversion instruction (round to nearest even), float32 as it is
template <typename R>
static inline __m512 round_to16(__m512 x) {
  if constexpr (std::is_same_v<R, float>) {
    return x;
  } else if constexpr (std::is_same_v<R, c10::BFloat16>) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}
#endif

#if defined(__AVX512F__)
// 16 values of a pool row as float32: a plain pool's (S == R) exactly; an 8-bit pool's as
// dequant_row gives them (data * scale in float32, rounded to R), lane for lane.
template <typename S, typename R>
static inline __m512 load16(const S* src, __m512 scale) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_loadu_ps(src);
  } else if constexpr (std::is_same_v<S, c10::BFloat16>) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16));
  } else if constexpr (std::is_same_v<S, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    __m512 x;
    if constexpr (std::is_same_v<S, int8_t>) {
      x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
    } else {  // fp8_e4m3_to_float, 16 lanes
      const __m512i b = _mm512_cvtepu8_epi32(raw);
      const __m512i bits = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
      const __m512 normal = _mm512_castsi512_ps(
          _mm512_add_epi32(_mm512_slli_epi32(bits, 20), _mm512_set1_epi32(120 << 23)));
      const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(bits), _mm512_set1_ps(0x1p-9f));
      const __m512 magnitude =
          _mm512_mask_blend_ps(_mm512_cmpge_epu32_mask(bits, _mm512_set1_epi32(8)), subnormal, normal);
      x = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude),
                                              _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24)));
    }
    return round_to16<R>(_mm512_mul_ps(x, scale));
  }
}
#endif

template <typename S, typename R>
static inline void dequant_row(const S* __restrict__ src, float scale, float* __restrict__ dst, int64_t n) {
  int64_t d0 = 0;
#if defined(__AVX512F__)
  // 16 a step in full-width registers, the arithmetic of the loops below lane for lane (the
  // compiler's own vectorisation of them, 8 lanes wide, left an 8-bit pool's decode attention
  // no faster than a bfloat16 pool's with half its bytes)
  const __m512 sv = _mm512_set1_ps(scale);
  for (; d0 + 16 <= n; d0 += 16) _mm512_storeu_ps(dst + d0, load16<S, R>(src + d0, sv));
#endif
  if constexpr (std::is_same_v<S, int8_t>) {
#pragma omp simd
    for (int64_t d = d0; d < n; ++d) dst[d] = round_to<R>(static_cast<float>(src[d]) * scale);
  } else {
    const uint8_t* __restrict__ raw = reinterpret_cast<const uint8_t*>(src);
#pragma omp simd
    for (int64_t d = d0; d < n; ++d) dst[d] = round_to<R>(fp8_e4m3_to_float(raw[d]) * scale);
  }
}

// The n keys (or values) from token t0 of KV head g as float32 rows in kf: block j of a block
// table, or (SLOTS) entries t0.. of a list of flat slots (block * BS + offset), row by row.
// The conversion is exact, so both give the same kf for the same tokens. S is the pool's
// dtype, R the model's: S == R is a plain pool (`sc` unused), else an 8-bit one with its
// scales `sc` [KVH, NB, BS] (see dequant_row).
template <typename S, typename R, bool SLOTS>
static inline void load_rows(const S* base, const c10::BFloat16* sc, int64_t g, int64_t NB, int64_t BS, int64_t D,
                             const int64_t* table, int64_t j, int64_t t0, int64_t n, float* kf) {
  if constexpr (std::is_same_v<S, R>) {
    if constexpr (SLOTS) {
      for (int64_t o = 0; o < n; ++o) row_to_float(base + (g * NB * BS + table[t0 + o]) * D, kf + o * D, D);
    } else {
      row_to_float(base + (g * NB + table[j]) * BS * D, kf, n * D);
    }
  } else {
    for (int64_t o = 0; o < n; ++o) {
      const int64_t slot = SLOTS ? g * NB * BS + table[t0 + o] : (g * NB + table[j]) * BS + o;
      dequant_row<S, R>(base + slot * D, static_cast<float>(sc[slot]), kf + o * D, D);
    }
  }
}

// Asks for block j of a block table (its n rows, and an 8-bit pool's n scales) to be brought
// into the cache while the block before it is computed: a sequence's blocks lie wherever the
// allocator put them, so the hardware prefetcher, which follows one address stream, restarts at
// every block (2-4 KB); at 64 contexts of ~270 keys, whose K and V outgrow the caches, the
// decode attention took 1.4x as long over shuffled blocks as over consecutive ones without it.
template <typename S, bool SLOTS>
static inline void prefetch_block(const S* base, const c10::BFloat16* sc, int64_t g, int64_t NB, int64_t BS,
                                  int64_t D, const int64_t* table, int64_t j, int64_t n) {
  if constexpr (!SLOTS) {
    const char* p = reinterpret_cast<const char*>(base + (g * NB + table[j]) * BS * D);
    for (int64_t b = 0; b < n * D * static_cast<int64_t>(sizeof(S)); b += 64) __builtin_prefetch(p + b);
    if (sc != nullptr) __builtin_prefetch(sc + (g * NB + table[j]) * BS);
  }
}

// `table`: the sequence's block table, or (SLOTS) its list of key slots; either way the keys are
// taken in groups of BS in order, so a token list gives the arithmetic of the blocks it spells.
template <typename S, typename R, int DC, bool SLOTS = false>
static void attend_impl(const float* qf, const S* kp, const S* vp, const c10::BFloat16* ks, const c10::BFloat16* vs,
                        int64_t g, int64_t NB, int64_t BS, int64_t Drt, const int64_t* table, int64_t L, int64_t G,
                        std::vector<float>& scores, float* kf, float* acc, int64_t start, float softcap) {
  const int64_t D = DC > 0 ? DC : Drt;
  const int64_t j0 = start / BS;  // the first block with a visible key
  scores.resize(G * L);
  for (int64_t j = j0, t0 = j0 * BS; t0 < L; ++j, t0 += BS) {
    const int64_t n = L - t0 < BS ? L - t0 : BS;
    if (t0 + BS < L) prefetch_block<S, SLOTS>(kp, ks, g, NB, BS, D, table, j + 1, L - t0 - BS < BS ? L - t0 - BS : BS);
    else prefetch_block<S, SLOTS>(vp, vs, g, NB, BS, D, table, j0, L - j0 * BS < BS ? L - j0 * BS : BS);
    load_rows<S, R, SLOTS>(kp, ks, g, NB, BS, D, table, j, t0, n, kf);
    for (int64_t h = 0; h < G; ++h) {
      const float* __restrict__ qh = qf + h * D;
      float* sh = scores.data() + h * L + t0;
      int64_t o = 0;
      for (; o + 4 <= n; o += 4) {  // four keys a pass: the reductions' latencies overlap
        const float* __restrict__ k0 = kf + o * D;
        const float* __restrict__ k1 = k0 + D;
        const float* __restrict__ k2 = k1 + D;
        const float* __restrict__ k3 = k2 + D;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qh[d];
          s0 += qd * k0[d];
          s1 += qd * k1[d];
          s2 += qd * k2[d];
          s3 += qd * k3[d];
        }
        sh[o] = s0;
        sh[o + 1] = s1;
        sh[o + 2] = s2;
        sh[o + 3] = s3;
      }
      for (; o < n; ++o) {
        const float* __restrict__ kr = kf + o * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qh[d] * kr[d];
        sh[o] = s;
      }
    }
  }
  for (int64_t h = 0; h < G; ++h) {  // softmax over [start, L); each loop a plain one the compiler vectorises
    float* __restrict__ sh = scores.data() + h * L;
    if (softcap > 0.f) {
      for (int64_t t = start; t < L; ++t) sh[t] = softcap * std::tanh(sh[t] / softcap);
    }
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t t = start; t < L; ++t) m = sh[t] > m ? sh[t] : m;
#pragma omp simd
    for (int64_t t = start; t < L; ++t) sh[t] = vec_exp(sh[t] - m);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = start; t < L; ++t) sum += sh[t];
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = start; t < L; ++t) sh[t] *= inv;
    for (int64_t t = j0 * BS; t < start; ++t) sh[t] = 0.f;  // the first block's rows before the window
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t j = j0, t0 = j0 * BS; t0 < L; ++j, t0 += BS) {
    const int64_t n = L - t0 < BS ? L - t0 : BS;
    if (t0 + BS < L) prefetch_block<S, SLOTS>(vp, vs, g, NB, BS, D, table, j + 1, L - t0 - BS < BS ? L - t0 - BS : BS);
    load_rows<S, R, SLOTS>(vp, vs, g, NB, BS, D, table, j, t0, n, kf);
    for (int64_t h = 0; h < G; ++h) {
      const float* __restrict__ ph = scores.data() + h * L + t0;
      float* __restrict__ ah = acc + h * D;
      if constexpr (DC > 0) {  // the head's accumulator in DC / 16 vector registers for the block
        constexpr int NV = DC / 16;
        vf16 a[NV];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) std::memcpy(&a[v], ah + 16 * v, sizeof(vf16));
        for (int64_t o = 0; o < n; ++o) {
          const float p = ph[o];
          const float* __restrict__ vr = kf + o * DC;
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) {
            vf16 x;
            std::memcpy(&x, vr + 16 * v, sizeof(vf16));
            a[v] += p * x;
          }
        }
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) std::memcpy(ah + 16 * v, &a[v], sizeof(vf16));
      } else {
        for (int64_t o = 0; o < n; ++o) {
          const float p = ph[o];
          const float* __restrict__ vr = kf + o * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ah[d] += p * vr[d];
        }
      }
    }
  }
}

#if defined(__AVX512F__)
// vec_exp (common.h) for 16 lanes: the same clamp, range reduction and polynomial
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3365f)), _mm512_set1_ps(88.7228f));
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic), magic);
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// The four lane sums of s4[0..3], in one shuffle tree (four keys' scores at once)
static inline __m128 sum4(const __m512 s4[4]) {
  const __m512 a01 = _mm512_add_ps(_mm512_unpacklo_ps(s4[0], s4[1]), _mm512_unpackhi_ps(s4[0], s4[1]));
  const __m512 a23 = _mm512_add_ps(_mm512_unpacklo_ps(s4[2], s4[3]), _mm512_unpackhi_ps(s4[2], s4[3]));
  const __m512 b = _mm512_add_ps(_mm512_shuffle_ps(a01, a23, 0x44), _mm512_shuffle_ps(a01, a23, 0xEE));
  const __m256 c = _mm256_add_ps(_mm512_castps512_ps256(b),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}

// Where a key row of the pool lies (and its 8-bit scale's index): row o of block j of a block
// table, or (SLOTS) entry t0 + o of a list of flat slots.
template <bool SLOTS>
static inline int64_t row_slot(int64_t g, int64_t NB, int64_t BS, const int64_t* table, int64_t j, int64_t t0,
                               int64_t o) {
  return SLOTS ? g * NB * BS + table[t0 + o] : (g * NB + table[j]) * BS + o;
}

// acc[h] += sum_o p[h][o] * v_o for HB heads at once (their DC-wide accumulators in registers
// for the whole block, each value row read and converted once per HB heads)
template <int HB, int DC, typename S, typename R, bool SLOTS>
static inline void accumulate_values(float* acc, const float* p, int64_t pstride, const S* vp,
                                     const c10::BFloat16* vs, int64_t g, int64_t NB, int64_t BS,
                                     const int64_t* table, int64_t j, int64_t t0, int64_t n) {
  constexpr int NV = DC / 16;
  __m512 a[HB][NV];
  for (int h = 0; h < HB; ++h)
    for (int v = 0; v < NV; ++v) a[h][v] = _mm512_loadu_ps(acc + h * DC + 16 * v);
  for (int64_t o = 0; o < n; ++o) {
    const int64_t slot = row_slot<SLOTS>(g, NB, BS, table, j, t0, o);
    const __m512 sv = _mm512_set1_ps(vs != nullptr ? static_cast<float>(vs[slot]) : 1.f);
    __m512 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load16<S, R>(vp + slot * DC + 16 * v, sv);
    for (int h = 0; h < HB; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * pstride + o]);
      for (int v = 0; v < NV; ++v) a[h][v] = _mm512_fmadd_ps(ph, x[v], a[h][v]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + h * DC + 16 * v, a[h][v]);
}

// attend_impl in one pass over the keys, for head dims 64 and 128 on AVX-512: each block's K
// and V rows are read together and converted in registers (no float32 copy of the block), the
// scores of the block's keys softmaxed online (flash-decoding: a running max and sum per head,
// the accumulators rescaled when the max grows). The same function of q and the keys as
// attend_impl up to float32 rounding (the sums' order differs); deterministic per query, so
// still independent of what else a step holds. At 64 contexts of 208 keys it took 0.8x the
// time of the two-pass loop (docs/benchmarks.md).
template <typename S, typename R, int DC, bool SLOTS>
static void attend_fused(const float* qf, const S* kp, const S* vp, const c10::BFloat16* ks, const c10::BFloat16* vs,
                         int64_t g, int64_t NB, int64_t BS, const int64_t* table, int64_t L, int64_t G,
                         std::vector<float>& scratch, float* acc, int64_t start, float softcap) {
  constexpr int NV = DC / 16;
  constexpr int HB = 16 / NV;  // heads whose value accumulators fit in 16 registers
  const int64_t j0 = start / BS;
  scratch.resize(G * BS + 2 * G);
  float* sc = scratch.data();  // [G][BS]: this block's scores, then probabilities
  float* mx = sc + G * BS;     // each head's running max
  float* sum = mx + G;         // and its running sum of exp(score - max)
  for (int64_t h = 0; h < G; ++h) mx[h] = -INFINITY, sum[h] = 0.f;
  std::fill(acc, acc + G * DC, 0.f);
  for (int64_t j = j0, t0 = j0 * BS; t0 < L; ++j, t0 += BS) {
    const int64_t n = L - t0 < BS ? L - t0 : BS;
    if (t0 + BS < L) {  // the next block's K and V rows, while this one is computed
      const int64_t next = L - t0 - BS < BS ? L - t0 - BS : BS;
      prefetch_block<S, SLOTS>(kp, ks, g, NB, BS, DC, table, j + 1, next);
      prefetch_block<S, SLOTS>(vp, vs, g, NB, BS, DC, table, j + 1, next);
    }
    // scores: four keys a pass, their G x 4 sums each in one shuffle tree
    int64_t o = 0;
    for (; o + 4 <= n; o += 4) {
      __m512 k[4][NV];
      for (int i = 0; i < 4; ++i) {
        const int64_t slot = row_slot<SLOTS>(g, NB, BS, table, j, t0, o + i);
        const __m512 sv = _mm512_set1_ps(ks != nullptr ? static_cast<float>(ks[slot]) : 1.f);
        for (int v = 0; v < NV; ++v) k[i][v] = load16<S, R>(kp + slot * DC + 16 * v, sv);
      }
      for (int64_t h = 0; h < G; ++h) {
        const float* qh = qf + h * DC;
        __m512 s4[4];
        for (int i = 0; i < 4; ++i) {
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), k[i][0]);
          for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * v), k[i][v], a);
          s4[i] = a;
        }
        _mm_storeu_ps(sc + h * BS + o, sum4(s4));
      }
    }
    for (; o < n; ++o) {
      const int64_t slot = row_slot<SLOTS>(g, NB, BS, table, j, t0, o);
      const __m512 sv = _mm512_set1_ps(ks != nullptr ? static_cast<float>(ks[slot]) : 1.f);
      __m512 k[NV];
      for (int v = 0; v < NV; ++v) k[v] = load16<S, R>(kp + slot * DC + 16 * v, sv);
      for (int64_t h = 0; h < G; ++h) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qf + h * DC), k[0]);
        for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + h * DC + 16 * v), k[v], a);
        sc[h * BS + o] = _mm512_reduce_add_ps(a);
      }
    }
    // online softmax, 16 scores a step: keys before `start` (the first block's, under a
    // window) get probability 0
    const int64_t o0 = t0 < start ? start - t0 : 0;
    for (int64_t h = 0; h < G; ++h) {
      float* sh = sc + h * BS;
      if (softcap > 0.f) {
        for (int64_t t = o0; t < n; ++t) sh[t] = softcap * std::tanh(sh[t] / softcap);
      }
      __m512 mv = _mm512_set1_ps(mx[h]);
      for (int64_t t = o0; t < n; t += 16) {
        const __mmask16 lanes = n - t >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - t)) - 1);
        mv = _mm512_mask_max_ps(mv, lanes, mv, _mm512_maskz_loadu_ps(lanes, sh + t));
      }
      const float m = _mm512_reduce_max_ps(mv);
      const float rescale = mx[h] == -INFINITY ? 0.f : vec_exp(mx[h] - m);
      mx[h] = m;
      __m512 sv = _mm512_setzero_ps();
      for (int64_t t = o0; t < n; t += 16) {
        const __mmask16 lanes = n - t >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - t)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, sh + t), _mm512_set1_ps(m)));
        _mm512_mask_storeu_ps(sh + t, lanes, e);
        sv = _mm512_mask_add_ps(sv, lanes, sv, e);
      }
      for (int64_t t = 0; t < o0; ++t) sh[t] = 0.f;
      sum[h] = sum[h] * rescale + _mm512_reduce_add_ps(sv);
      if (rescale != 1.f) {
        const __m512 r = _mm512_set1_ps(rescale);
        for (int v = 0; v < NV; ++v)
          _mm512_storeu_ps(acc + h * DC + 16 * v, _mm512_mul_ps(r, _mm512_loadu_ps(acc + h * DC + 16 * v)));
      }
    }
    // values: up to HB heads at a time
    for (int64_t h = 0; h < G; h += HB) {
      float* ah = acc + h * DC;
      const float* ph = sc + h * BS;
      switch (G - h < HB ? G - h : HB) {
        case 1: accumulate_values<1, DC, S, R, SLOTS>(ah, ph, BS, vp, vs, g, NB, BS, table, j, t0, n); break;
        case 2: accumulate_values<2, DC, S, R, SLOTS>(ah, ph, BS, vp, vs, g, NB, BS, table, j, t0, n); break;
        case 3: accumulate_values<3, DC, S, R, SLOTS>(ah, ph, BS, vp, vs, g, NB, BS, table, j, t0, n); break;
        default: accumulate_values<HB, DC, S, R, SLOTS>(ah, ph, BS, vp, vs, g, NB, BS, table, j, t0, n);
      }
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[h]);
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_ps(acc + h * DC + 16 * v, _mm512_mul_ps(inv, _mm512_loadu_ps(acc + h * DC + 16 * v)));
  }
}
#endif

// S: the pools' dtype; R: the model's (S == R: plain pools, ks and vs null; else 8-bit pools and their scales)
template <typename S, typename R, bool SLOTS = false>
static void attend(const float* qf, const S* kp, const S* vp, const c10::BFloat16* ks, const c10::BFloat16* vs,
                   int64_t g, int64_t NB, int64_t BS, int64_t D, const int64_t* table, int64_t L, int64_t G,
                   std::vector<float>& scores, float* kf, float* acc, int64_t start = 0, float softcap = 0.f) {
#if defined(__AVX512F__)
  if (D == 64)
    return attend_fused<S, R, 64, SLOTS>(qf, kp, vp, ks, vs, g, NB, BS, table, L, G, scores, acc, start, softcap);
  if (D == 128)
    return attend_fused<S, R, 128, SLOTS>(qf, kp, vp, ks, vs, g, NB, BS, table, L, G, scores, acc, start, softcap);
#endif
  if (D == 64)
    return attend_impl<S, R, 64, SLOTS>(qf, kp, vp, ks, vs, g, NB, BS, D, table, L, G, scores, kf, acc, start, softcap);
  if (D == 128)
    return attend_impl<S, R, 128, SLOTS>(qf, kp, vp, ks, vs, g, NB, BS, D, table, L, G, scores, kf, acc, start, softcap);
  attend_impl<S, R, 0, SLOTS>(qf, kp, vp, ks, vs, g, NB, BS, D, table, L, G, scores, kf, acc, start, softcap);
}

// The pools as the ops take them: plain (k_scale, v_scale absent; the caches in the model
// dtype) or 8-bit (int8 or float8_e4m3fn caches, each with its bfloat16 scales [KVH, NB, BS]).
struct Pools {
  at::Tensor k, v;
  c10::BFloat16* ks = nullptr;  // (the fused layer writes the new token's scales through them)
  c10::BFloat16* vs = nullptr;
  at::ScalarType storage;  // the caches' dtype

  Pools(const at::Tensor& k_cache, const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
        const c10::optional<at::Tensor>& v_scale, at::ScalarType model)
      : k(k_cache), v(v_cache), storage(k_cache.scalar_type()) {
    TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "k_scale and v_scale: both or neither");
    if (!k_scale) {
      TORCH_CHECK(storage == model, "plain caches must be in the model dtype (q's)");
      return;
    }
    TORCH_CHECK(storage == at::kChar || storage == at::kFloat8_e4m3fn, "8-bit caches must be int8 or float8_e4m3fn");
    for (const auto* t : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->dim() == 3 &&
                  t->sizes() == k_cache.sizes().slice(0, 3), "scales: contiguous bfloat16 [KVH, NB, BS]");
    }
    ks = k_scale->data_ptr<c10::BFloat16>();
    vs = v_scale->data_ptr<c10::BFloat16>();
  }
};

// fn.template operator()<S>() with S the pools' storage type (R, the model's, when plain).
template <typename R, typename F>
static void with_storage(const Pools& p, F&& fn) {
  if (p.ks == nullptr) return fn.template operator()<R>();
  if (p.storage == at::kChar) return fn.template operator()<int8_t>();
  fn.template operator()<c10::Float8_e4m3fn>();
}

// The first key a query with `L` keys before and including it sees under a sliding window
// of `window` tokens (0: no window): keys at positions > L - 1 - window.
static inline int64_t window_start(int64_t L, int64_t window) {
  return window > 0 && L > window ? L - window : 0;
}

// Small work (batch 1, a short context) runs on the calling thread: a parallel region costs more.
static int64_t grain_for(const int64_t* lens, int64_t B, int64_t KVH, int64_t D) {
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += lens[b];
  return work * KVH * D < (1 << 16) ? B * KVH : 1;
}

static void check_common(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t rows) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [KVH, NB, BS, D] alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous(), "contiguous tables");
  TORCH_CHECK(block_tables.size(0) == rows && context_lens.numel() == rows, "one table and length per row");
}

// q [B, H, D]; block_tables [B, MB]; context_lens [B] -> [B, H, D] like q. `window` > 0: each row
// sees its last `window` keys only; `softcap` > 0: scores soft-capped (see attend_impl).
inline at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                         at::Tensor block_tables, at::Tensor context_lens, double scale,
                                         int64_t window = 0, double softcap = 0.0,
                                         c10::optional<at::Tensor> k_scale = c10::nullopt,
                                         c10::optional<at::Tensor> v_scale = c10::nullopt) {
  RECORD_FUNCTION("tokenloom::paged_decode_attention", std::vector<c10::IValue>());  // (seen by torch.profiler)
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, D]");
  const Pools pools(k_cache, v_cache, k_scale, v_scale, q.scalar_type());
  check_common(k_cache, v_cache, block_tables, context_lens, q.size(0));
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(2) == k_cache.size(3), "head counts or sizes disagree");
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2), G = H / KVH;
  const int64_t MB = block_tables.size(1);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    with_storage<scalar_t>(pools, [&]<typename S>() {
      const scalar_t* qp = qc.data_ptr<scalar_t>();
      const S* kp = static_cast<const S*>(k_cache.data_ptr());
      const S* vp = static_cast<const S*>(v_cache.data_ptr());
      scalar_t* op = out.data_ptr<scalar_t>();
      at::parallel_for(0, B * KVH, grain_for(lens, B, KVH, D), [&](int64_t begin, int64_t end) {
        std::vector<float> qf(G * D), acc(G * D), scores, kf(BS * D);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t b = i / KVH, g = i % KVH;
          row_to_float(qp + (b * H + g * G) * D, qf.data(), G * D);
          for (auto& x : qf) x *= static_cast<float>(scale);
          attend<S, scalar_t>(qf.data(), kp, vp, pools.ks, pools.vs, g, NB, BS, D, bt + b * MB, lens[b], G, scores,
                              kf.data(), acc.data(), window_start(lens[b], window), static_cast<float>(softcap));
          for (int64_t x = 0; x < G * D; ++x) op[(b * H + g * G) * D + x] = static_cast<scalar_t>(acc[x]);
        }
      });
    });
  });
  return out;
}

// One K or V row of the model dtype into an 8-bit pool's slot, with the arithmetic of
// QuantizedKV.quantize (backends/torch_backend.py), so either writer stores the same bytes:
// scale = max(amax(|x|) / qmax, bfloat16's tiny), rounded to bfloat16; data = x / scale (by the
// rounded scale), rounded half to even for int8, clamped to +-qmax (127; 448 for e4m3) and cast.
template <typename R, typename S>
static inline void quantize_row(const R* x, int64_t D, S* data, c10::BFloat16* scale) {
  constexpr float qmax = std::is_same_v<S, int8_t> ? 127.f : 448.f;
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::abs(static_cast<float>(x[d])));
  const c10::BFloat16 s(std::max(amax / qmax, std::numeric_limits<float>::min()));
  *scale = s;
  const float sf = static_cast<float>(s);
  for (int64_t d = 0; d < D; ++d) {
    float v = static_cast<float>(x[d]) / sf;
    if constexpr (std::is_same_v<S, int8_t>) v = std::nearbyint(v);
    v = std::min(std::max(v, -qmax), qmax);
    data[d] = static_cast<S>(v);
  }
}

// A decode layer's attention from its fused qkv projection, in one call: RoPE (rotate-half,
// float32, as the model computes it) on q and k, k and v written to their cache slots (in
// the cache's dtype), attention over each context including the new token. qkv [B, (H + 2 KVH) D];
// cos, sin [B, D] float32; slots [B]. Returns [B, H * D] in qkv's dtype.
inline at::Tensor decode_layer_attention(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                                         at::Tensor v_cache, at::Tensor slots, at::Tensor block_tables,
                                         at::Tensor context_lens, int64_t num_heads, double scale,
                                         c10::optional<at::Tensor> k_scale = c10::nullopt,
                                         c10::optional<at::Tensor> v_scale = c10::nullopt) {
  RECORD_FUNCTION("tokenloom::decode_layer_attention", std::vector<c10::IValue>());
  const int64_t B = qkv.size(0), KVH = k_cache.size(0), D = k_cache.size(3), H = num_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * KVH) * D, "qkv must be [B, (H + 2 KVH) D]");
  const Pools pools(k_cache, v_cache, k_scale, v_scale, qkv.scalar_type());
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.size(-1) == D, "float32 cos/sin [B, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B, "one int64 slot per row");
  check_common(k_cache, v_cache, block_tables, context_lens, B);
  auto x = qkv.contiguous();
  auto c = cos.reshape({B, D}).contiguous(), s = sin.reshape({B, D}).contiguous();
  auto out = at::empty({B, H * D}, qkv.options());
  const int64_t NB = k_cache.size(1), BS = k_cache.size(2), G = H / KVH, MB = block_tables.size(1);
  const int64_t half = D / 2, W = (H + 2 * KVH) * D;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "decode_layer_attention", [&] {
   with_storage<scalar_t>(pools, [&]<typename S>() {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    S* kp = static_cast<S*>(k_cache.data_ptr());
    S* vp = static_cast<S*>(v_cache.data_ptr());
    scalar_t* op = out.data_ptr<scalar_t>();
    // rotate-half RoPE of one head: y = x * cos + rot(x) * sin, rot(x) = (-x[half:], x[:half]);
    // rounded to the cache dtype, as the model's q.to(dtype) / k.to(dtype) do
    auto rope = [&](const scalar_t* in, const float* cs, const float* sn, scalar_t* dst) {
      for (int64_t d = 0; d < D; ++d) {
        const float xv = static_cast<float>(in[d]);
        const float rv = d < half ? -static_cast<float>(in[d + half]) : static_cast<float>(in[d - half]);
        dst[d] = static_cast<scalar_t>(xv * cs[d] + rv * sn[d]);
      }
    };
    // 1. every row's new k, v into the cache (before any attention reads them); into an 8-bit
    // pool quantised from the model-dtype row as QuantizedKV.quantize does it
    std::vector<scalar_t> krow(D);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t blk = sl[b] / BS, off = sl[b] % BS;
      for (int64_t g = 0; g < KVH; ++g) {
        const int64_t slot = (g * NB + blk) * BS + off;
        const scalar_t* vsrc = xp + b * W + (H + KVH + g) * D;
        if constexpr (std::is_same_v<S, scalar_t>) {
          rope(xp + b * W + (H + g) * D, cp + b * D, sp + b * D, kp + slot * D);
          std::copy(vsrc, vsrc + D, vp + slot * D);
        } else {
          rope(xp + b * W + (H + g) * D, cp + b * D, sp + b * D, krow.data());
          quantize_row(krow.data(), D, kp + slot * D, pools.ks + slot);
          quantize_row(vsrc, D, vp + slot * D, pools.vs + slot);
        }
      }
    }
    // 2. attention per (row, KV head)
    at::parallel_for(0, B * KVH, grain_for(lens, B, KVH, D), [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> qr(G * D);
      std::vector<float> qf(G * D), acc(G * D), scores, kf(BS * D);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / KVH, g = i % KVH;
        for (int64_t h = 0; h < G; ++h)
          rope(xp + b * W + (g * G + h) * D, cp + b * D, sp + b * D, qr.data() + h * D);
        row_to_float(qr.data(), qf.data(), G * D);
        for (auto& v : qf) v *= static_cast<float>(scale);
        attend<S, scalar_t>(qf.data(), kp, vp, pools.ks, pools.vs, g, NB, BS, D, bt + b * MB, lens[b], G, scores,
                            kf.data(), acc.data());
        for (int64_t e = 0; e < G * D; ++e) op[b * H * D + g * G * D + e] = static_cast<scalar_t>(acc[e]);
      }
    });
   });
  });
  return out;
}

// Attention of each query over its own list of key slots, with the arithmetic of the decode
// attention above: the batch-invariant mode (backends/torch_backend.py) runs every query of a
// step through it, decode rows, prompt chunks and draft (tree) rows alike, so a query's result
// depends on its q and the keys it sees, never on what else the step holds or on where a
// prompt was split. q [T, H, D]; slot_rows [R, W] int64 flat slots (block * BS + offset);
// q_row, q_len [T] int64: query t attends to the first q_len[t] slots of row q_row[t] (a
// prompt's queries share one row, each with its causal length). A row's entry i holds the
// key at position i (a tree node's row too: the context, then its ancestors by depth), so
// `window` > 0 keeps entries from q_len[t] - window on; `softcap` as in paged_decode_attention.
// Returns [T, H, D] like q.
inline at::Tensor slot_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_rows,
                                 at::Tensor q_row, at::Tensor q_len, double scale, int64_t window = 0,
                                 double softcap = 0.0) {
  RECORD_FUNCTION("tokenloom::slot_attention", std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == k_cache.scalar_type(), "q [T, H, D] in the caches' dtype");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [KVH, NB, BS, D] alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "contiguous caches of one dtype");
  TORCH_CHECK(slot_rows.dim() == 2 && slot_rows.scalar_type() == at::kLong && slot_rows.is_contiguous(),
              "slot_rows: contiguous int64 [R, W]");
  TORCH_CHECK(q_row.scalar_type() == at::kLong && q_len.scalar_type() == at::kLong && q_row.is_contiguous() &&
              q_len.is_contiguous() && q_row.numel() == q.size(0) && q_len.numel() == q.size(0),
              "q_row, q_len: contiguous int64 [T]");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(2) == k_cache.size(3), "head counts or sizes disagree");
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2), G = H / KVH;
  const int64_t R = slot_rows.size(0), W = slot_rows.size(1);
  const int64_t* rows = q_row.data_ptr<int64_t>();
  const int64_t* lens = q_len.data_ptr<int64_t>();
  const int64_t* sp = slot_rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(rows[t] >= 0 && rows[t] < R && lens[t] >= 1 && lens[t] <= W, "query ", t, ": row ", rows[t],
                " / length ", lens[t], " outside slot_rows [", R, ", ", W, "]");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "slot_attention", [&] {
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T * KVH, grain_for(lens, T, KVH, D), [&](int64_t begin, int64_t end) {
      std::vector<float> qf(G * D), acc(G * D), scores, kf(BS * D);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / KVH, g = i % KVH;
        row_to_float(qp + (t * H + g * G) * D, qf.data(), G * D);
        for (auto& x : qf) x *= static_cast<float>(scale);
        attend<scalar_t, scalar_t, true>(qf.data(), kp, vp, nullptr, nullptr, g, NB, BS, D, sp + rows[t] * W,
                                         lens[t], G, scores, kf.data(), acc.data(), window_start(lens[t], window),
                                         static_cast<float>(softcap));
        for (int64_t x = 0; x < G * D; ++x) op[(t * H + g * G) * D + x] = static_cast<scalar_t>(acc[x]);
      }
    });
  });
  return out;
}
