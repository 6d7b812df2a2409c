// The activation rows of the block-quantized projection (quant_gemv.cpp) rounded to int8
// per block of 32 as llama.cpp's Q8 does (d = max|x| / 127, q = round(x / d)): the codes
// every engine multiplies (quant_product.h's tiles, quant_lanes.h's 8 lanes and scalar loop).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "quant_part.h"

namespace activations {

// x (n, in) -> xq (n, in) int8, xd (n, in/QB) scales, xs (n, in/QB) = xd * sum(q) per block,
// xz (n, in/QB) -zero * sum(q) where asked (zero 8's integer term: sum (q - 8) x = sum q x + xz),
// and xp (n, in): xq with each pair of blocks (2p, 2p+1) as the 4-bit kernel reads them,
// [first halves of 2p and 2p+1 | second halves of 2p and 2p+1] (an odd last block stays).
// One block of 32: its codes into q, returns their sum; *d its scale.
inline int quantize_block(const float* v, int8_t* q, float* d) {
#if defined(__AVX2__)
  // The scalar loop's arithmetic, 8 lanes at a time: the same max, the same products, and
  // cvtps rounds half to even as nearbyint does (the default rounding mode), so the same codes.
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v8[4], top = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) top = _mm256_max_ps(top, _mm256_and_ps(v8[j] = _mm256_loadu_ps(v + 8 * j), abs_mask));
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  const float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  *d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(*d != 0.0f ? 1.0f / *d : 0.0f);
  __m256i i32[4], sum = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) sum = _mm256_add_epi32(sum, i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v8[j], id)));
  // |codes| <= 127: the saturating packs keep them; packs interleave 128-bit lanes, the permute restores the order.
  const __m256i i16 = _mm256_packs_epi32(i32[0], i32[1]), j16 = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16, j16), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i8);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
#else
  float amax = 0.0f;
  for (int i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(v[i]));
  *d = amax / 127.0f;
  const float id = *d != 0.0f ? 1.0f / *d : 0.0f;
  int sum = 0;
  for (int i = 0; i < QB; ++i) {
    q[i] = int8_t(int(std::nearbyint(v[i] * id)));  // round half to even, as cvtps does
    sum += q[i];
  }
  return sum;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// quantize_block's arithmetic on a row's blocks (in / 32 <= 1024): its maxima two blocks
// to a vector (each 256-bit half one block's, reduced in the same order), its divisions
// 16 blocks at a time, each block's codes in two vectors; the same values, fewer instructions.
inline void quantize_row(const float* v, int64_t nb, int8_t* q, float* xd, float* xs, int64_t zero, int32_t* xz) {
  alignas(64) float amax[1024], inv[1024];
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m512 top = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const __m512 pair = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(v + b * QB + 8 * j)),
                                             _mm256_loadu_ps(v + (b + 1) * QB + 8 * j), 1);
      top = _mm512_max_ps(top, _mm512_and_ps(pair, abs_mask));
    }
    __m512 t = _mm512_max_ps(top, _mm512_shuffle_f32x4(top, top, 0xB1));  // 128-bit lanes 1, 0, 3, 2
    t = _mm512_max_ps(t, _mm512_permute_ps(t, 0xEE));                     // movehl in each 128-bit lane
    t = _mm512_max_ps(t, _mm512_movehdup_ps(t));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, t);
    amax[b] = lanes[0], amax[b + 1] = lanes[8];
  }
  if (b < nb) amax[b] = 0.0f;  // an odd last block: quantize_block takes it below
  for (int64_t k = 0; k < nb; k += 16) {
    const __mmask16 keep = __mmask16(nb - k >= 16 ? 0xFFFF : (1u << (nb - k)) - 1);
    const __m512 d = _mm512_div_ps(_mm512_maskz_loadu_ps(keep, amax + k), _mm512_set1_ps(127.0f));
    const __mmask16 nonzero = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    _mm512_mask_storeu_ps(xd + k, keep, d);
    _mm512_mask_storeu_ps(inv + k, keep, _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0f), d));
  }
  for (int64_t c = 0; c < nb; ++c) {
    int sum;
    if (c == b) {  // the odd last block
      sum = quantize_block(v + c * QB, q + c * QB, xd + c);
    } else {
      const __m512 id = _mm512_set1_ps(inv[c]);
      const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + c * QB), id));
      const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + c * QB + 16), id));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c * QB), _mm512_cvtsepi32_epi8(lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c * QB + 16), _mm512_cvtsepi32_epi8(hi));
      sum = _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
    }
    xs[c] = xd[c] * float(sum);
    if (xz) xz[c] = -int32_t(zero) * sum;
  }
}
#endif

inline void quantize_rows(const float* x, int64_t x_stride, int64_t n, int64_t in, int8_t* xq, float* xd, float* xs,
                          int64_t zero, int32_t* xz, int8_t* xp) {
  const int64_t nb = in / QB;
  for (int64_t m = 0; m < n; ++m) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (nb <= 1024) {
      quantize_row(x + m * x_stride, nb, xq + m * in, xd + m * nb, xs + m * nb, zero, xz ? xz + m * nb : nullptr);
    } else
#endif
    {
      for (int64_t b = 0; b < nb; ++b) {
        const int sum = quantize_block(x + m * x_stride + b * QB, xq + m * in + b * QB, xd + m * nb + b);
        xs[m * nb + b] = xd[m * nb + b] * float(sum);
        if (xz) xz[m * nb + b] = -int32_t(zero) * sum;
      }
    }
    for (int64_t b = 0; xp && b < nb; ++b) {
      const int8_t* q = xq + m * in + b * QB;
      int8_t* y = xp + m * in + (b & ~int64_t(1)) * QB;
      if (b == nb - 1 && nb % 2) {
        std::copy(q, q + QB, y);
      } else {
        std::copy(q, q + 16, y + (b & 1) * 16);
        std::copy(q + 16, q + QB, y + 32 + (b & 1) * 16);
      }
    }
  }
}

}  // namespace activations
