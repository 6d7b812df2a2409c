// y = x W^T (+ bias) against a block-quantized weight, for any number of rows (a
// decode step's one, a prefill's thousands) on one path, so that a row's result
// never depends on the rows beside it: the weight stays as stored (4 or 8 bits a
// weight), and a decode step, bound by reading the weights, reads 4-8x fewer
// bytes than against fp32.
//
// The weight: row o holds in/32 blocks of 32 weights, weight i of a block
// = scale[group of i] * q[i] + offset[block] (ctxpar/layers/quant_blocks.py
// decodes every GGUF format into this form). q is stored
//   bits = 4: 16 bytes a block, q[i] in the low nibble of byte i (i < 16),
//             q[i] in the high nibble of byte i - 16 (i >= 16), q in 0..15;
//   bits = 8: 32 int8 a block.
// scales: (out, in / group), group 16 or 32; offsets (out, in / 32) or null (all
// zero); both float32, or both half (half.h) where the weight's values are halves.
// Each is read through strides (quant_part.h), so a GGUF file's blocks serve where
// they lie, and a fused projection is a list of such parts.
// zero: 0, or 8 for GGUF's Q4_0 as the file holds it (4 bits, groups of 32, no
// offsets): weight i = scale * (q[i] - 8). The AVX-512 paths (quant_product.h) take
// sum (q - 8) x in integers; the others add the offset term -8 * scale per block, as
// they would from an offsets array holding -8 * scale (the same floats: -8 is exact).
//
// The activation row is quantized per block of 32 to int8 the way llama.cpp's
// Q8 does (d = max|x| / 127, q = round(x / d)), so a block's product is one
// integer dot product of 32 bytes by 32 bytes:
//   sum_i w_i x_i ~= sum_g scale_g dx (sum_{i in g} q_i qx_i) + offset dx sum_i qx_i.
// AVX2 does it with maddubs (u8 x s8 pairs -> s16) and madd (-> s32); VNNI's
// dpbusd does both at once. Products cannot saturate s16: a 4-bit q times
// |qx| <= 127 twice is < 2^12, and the 8-bit path multiplies |q| <= 128 by
// |qx| <= 127 (llama.cpp's sign trick: maddubs(|q|, sign(qx, q))), twice
// 32512 < 32767. Without AVX2 (the library is built per CPU, -march=native) a
// scalar loop computes the same integers. With AVX-512 VNNI, quant_product.h takes
// every call instead (16 outputs a vector, AMX-INT8 for groups of 16 rows).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "half.h"
#include "quant_part.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "quant_product.h"  // every row count on these CPUs
#define CTXPAR_TILES 1
#endif

namespace {

constexpr int64_t QB = 32;  // weights per block
constexpr int MR = 4;       // activation rows per pass over a weight row (it stays in L1 between passes)
constexpr int LANE[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // AVX2, a scale a block: lane i of 8 blocks' vector holds block LANE[i]
constexpr int NR = 2;       // output rows a pass of the packed loop takes together (packed_rows)
constexpr int64_t PACKED_ROWS = 16;  // AVX2: rows from which packing the weights pays (packed_rows)
// and the fewest columns (measured on Zen 5): any with VNNI's dot products; with maddubs 4096,
// below which the direct loop is ~10% faster.
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr int64_t PACKED_COLS = 0;
#else
constexpr int64_t PACKED_COLS = 4096;
#endif
constexpr int64_t PACKED_PASS = 64;  // and the fewest rows a pass then takes: each output row is packed once a pass

// f(std::integral_constant<int, mr>) for a run-time mr in 1..top: the row loops unroll.
template <int top = MR, typename F>
inline void with_rows(int mr, F&& f) {
  if (mr == top) return f(std::integral_constant<int, top>());
  if constexpr (top > 1) with_rows<top - 1>(mr, f);
}

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

void quantize_rows(const float* x, int64_t x_stride, int64_t n, int64_t in, int8_t* xq, float* xd, float* xs,
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

#if defined(__AVX2__)
// VNNI's u8 x s8 dot product of 4 into s32 (AVX-512 VNNI with VL, or AVX-VNNI).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define CTXPAR_DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define CTXPAR_DPBUSD _mm256_dpbusd_avx_epi32
#endif
#if defined(CTXPAR_DPBUSD)
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

// The 8 int32 sums of a block, lane j = weights 4j..4j+3 (lanes 0-3: the first 16 weights).
template <int bits>
inline __m256i block_dot(__m256i w, __m256i x) {
#if defined(CTXPAR_DPBUSD)
  if constexpr (bits == 4) return CTXPAR_DPBUSD(_mm256_setzero_si256(), w, x);
  return CTXPAR_DPBUSD(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (bits == 4) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  // |q| as unsigned (|-128| = 0x80 reads as 128), the sign moved onto x.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
#endif
}

template <int bits>
inline __m256i load_block(const uint8_t* q) {
  if constexpr (bits == 4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);  // high nibbles -> weights 16..31
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  }
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX2__)
// sum_b a[b * stride] * c[b] over n values, in 8 lanes (the offsets' term: a float dot product).
template <typename S>
inline float dot(const S* a, int64_t stride, const float* c, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= n; b += 8) acc = _mm256_fmadd_ps(load8_ps(a + b * stride, stride), _mm256_loadu_ps(c + b), acc);
  float s = hsum8(acc);
  for (; b < n; ++b) s += to_float(a[b * stride]) * c[b];
  return s;
}
#endif

// Row o's offsets term: sum_b offset_b * xs_b, the offsets stored or -zero * the
// block's scale (zero 8: Q4_0, groups of 32, one scale a block).
template <typename S>
inline float offsets_term(const PartView<S>& w, int64_t o, float zero, const float* xs, int64_t nb) {
#if defined(__AVX2__)
  if (w.o) return dot(w.o + o * w.o_row, w.o_col, xs, nb);
  return zero != 0.0f ? -zero * dot(w.s + o * w.s_row, w.s_col, xs, nb) : 0.0f;
#else
  if (!w.o && zero == 0.0f) return 0.0f;
  float off = 0.0f;
  for (int64_t b = 0; b < nb; ++b) off += (w.o ? w.offset(o, b) : -zero * w.scale(o, b)) * xs[b];
  return off;
#endif
}

#if defined(__AVX2__)
// Weights with one scale a block (4 bits; 8 bits in groups of 32), 8 blocks at a time. A row's
// arithmetic is one code whatever computes its integers: per 8 blocks, a vector of their 8 integer sums
// (exact), converted once and fused-multiply-added with the 8 blocks' weight x activation
// scales into the row's one accumulator, lane i holding block LANE[i] of the 8; the blocks
// past the last 8 in a float after; then the accumulator's lanes summed (hsum8), the tail and
// the offsets term. Two ways to the same integers:
//   direct (few rows, rows_lanes): the weights as stored (4 bits: two blocks a 32-byte load;
//     8 bits: a block's halves added), whose sums three pairwise sums (pair_sums) gather
//     into the 8, in LANE's order;
//   packed (many rows, packed_rows): each output row's weights unpacked to bytes and transposed
//     once a pass (pack_row), and the activations once a call (transpose_rows), so that
//     vector k of 8 blocks holds weights 4k..4k+3 of each in lane i's block: 8 dot products
//     of full vectors make the 8 sums with no reduction, and the float steps, one convert,
//     one multiply and one fused multiply-add per 8 blocks, no longer outweigh them. 8-bit
//     weights are packed biased to unsigned (q + 128, VNNI's u8 operand), and 128 times each
//     block's sum of codes is taken off the sums; without VNNI, maddubs' pairs of biased bytes
//     could saturate, so 8 bits take the direct way there.

// hadd_epi32(a, b): in each 128-bit half, [a0 + a1, a2 + a3, b0 + b1, b2 + b3], as two shuffles
// and an add (a few percent faster than hadd where decode rows wait on it).
inline __m256i pair_sums(__m256i a, __m256i b) {
  const __m256 x = _mm256_castsi256_ps(a), y = _mm256_castsi256_ps(b);
  const __m256i even = _mm256_castps_si256(_mm256_shuffle_ps(x, y, 0x88)), odd = _mm256_castps_si256(_mm256_shuffle_ps(x, y, 0xDD));
  return _mm256_add_epi32(even, odd);
}

// 8 rows of 8 int32 (row i: lane i's block, 32 bytes) -> row k = lane i's int32 k, for every i.
inline void transpose8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
    r[k + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
  }
}

// Output row o's weights as packed_rows reads them: per 8 blocks, 8 vectors of 32 bytes
// (8 bits: biased to unsigned).
template <int bits, typename S>
inline void pack_row(const PartView<S>& w, int64_t o, int64_t nb, uint8_t* packed) {
  const __m256i bias = _mm256_set1_epi8(bits == 8 ? char(0x80) : 0);
  for (int64_t b = 0; b + 8 <= nb; b += 8) {
    __m256i r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_xor_si256(load_block<bits>(w.block(o, b + LANE[i])), bias);
    transpose8(r);
    for (int k = 0; k < 8; ++k) _mm256_storeu_si256(reinterpret_cast<__m256i*>(packed + (b + k) * 4 * 8), r[k]);
  }
}

// The activations' scales (n, nb) with each full 8 blocks in LANE's order, into xdl, and where
// xt is not null their codes (n, in) as pack_row packs the weights (the blocks past the
// last 8 as they are), and where xc is not null 128 times each group's sum of codes (the
// biased 8-bit weights' correction), G groups a block: per 8 blocks, G runs of 8 in LANE's order (G = 2:
// the blocks' first halves, then their second), nb * G a row.
inline void transpose_rows(const int8_t* xq, const float* xd, int64_t n, int64_t in, int G, int8_t* xt, float* xdl,
                           int32_t* xc) {
  const int64_t nb = in / QB;
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t m = 0; m < n; ++m) {
    const int8_t* q = xq + m * in;
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      for (int i = 0; i < 8; ++i) xdl[m * nb + b + i] = xd[m * nb + b + LANE[i]];
      if (!xt) continue;
      __m256i r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (b + LANE[i]) * QB));
      for (int i = 0; xc && i < 8; ++i) {  // |code| <= 127: pairs of 1 x code fit int16
        alignas(32) int32_t sums[8];  // lanes 0-3: the block's first 16 codes
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums), _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, r[i]), ones16));
        const int32_t first = sums[0] + sums[1] + sums[2] + sums[3], second = sums[4] + sums[5] + sums[6] + sums[7];
        int32_t* c = xc + (m * nb + b) * G + i;
        if (G == 1)
          c[0] = 128 * (first + second);
        else
          c[0] = 128 * first, c[8] = 128 * second;
      }
      transpose8(r);
      for (int k = 0; k < 8; ++k) _mm256_storeu_si256(reinterpret_cast<__m256i*>(xt + m * in + (b + k) * QB), r[k]);
    }
    if (xt) std::copy(q + b * QB, q + in, xt + m * in + b * QB);
  }
}

// Blocks [b, b + 8)'s weight scales (s: a row's, G a block in block order) in LANE's order:
// ws[g] their groups g (G = 2: first halves, second halves).
template <int G>
inline void lane_scales(const float* s, int64_t b, __m256* ws) {
  if constexpr (G == 1) {
    ws[0] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(s + b), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
  } else {  // even and odd scales: blocks [b, b+1, b+4, b+5 | b+2, b+3, b+6, b+7] each, to LANE's order
    const __m256 v0 = _mm256_loadu_ps(s + 2 * b), v1 = _mm256_loadu_ps(s + 2 * b + 8);
    const __m256i order = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7);
    ws[0] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(v0, v1, 0x88), order);
    ws[1] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(v0, v1, 0xDD), order);
  }
}

// One 8 blocks' step of a row: acc += float(sums) * (weight scales * activation scales), all lane-ordered.
inline __m256 fold8(__m256i sums, __m256 ws, const float* xd, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(ws, _mm256_loadu_ps(xd)), acc);
}

// The rows' results from their accumulators: the blocks past the last 8 one at a time (their
// codes as stored in xq), the lanes' sum, the offsets term.
template <int bits, int G, int mr>
inline void finish_rows(const PartView<float>& wt, float zero, const int8_t* xq, const float* xd, const float* xs,
                        int64_t m0, int64_t in, const __m256* acc, float* res) {
  const int64_t nb = in / QB;
  for (int m = 0; m < mr; ++m) {
    const int64_t r = m0 + m;
    float tail = 0.0f;
    for (int64_t b = nb / 8 * 8; b < nb; ++b) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * in + b * QB));
      alignas(32) int32_t sums[8];  // lanes 0-3: the block's first 16 weights
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), block_dot<bits>(load_block<bits>(wt.block(0, b)), x));
      const float first = float(sums[0] + sums[1] + sums[2] + sums[3]), second = float(sums[4] + sums[5] + sums[6] + sums[7]);
      if constexpr (G == 1) {
        tail = std::fma(first + second, wt.scale(0, b) * xd[r * nb + b], tail);  // exact integers
      } else {
        tail = std::fma(first, wt.scale(0, 2 * b) * xd[r * nb + b], tail);
        tail = std::fma(second, wt.scale(0, 2 * b + 1) * xd[r * nb + b], tail);
      }
    }
    res[m] = hsum8(acc[m]) + tail + offsets_term(wt, 0, zero, xs + r * nb, nb);
  }
}

// Rows [m0, m0 + mr) against output row wt (row_floats'), the weights as stored; xp the
// paired codes (quantize_rows; 4 bits), xdl transpose_rows'.
template <int bits, int G, int mr>
void rows_lanes(const PartView<float>& wt, float zero, const int8_t* xq, const int8_t* xp, const float* xd,
                const float* xdl, const float* xs, int64_t m0, int64_t in, float* res) {
  const int64_t nb = in / QB;
  const __m256i low = _mm256_set1_epi8(0x0F);
#if !defined(CTXPAR_DPBUSD)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[mr];
  for (int m = 0; m < mr; ++m) acc[m] = _mm256_setzero_ps();
  // Pair p's sums, lanes 0-3 block 2p's quarters and 4-7 block 2p + 1's, for each row (v[g][m]:
  // group g's, G = 2: the blocks' halves apart).
  auto pair = [&](int64_t p, __m256i (*v)[mr]) __attribute__((always_inline)) {
    const uint8_t *first = wt.block(0, 2 * p), *second = wt.block(0, 2 * p + 1);
    _mm_prefetch(reinterpret_cast<const char*>(first) + 1024, _MM_HINT_T0);
    if constexpr (bits == 8) {  // a block's halves of 4 sums: [2p's | 2p + 1's], added (G = 1) or apart
      const __m256i w0 = load_block<8>(first), w1 = load_block<8>(second);
      for (int m = 0; m < mr; ++m) {
        const int8_t* x = xq + (m0 + m) * in + 2 * p * QB;
        const __m256i d0 = block_dot<8>(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
        const __m256i d1 = block_dot<8>(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + QB)));
        const __m256i h0 = _mm256_permute2x128_si256(d0, d1, 0x20), h1 = _mm256_permute2x128_si256(d0, d1, 0x31);
        if constexpr (G == 1)
          v[0][m] = _mm256_add_epi32(h0, h1);
        else
          v[0][m] = h0, v[1][m] = h1;
      }
      return;
    }
    const __m256i w = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(second), reinterpret_cast<const __m128i*>(first));
    const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
    for (int m = 0; m < mr; ++m) {
      const int8_t* x = xp + (m0 + m) * in + p * 64;
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
#if defined(CTXPAR_DPBUSD)
      v[0][m] = CTXPAR_DPBUSD(CTXPAR_DPBUSD(_mm256_setzero_si256(), lo, xa), hi, xb);
#else
      v[0][m] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb)), ones);
#endif
    }
  };
  for (int64_t b = 0; b + 8 <= nb; b += 8) {
    __m256i v0[G][mr], v1[G][mr], h01[G][mr];
    pair(b / 2, v0);
    pair(b / 2 + 1, v1);
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < mr; ++m) h01[g][m] = pair_sums(v0[g][m], v1[g][m]);
    pair(b / 2 + 2, v0);
    pair(b / 2 + 3, v1);
    __m256 ws[G];
    lane_scales<G>(wt.s, b, ws);
    for (int m = 0; m < mr; ++m)
      for (int g = 0; g < G; ++g) {
        const __m256i sums = pair_sums(h01[g][m], pair_sums(v0[g][m], v1[g][m]));  // lane i: block LANE[i]
        acc[m] = fold8(sums, ws[g], xdl + (m0 + m) * nb + b, acc[m]);
      }
  }
  finish_rows<bits, G, mr>(wt, zero, xq, xd, xs, m0, in, acc, res);
}

// The same rows' results for nr output rows at once (wt[j] and its packed weights packed[j];
// res[j][m]) from the codes as packed (transpose_rows' xt; 8 bits: xc its code sums): every
// load of the codes serves nr rows' dot products, and every load of the weights mr rows'.
template <int bits, int G, int mr, int nr>
void packed_rows(const PartView<float>* wt, const uint8_t* const* packed, float zero, const int8_t* xq,
                 const int8_t* xt, const int32_t* xc, const float* xd, const float* xdl, const float* xs, int64_t m0,
                 int64_t in, float (*res)[MR]) {
  const int64_t nb = in / QB;
#if !defined(CTXPAR_DPBUSD)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[nr][mr];
  for (int j = 0; j < nr; ++j)
    for (int m = 0; m < mr; ++m) acc[j][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b + 8 <= nb; b += 8) {
    __m256 ws[nr][G];
    for (int j = 0; j < nr; ++j) lane_scales<G>(wt[j].s, b, ws[j]);
    // Group g's vectors k: weights 4k..4k+3 of each block, its first halves' or second's (G = 2).
    for (int g = 0; g < G; ++g) {
      // Dot products of 4 bytes (VNNI) into 32-bit sums, or of 2 (maddubs) into 16-bit ones,
      // whose 16 products of |q| <= 15 by |x| <= 127 fit (30480), widened once.
      __m256i s[nr][mr];
      for (int j = 0; j < nr; ++j)
        for (int m = 0; m < mr; ++m) s[j][m] = _mm256_setzero_si256();
      for (int k = g * 8 / G; k < (g + 1) * 8 / G; ++k) {
        __m256i w[nr];
        for (int j = 0; j < nr; ++j) w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed[j] + (b + k) * QB));
        for (int m = 0; m < mr; ++m) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + (m0 + m) * in + (b + k) * QB));
          for (int j = 0; j < nr; ++j) {
#if defined(CTXPAR_DPBUSD)
            s[j][m] = CTXPAR_DPBUSD(s[j][m], w[j], x);
#else
            s[j][m] = _mm256_add_epi16(s[j][m], _mm256_maddubs_epi16(w[j], x));
#endif
          }
        }
      }
      for (int j = 0; j < nr; ++j)
        for (int m = 0; m < mr; ++m) {
#if defined(CTXPAR_DPBUSD)
          __m256i sums = s[j][m];
          if constexpr (bits == 8) {  // (q + 128) x summed: take 128 x back off
            const int32_t* c = xc + ((m0 + m) * nb + b) * G + g * 8;
            sums = _mm256_sub_epi32(sums, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
          }
#else
          static_assert(bits == 4, "biased bytes' pairs could saturate maddubs");
          const __m256i sums = _mm256_madd_epi16(s[j][m], ones);
#endif
          acc[j][m] = fold8(sums, ws[j][g], xdl + (m0 + m) * nb + b, acc[j][m]);
        }
    }
  }
  for (int j = 0; j < nr; ++j) finish_rows<bits, G, mr>(wt[j], zero, xq, xd, xs, m0, in, acc[j], res[j]);
}
#endif

#if !defined(__AVX2__)
// Output o for rows [m0, m0 + mr), without AVX2: the same integers, a scalar loop. mr is a
// template argument so that every loop over the rows unrolls and the accumulators stay in
// registers.
template <typename S, int bits, int mr>
void row_dot(const PartView<S>& wt, int64_t o, int64_t group, float zero, const int8_t* xq, const int8_t* xp,
             const float* xd, const float* xs, int64_t m0, int64_t in, float* res) {
  const int64_t nb = in / QB;
  (void)xp;  // the paired activations serve the AVX2 paths only
  float acc[mr] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int q[QB];
    for (int i = 0; i < QB; ++i) {
      if constexpr (bits == 4) {
        const uint8_t byte = wt.block(o, b)[i & 15];
        q[i] = i < 16 ? (byte & 15) : (byte >> 4);
      } else {
        q[i] = int8_t(wt.block(o, b)[i]);
      }
    }
    for (int m = 0; m < mr; ++m) {
      const int64_t r = m0 + m;
      const int8_t* x = xq + r * in + b * QB;
      int lo = 0, hi = 0;  // the two halves: groups of 16 have a scale each
      for (int i = 0; i < 16; ++i) lo += q[i] * x[i];
      for (int i = 16; i < QB; ++i) hi += q[i] * x[i];
      const float s0 = wt.scale(o, group == QB ? b : 2 * b), s1 = wt.scale(o, group == QB ? b : 2 * b + 1);
      acc[m] += (s0 * float(lo) + s1 * float(hi)) * xd[r * nb + b];
    }
  }
  for (int m = 0; m < mr; ++m) res[m] = acc[m] + offsets_term(wt, o, zero, xs + (m0 + m) * nb, nb);
}

template <typename S>
using RowFn = void (*)(const PartView<S>&, int64_t, int64_t, float, const int8_t*, const int8_t*, const float*,
                       const float*, int64_t, int64_t, float*);

template <typename S, int bits, int... R>
constexpr std::array<RowFn<S>, sizeof...(R)> row_table(std::integer_sequence<int, R...>) {
  return {row_dot<S, bits, R + 1>...};
}
#endif

// Output row o of a part with its scales and offsets as contiguous floats (the same values),
// in a buffer of the calling thread's: every pass of MR activation rows over the row reads
// them, and a GGUF file's lie a block apart as halves, one scalar load and convert each,
// which cost about a third of a prefill's time read in place. slot: which of the thread's NR
// buffers.
template <typename S>
inline __attribute__((always_inline)) PartView<float> row_floats(const PartView<S>& w, int64_t o, int64_t group,
                                                                 int64_t in, int slot) {
  static thread_local std::vector<float> bufs[NR];
  std::vector<float>& buf = bufs[slot];
  const int64_t ng = in / group, nb = in / QB;
  buf.resize(ng + nb);
  for (int64_t j = 0; j < ng; ++j) buf[j] = w.scale(o, j);
  for (int64_t b = 0; w.o && b < nb; ++b) buf[ng + b] = w.offset(o, b);
  const QuantPart part{w.block(o, 0), buf.data(), w.o ? buf.data() + ng : nullptr, 1, w.q_row, w.q_block, 0, 1, 0, 1};
  return PartView<float>(part);
}

template <typename S>
void quant_linear(const float* x, int64_t x_stride, int64_t n, int64_t in, const QuantPart* parts, int64_t num_parts,
                  int64_t bits, int64_t group, int64_t zero, const float* bias, float* out) {
  const int64_t nb = in / QB;
  int64_t out_features = 0;  // the output rows' stride: every part's outputs side by side
  for (int64_t k = 0; k < num_parts; ++k) out_features += parts[k].rows;
  // The quantized activations, kept per calling thread between calls: a decode step makes ~120.
  // (Pointers taken here: inside the parallel loop each thread would name its own vectors.)
  static thread_local std::vector<int8_t> xq_buf, xp_buf;
  static thread_local std::vector<float> xd_buf, xs_buf;
  static thread_local std::vector<int32_t> xz_buf;
  if (int64_t(xq_buf.size()) < n * in) xq_buf.resize(n * in);
  if (int64_t(xd_buf.size()) < n * nb) xd_buf.resize(n * nb), xs_buf.resize(n * nb);
  int8_t* xq = xq_buf.data();
  float *xd = xd_buf.data(), *xs = xs_buf.data();
#if defined(CTXPAR_TILES)
  const int64_t row_block = tiles::rows_per_block(in);
  // zero 8: each block's -8 * sum of codes, for sum (q - 8) x = sum q x - 8 sum x in integers.
  if (zero && int64_t(xz_buf.size()) < n * nb) xz_buf.resize(n * nb);
  int32_t* xz = zero ? xz_buf.data() : nullptr;
  static thread_local tiles::RowGroups row_groups_buf;
  tiles::RowGroups& row_groups = row_groups_buf;  // the codes as the VNNI loop reads them
  const bool grouped = n >= tiles::DIRECT_ROWS;  // fewer: a decode step's direct reads
  if (grouped) row_groups.resize(n, in, group, true);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < n; ++m) {
      quantize_rows(x + m * x_stride, x_stride, 1, in, xq + m * in, xd + m * nb, xs + m * nb, zero,
                    xz ? xz + m * nb : nullptr, nullptr);
      if (grouped) row_groups.set_row(m, xq + m * in, xd + m * nb, xs + m * nb, group, tiles::vnni_zero(bits, zero));
    }
    for (int64_t r0 = 0; r0 < n; r0 += row_block)
      for (int64_t k = 0, col = 0; k < num_parts; col += parts[k].rows, ++k)
        tiles::product(PartView<S>(parts[k]), zero, bits, group, in, out_features, xq, xd, xs, xz, row_groups, r0,
                       std::min(n, r0 + row_block), bias ? bias + col : nullptr, out + col);
  }
#else
#if defined(__AVX2__)
  // The 8-lane paths ("8 blocks at a time" above), G groups a block, packed where the rows repay
  // packing each output row's weights once a pass (8 bits: with VNNI); either way a row's bits.
  const int G = group == QB ? 1 : 2;
  const bool packed = (bits == 4 || VNNI) && n >= PACKED_ROWS && in >= PACKED_COLS;
  static thread_local std::vector<int8_t> xt_buf;
  static thread_local std::vector<float> xdl_buf;
  static thread_local std::vector<int32_t> xc_buf;
  if (int64_t(xdl_buf.size()) < n * nb) xdl_buf.resize(n * nb);
  if (packed && int64_t(xt_buf.size()) < n * in) xt_buf.resize(n * in);
  if (packed && bits == 8 && int64_t(xc_buf.size()) < n * nb * G) xc_buf.resize(n * nb * G);
  int8_t* xt = xt_buf.data();
  float* xdl = xdl_buf.data();
  int32_t* xc = packed && bits == 8 ? xc_buf.data() : nullptr;
  // f(bits, G) as constants: (4, 1), (8, 1) or (8, 2).
  auto with_kind = [&](auto f) __attribute__((always_inline)) {
    if (bits == 4) return f(std::integral_constant<int, 4>(), std::integral_constant<int, 1>());
    if (G == 1) return f(std::integral_constant<int, 8>(), std::integral_constant<int, 1>());
    f(std::integral_constant<int, 8>(), std::integral_constant<int, 2>());
  };
#else
  static const auto table4 = row_table<float, 4>(std::make_integer_sequence<int, MR>());
  static const auto table8 = row_table<float, 8>(std::make_integer_sequence<int, MR>());
  const bool packed = false;
#endif
  if (int64_t(xp_buf.size()) < n * in) xp_buf.resize(n * in);
  int8_t* xp = xp_buf.data();
  quantize_rows(x, x_stride, n, in, xq, xd, xs, 0, nullptr, packed ? nullptr : xp);
#if defined(__AVX2__)
  transpose_rows(xq, xd, n, in, G, packed ? xt : nullptr, xdl, xc);
#endif
  // Rows a pass takes (MRs): their codes, ~256 KB (up to ~1 MB packed, at the widest rows),
  // stay in L2 while every output's weight row meets them; all of a prefill's rows at once
  // would stream from L3 again for each output.
  const int64_t pass = std::max<int64_t>(packed ? PACKED_PASS : MR, (int64_t(1) << 18) / in / MR * MR);
  for (int64_t k = 0, col = 0; k < num_parts; col += parts[k].rows, ++k) {
    const PartView<S> w(parts[k]);
    for (int64_t r0 = 0; r0 < n; r0 += pass) {
      const int64_t r1 = std::min(n, r0 + pass);
      // Output o's results for rows [m0, m0 + mr).
      auto store = [&](int64_t o, int64_t m0, int mr, const float* res) __attribute__((always_inline)) {
        for (int m = 0; m < mr; ++m) out[(m0 + m) * out_features + col + o] = res[m] + (bias ? bias[col + o] : 0.0f);
      };
#pragma omp parallel for schedule(static)
      for (int64_t o0 = 0; o0 < w.rows; o0 += NR) {
        const int nr = int(std::min<int64_t>(NR, w.rows - o0));
#if defined(__AVX2__)
        if (packed) {
          static thread_local std::vector<uint8_t> packed_buf[NR];  // the output rows' weights packed
          const PartView<float> first = row_floats(w, o0, group, in, 0);
          const PartView<float> rows[NR] = {first, nr > 1 ? row_floats(w, o0 + 1, group, in, 1) : first};
          const uint8_t* packs[NR];
          for (int j = 0; j < nr; ++j) {
            packed_buf[j].resize(in);
            if (bits == 4)
              pack_row<4>(rows[j], 0, nb, packed_buf[j].data());
            else
              pack_row<8>(rows[j], 0, nb, packed_buf[j].data());
            packs[j] = packed_buf[j].data();
          }
          for (int64_t m0 = r0; m0 < r1; m0 += MR) {
            const int mr = int(std::min<int64_t>(MR, r1 - m0));
            float res[NR][MR];
            with_rows(mr, [&](auto m) {
              with_kind([&](auto b, auto g) {
                if constexpr (b() == 4 || VNNI) {  // 8 bits are packed with VNNI only (see packed above)
                  if (nr == NR)
                    packed_rows<b(), g(), m(), NR>(rows, packs, float(zero), xq, xt, xc, xd, xdl, xs, m0, in, res);
                  else
                    packed_rows<b(), g(), m(), 1>(rows, packs, float(zero), xq, xt, xc, xd, xdl, xs, m0, in, res);
                }
              });
            });
            for (int j = 0; j < nr; ++j) store(o0 + j, m0, mr, res[j]);
          }
          continue;
        }
#endif
        // One output row at a time: its floats read, then its products, whose prefetches
        // bring the next row's first blocks for the next row's floats.
        for (int64_t o = o0; o < o0 + nr; ++o) {
          const PartView<float> row = row_floats(w, o, group, in, 0);
          for (int64_t m0 = r0; m0 < r1; m0 += MR) {
            const int mr = int(std::min<int64_t>(MR, r1 - m0));
            float res[MR];
#if defined(__AVX2__)
            with_rows(mr, [&](auto m) {
              with_kind([&](auto b, auto g) {
                rows_lanes<b(), g(), m()>(row, float(zero), xq, xp, xd, xdl, xs, m0, in, res);
              });
            });
#else
            (bits == 4 ? table4 : table8)[mr - 1](row, 0, group, float(zero), xq, xp, xd, xs, m0, in, res);
#endif
            store(o, m0, mr, res);
          }
        }
      }
    }
  }
#endif
}

// One thread's rounds of 12 independent int8 dot-product chains in registers, the
// instructions the kernels multiply with (below); returns the integer operations done.
int64_t peak_thread(int64_t iters) {
  constexpr int K = 12;  // chains: more than the units' latency times their throughput
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(1), a[K];
  for (int k = 0; k < K; ++k) a[k] = _mm512_set1_epi32(k);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < K; ++k) a[k] = _mm512_dpbusd_epi32(a[k], w, x);
    asm volatile("" : "+v"(w), "+v"(x));  // the operands change as far as the compiler knows
  }
  for (int k = 0; k < K; ++k) asm volatile("" : : "v"(a[k]));
  return iters * K * 128;  // 64 multiply-adds a dpbusd
#elif defined(__AVX2__)
  __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi16(1), a[K];  // x: bytes or madd's ones
  for (int k = 0; k < K; ++k) a[k] = _mm256_set1_epi32(k);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < K; ++k) {
#if defined(CTXPAR_DPBUSD)
      a[k] = CTXPAR_DPBUSD(a[k], w, x);
#else  // each chain's sums as the next round's signed bytes: the pair's latency, as a chain's
      a[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a[k]), x);
#endif
    }
    asm volatile("" : "+v"(w), "+v"(x));
  }
  for (int k = 0; k < K; ++k) asm volatile("" : : "v"(a[k]));
  return iters * K * 64;  // 32 multiply-adds a 256-bit dot product
#else
  (void)iters;
  return 0;
#endif
}

}  // namespace

extern "C" {

// The int8 peak for ctxpar bench: `iters` rounds of 12 independent dot products of
// the kernels' widest kind (AVX-512 VNNI's 512-bit dpbusd; else AVX-VNNI's or AVX2's
// 256-bit maddubs and madd) on every thread of an OpenMP team, nothing else. Returns
// the integer operations done (a multiply and an add each, all threads), 0 on a CPU
// with none of them.
int64_t quant_peak_ops(int64_t iters) {
  int64_t total = 0;
#pragma omp parallel reduction(+ : total)
  total += peak_thread(iters);
  return total;
}


// x (n, in) float32, x_stride floats between rows, in a multiple of 32; the weight
// (out_features, in) as above, the rows of `num_parts` parts one after another (quant_part.h),
// their scales and offsets half if `half`, else float32; zero 0 or 8 (see the top); bias
// (out_features,) or null; out (n, out_features).
void quant_linear_f32(const float* x, int64_t x_stride, int64_t n, int64_t in, const QuantPart* parts,
                      int64_t num_parts, int64_t bits, int64_t group, int64_t half, int64_t zero, const float* bias,
                      float* out) {
  if (n == 0 || num_parts == 0) return;
  if (half)
    quant_linear<Half>(x, x_stride, n, in, parts, num_parts, bits, group, zero, bias, out);
  else
    quant_linear<float>(x, x_stride, n, in, parts, num_parts, bits, group, zero, bias, out);
}

}  // extern "C"
