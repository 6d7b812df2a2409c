// The block-quantized projection (quant_gemv.cpp) on CPUs without AVX-512 VNNI: the 8-lane
// paths of AVX2 (with AVX-VNNI's dot products where the CPU has them), and a scalar loop
// without AVX2. Both take the activations as quant_rows.h rounds them.

#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "half.h"
#include "quant_part.h"

namespace lanes {

constexpr int MR = 4;  // activation rows per pass over a weight row (it stays in L1 between passes)
constexpr int LANE[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // AVX2, a scale a block: lane i of 8 blocks' vector holds block LANE[i]

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
// Weights with one scale a block (4 bits; 8 bits in groups of 32), 8 blocks at a time. A row's
// arithmetic is one code whatever computes its integers: per group of 8 blocks, a vector of
// their 8 integer sums (exact), converted once and fused-multiply-added with the 8 blocks'
// weight x activation scales into the row's one accumulator, lane i holding block LANE[i] of
// the 8, then (with offsets) the blocks' offsets times their activations' sums (xs)
// fused-multiply-added into it; the row's last group may hold fewer than 8 blocks, its
// other lanes zero; then the accumulator's lanes summed (hsum8). Two ways to the same
// integers:
//   direct (few rows, rows_lanes): the weights as stored (4 bits: two blocks a 32-byte load;
//     8 bits: a block's halves added), whose sums three pairwise sums (pair_sums) gather
//     into the 8, in LANE's order;
//   packed (many rows, packed_rows): each output row's weights unpacked to bytes and transposed
//     once a pass (pack_row), and the activations once a call (transpose_row), so that
//     vector k of 8 blocks holds weights 4k..4k+3 of each in lane i's block: 8 dot products
//     of full vectors make the 8 sums with no reduction, and the float steps, one convert,
//     one multiply and one fused multiply-add per 8 blocks, no longer outweigh them. 8-bit
//     weights are packed biased to unsigned with VNNI (q + 128, dpbusd's u8 operand), and 128
//     times each block's sum of codes is taken off the sums; without VNNI, maddubs' pairs of
//     biased bytes could saturate, so they are packed as they are and multiplied as |q| by x
//     with q's sign (pairs of 128 x 127 fit int16), each pair widened at once. A row's last
//     group of fewer than 8 blocks is packed as a full one, the blocks past the row's end
//     zero weights against zero codes (its sums theirs: zero); the direct way sums it as its
//     full groups too, pair by pair, the blocks past the row's end zero.
// Q4_0's zero is taken in the integers on both ways: -8 times each block's sum of activation
// codes (xc, as the biased 8-bit weights' correction) is added to its sums, so that they are
// sums of (q - 8) x.

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
// (8 bits: biased to unsigned with VNNI); the last group's blocks past the row's end zero
// (biased: any weight meets zero codes there), nbp * QB bytes in all.
template <int bits, typename S>
inline void pack_row(const PartView<S>& w, int64_t o, int64_t nb, uint8_t* packed) {
  const __m256i bias = _mm256_set1_epi8(bits == 8 && VNNI ? char(0x80) : 0);
  for (int64_t b = 0; b < nb; b += 8) {
    __m256i r[8];
    for (int i = 0; i < 8; ++i)
      r[i] = _mm256_xor_si256(b + LANE[i] < nb ? load_block<bits>(w.block(o, b + LANE[i])) : _mm256_setzero_si256(), bias);
    transpose8(r);
    for (int k = 0; k < 8; ++k) _mm256_storeu_si256(reinterpret_cast<__m256i*>(packed + (b + k) * 4 * 8), r[k]);
  }
}

// One activation row's per-block values in LANE's order, nbp = nb rounded up to 8, the last
// group's missing blocks zero: its scales (in / QB) into xdl (nbp); where xsl is not null
// their sums of codes times the scales (xs, the offsets' factors) into it; where xc is not
// null -shift times each group's sum of codes (added to the sums: shift 128 for VNNI's biased
// 8-bit weights, 8 for Q4_0's zero), G groups a block: per 8 blocks, G runs of 8 in LANE's
// order (G = 2: the blocks' first halves, then their second), nbp * G; and where xt is not
// null its codes (nbp * QB) as pack_row packs the weights (the last group's missing blocks
// zero codes). A row's values are its own: the rows go to any thread.
inline void transpose_row(const int8_t* q, const float* xd, const float* xs, int64_t in, int G, int8_t* xt, float* xdl,
                          float* xsl, int32_t* xc, int32_t shift) {
  const int64_t nb = in / QB;
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; b += 8) {
    const int64_t count = std::min<int64_t>(8, nb - b);
    for (int i = 0; i < 8; ++i) {
      xdl[b + i] = LANE[i] < count ? xd[b + LANE[i]] : 0.0f;
      if (xsl) xsl[b + i] = LANE[i] < count ? xs[b + LANE[i]] : 0.0f;
    }
    __m256i r[8];
    for (int i = 0; (xt || xc) && i < 8; ++i)
      r[i] = LANE[i] < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (b + LANE[i]) * QB))
                             : _mm256_setzero_si256();
    for (int i = 0; xc && i < 8; ++i) {  // |code| <= 127: pairs of 1 x code fit int16
      alignas(32) int32_t sums[8];  // lanes 0-3: the block's first 16 codes
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, r[i]), ones16));
      const int32_t first = sums[0] + sums[1] + sums[2] + sums[3], second = sums[4] + sums[5] + sums[6] + sums[7];
      int32_t* c = xc + b * G + i;
      if (G == 1)
        c[0] = -shift * (first + second);
      else
        c[0] = -shift * first, c[8] = -shift * second;
    }
    if (!xt) continue;
    transpose8(r);
    for (int k = 0; k < 8; ++k) _mm256_storeu_si256(reinterpret_cast<__m256i*>(xt + (b + k) * QB), r[k]);
  }
}

// lane_values' value-by-value way, out of line where float values take it, so that the loops
// over full groups keep their registers.
template <int G, typename S>
__attribute__((noinline)) void gather_values(const S* s, int64_t s_col, int64_t b, int64_t count, __m256* ws) {
  for (int g = 0; g < G; ++g) ws[g] = gather8_ps(s + (G * b + g) * s_col, G * s_col, LANE, int(count));
}

// Blocks [b, b + count)'s values (s: a row's, G a block in block order, s_col apart) in LANE's
// order, the missing blocks' zero: ws[g] their groups g (G = 2: first halves, second halves).
// Contiguous floats (row_floats') by permutes, a last group's loaded under a mask (the lanes
// past it zero); else (a GGUF file's halves a block apart) value by value: the same floats.
template <int G, typename S>
inline void lane_values(const S* s, int64_t s_col, int64_t b, int64_t count, __m256* ws) {
  if constexpr (std::is_same_v<S, float>) {
    if (s_col == 1) {
      // Floats [first, first + n) of s (all 8 from n = 8; none from n <= 0), the lanes past them zero.
      const auto load = [&](int64_t first, int64_t n) __attribute__((always_inline)) {
        if (n >= 8) return _mm256_loadu_ps(s + first);
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        return _mm256_maskload_ps(s + first, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lane));
      };
      if constexpr (G == 1) {
        ws[0] = _mm256_permutevar8x32_ps(load(b, count), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
      } else {  // even and odd scales: blocks [b, b+1, b+4, b+5 | b+2, b+3, b+6, b+7] each, to LANE's order
        const __m256 v0 = load(2 * b, 2 * count), v1 = load(2 * b + 8, 2 * count - 8);
        const __m256i order = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7);
        ws[0] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(v0, v1, 0x88), order);
        ws[1] = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(v0, v1, 0xDD), order);
      }
      return;
    }
    return gather_values<G>(s, s_col, b, count, ws);
  }
  for (int g = 0; g < G; ++g) ws[g] = gather8_ps(s + (G * b + g) * s_col, G * s_col, LANE, int(count));
}

// Two blocks' block_dot sums (lanes 0-3 a block's first 16 weights, 4-7 its last 16) as a
// pair's G vectors: lanes 0-3 the first block's quarters, 4-7 the second's (G = 1: each
// block's halves added; G = 2: apart).
template <int G>
inline void pair_of_blocks(__m256i d0, __m256i d1, __m256i* v) {
  const __m256i h0 = _mm256_permute2x128_si256(d0, d1, 0x20), h1 = _mm256_permute2x128_si256(d0, d1, 0x31);
  if constexpr (G == 1)
    v[0] = _mm256_add_epi32(h0, h1);
  else
    v[0] = h0, v[1] = h1;
}

// Block `at` of output row wt (as stored) against one activation row's codes q (block order):
// its block_dot sums.
template <int bits, typename S>
inline __m256i one_block(const PartView<S>& wt, const int8_t* q, int64_t at) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + at * QB));
  return block_dot<bits>(load_block<bits>(wt.block(0, at)), x);
}

// A group's 8 sums in LANE's order from its four pairs' (pair_of_blocks': pair p holds
// blocks 2p and 2p + 1).
inline __m256i group_of_pairs(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  return pair_sums(pair_sums(p0, p1), pair_sums(p2, p3));
}

// A group's steps of a row's accumulator, all lane-ordered (xdl, xsl, xc: transpose_row's, the
// group at `at` of them): fold8, group g's, acc += float(sums + xc) * (weight scales x
// activation scales), xc where Q4_0's zero or VNNI's bias is taken off; then fold_offsets,
// acc += offsets x the activations' xs where the weight has offsets. fold_group: the two in
// their order.
template <int G>
inline __m256 fold8(__m256i sums, __m256 ws, const float* xdl, const int32_t* xc, int64_t at, int g, __m256 acc) {
  if (xc) sums = _mm256_add_epi32(sums, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + at * G + g * 8)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(ws, _mm256_loadu_ps(xdl + at)), acc);
}

inline __m256 fold_offsets(const __m256* wo, const float* xsl, __m256 acc) {
  return wo ? _mm256_fmadd_ps(*wo, _mm256_loadu_ps(xsl), acc) : acc;
}

template <int G>
inline __m256 fold_group(const __m256i* sums, const __m256* ws, const __m256* wo, const float* xdl, const float* xsl,
                         const int32_t* xc, int64_t at, __m256 acc) {
  for (int g = 0; g < G; ++g) acc = fold8<G>(sums[g], ws[g], xdl, xc, at, g, acc);
  return fold_offsets(wo, xsl + at, acc);
}

// Output row wt's scales (and offsets, where it has them) of blocks [b, b + count), as fold_group takes them.
template <int G, typename S>
inline const __m256* group_values(const PartView<S>& wt, int64_t b, int64_t count, __m256* ws, __m256* wo) {
  lane_values<G>(wt.s, wt.s_col, b, count, ws);
  if (!wt.o) return nullptr;
  lane_values<1>(wt.o, wt.o_col, b, count, wo);
  return wo;
}

// Rows [m0, m0 + mr) against output row wt (row 0 of the view: as stored, or row_floats'), the
// weights as stored; xp the paired codes (quantize_rows; 4 bits), xdl, xsl and xc
// transpose_row's (xsl where the weight has offsets, xc where Q4_0's zero is taken off).
// Inlined into its callers' loops over output rows (span_lanes): no call a row.
template <int bits, int G, int mr, typename S>
inline __attribute__((always_inline)) void rows_lanes(const PartView<S>& wt, const int8_t* xq, const int8_t* xp,
                                                      const float* xdl, const float* xsl, const int32_t* xc,
                                                      int64_t m0, int64_t in, float* res) {
  const int64_t nb = in / QB, nbp = (nb + 7) / 8 * 8;
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
    _mm_prefetch(reinterpret_cast<const char*>(first) + 2048, _MM_HINT_T0);
    if constexpr (bits == 8) {  // a block's halves of 4 sums: [2p's | 2p + 1's], added (G = 1) or apart
      const __m256i w0 = load_block<8>(first), w1 = load_block<8>(second);
      for (int m = 0; m < mr; ++m) {
        const int8_t* x = xq + (m0 + m) * in + 2 * p * QB;
        const __m256i d0 = block_dot<8>(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
        const __m256i d1 = block_dot<8>(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + QB)));
        __m256i h[G];
        pair_of_blocks<G>(d0, d1, h);
        for (int g = 0; g < G; ++g) v[g][m] = h[g];
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
  __m256 ws[G], wo;
  for (int64_t b = 0; b + 8 <= nb; b += 8) {
    __m256i v0[G][mr], v1[G][mr], h01[G][mr];
    pair(b / 2, v0);
    pair(b / 2 + 1, v1);
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < mr; ++m) h01[g][m] = pair_sums(v0[g][m], v1[g][m]);
    pair(b / 2 + 2, v0);
    pair(b / 2 + 3, v1);
    const __m256* offsets = group_values<G>(wt, b, 8, ws, &wo);
    for (int m = 0; m < mr; ++m) {
      __m256i sums[G];
      for (int g = 0; g < G; ++g) sums[g] = pair_sums(h01[g][m], pair_sums(v0[g][m], v1[g][m]));  // lane i: block LANE[i]
      acc[m] = fold_group<G>(sums, ws, offsets, xdl, xsl, xc, (m0 + m) * nbp + b, acc[m]);
    }
  }
  if (nb % 8) {  // the last group's pairs as a full group's, the blocks past the row's zero
    const int64_t b = nb / 8 * 8;
    __m256i v[4][G][mr];
    for (int p = 0; p < 4; ++p) {
      const int64_t first = b + 2 * p;
      if (first + 1 < nb) {
        pair(first / 2, v[p]);
        continue;
      }
      for (int m = 0; m < mr; ++m) {  // an odd last block (codes as xq holds them), or none
        const __m256i d = first < nb ? one_block<bits>(wt, xq + (m0 + m) * in, first) : _mm256_setzero_si256();
        __m256i h[G];
        pair_of_blocks<G>(d, _mm256_setzero_si256(), h);
        for (int g = 0; g < G; ++g) v[p][g][m] = h[g];
      }
    }
    const __m256* offsets = group_values<G>(wt, b, nb - b, ws, &wo);
    for (int m = 0; m < mr; ++m) {
      __m256i sums[G];
      for (int g = 0; g < G; ++g) sums[g] = group_of_pairs(v[0][g][m], v[1][g][m], v[2][g][m], v[3][g][m]);
      acc[m] = fold_group<G>(sums, ws, offsets, xdl, xsl, xc, (m0 + m) * nbp + b, acc[m]);
    }
  }
  for (int m = 0; m < mr; ++m) res[m] = hsum8(acc[m]);
}

// rows_lanes for output rows [o0, o1) of w, one after another: res[(o - o0) * MR + m].
template <int bits, int G, int mr, typename S>
__attribute__((noinline)) void span_lanes(const PartView<S>& w, int64_t o0, int64_t o1, const int8_t* xq,
                                          const int8_t* xp, const float* xdl, const float* xsl, const int32_t* xc,
                                          int64_t m0, int64_t in, float* res) {
  for (int64_t o = o0; o < o1; ++o)
    rows_lanes<bits, G, mr>(w.at_row(o), xq, xp, xdl, xsl, xc, m0, in, res + (o - o0) * MR);
}

// The same rows' results for nr output rows at once (wt[j] and its packed weights packed[j];
// res[j][m]) from the codes as packed (transpose_row's xt): every load of the codes serves nr
// rows' dot products, and every load of the weights mr rows'.
template <int bits, int G, int mr, int nr>
void packed_rows(const PartView<float>* wt, const uint8_t* const* packed, const int8_t* xt,
                 const float* xdl, const float* xsl, const int32_t* xc, int64_t m0, int64_t in, float (*res)[MR]) {
  const int64_t nb = in / QB, nbp = (nb + 7) / 8 * 8;
#if !defined(CTXPAR_DPBUSD)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[nr][mr];
  for (int j = 0; j < nr; ++j)
    for (int m = 0; m < mr; ++m) acc[j][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b += 8) {  // the last group padded (pack_row, transpose_row)
    __m256 ws[nr][G], wo[nr];
    const __m256* offsets[nr];
    for (int j = 0; j < nr; ++j) offsets[j] = group_values<G>(wt[j], b, std::min<int64_t>(8, nb - b), ws[j], &wo[j]);
    // Group g's vectors k: weights 4k..4k+3 of each block, its first halves' or second's (G = 2).
    for (int g = 0; g < G; ++g) {
      // Dot products of 4 bytes (VNNI) into 32-bit sums, or of 2 (maddubs) into 16-bit ones:
      // 4 bits' 16 products of |q| <= 15 by |x| <= 127 fit (30480), widened once; 8 bits' pairs
      // of |q| <= 128 by |x| <= 127 (32512) one at a time. With VNNI, 8 bits: (q + 128) x summed
      // (xc takes -128 x the codes off after).
      __m256i s[nr][mr];
      for (int j = 0; j < nr; ++j)
        for (int m = 0; m < mr; ++m) s[j][m] = _mm256_setzero_si256();
      // Vector k's products, added into s. 4 bits with maddubs: one k at a time (GCC's unrolling
      // of the 8 computes all 64 products first and adds them back from the stack).
      auto step = [&](int k) __attribute__((always_inline)) {
        __m256i w[nr];
        for (int j = 0; j < nr; ++j) w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed[j] + (b + k) * QB));
#if !defined(CTXPAR_DPBUSD)
        __m256i magnitude[nr];  // 8 bits: |q|, unsigned (|-128| = 0x80 reads as 128)
        for (int j = 0; j < nr; ++j) magnitude[j] = bits == 8 ? _mm256_abs_epi8(w[j]) : w[j];
#endif
        for (int m = 0; m < mr; ++m) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + ((m0 + m) * nbp + b + k) * QB));
          for (int j = 0; j < nr; ++j) {
#if defined(CTXPAR_DPBUSD)
            s[j][m] = CTXPAR_DPBUSD(s[j][m], w[j], x);
#else
            if constexpr (bits == 4)
              s[j][m] = _mm256_add_epi16(s[j][m], _mm256_maddubs_epi16(w[j], x));
            else
              s[j][m] = _mm256_add_epi32(
                  s[j][m], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[j], _mm256_sign_epi8(x, w[j])), ones));
#endif
          }
        }
      };
      if constexpr (bits == 4 && !VNNI) {
#pragma GCC unroll 1
        for (int k = g * 8 / G; k < (g + 1) * 8 / G; ++k) step(k);
      } else {
        for (int k = g * 8 / G; k < (g + 1) * 8 / G; ++k) step(k);
      }
      for (int j = 0; j < nr; ++j)
        for (int m = 0; m < mr; ++m) {
#if defined(CTXPAR_DPBUSD)
          const __m256i sums = s[j][m];
#else
          const __m256i sums = bits == 4 ? _mm256_madd_epi16(s[j][m], ones) : s[j][m];
#endif
          // fold_group's steps, group by group
          acc[j][m] = fold8<G>(sums, ws[j][g], xdl, xc, (m0 + m) * nbp + b, g, acc[j][m]);
        }
    }
    for (int j = 0; j < nr; ++j)
      for (int m = 0; m < mr; ++m) acc[j][m] = fold_offsets(offsets[j], xsl + (m0 + m) * nbp + b, acc[j][m]);
  }
  for (int j = 0; j < nr; ++j)
    for (int m = 0; m < mr; ++m) res[j][m] = hsum8(acc[j][m]);
}
#endif

#if !defined(__AVX2__)
// Output o for rows [m0, m0 + mr), without AVX2: the same integers, a scalar loop. mr is a
// template argument so that every loop over the rows unrolls and the accumulators stay in
// registers.
template <typename S, int bits, int mr>
void row_dot(const PartView<S>& wt, int64_t o, int64_t group, int zero, const int8_t* xq, const int8_t* xp,
             const float* xd, const float* xs, int64_t m0, int64_t in, float* res) {
  const int64_t nb = in / QB;
  (void)xp;  // the paired activations serve the AVX2 paths only
  float acc[mr] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int q[QB];
    for (int i = 0; i < QB; ++i) {
      if constexpr (bits == 4) {
        const uint8_t byte = wt.block(o, b)[i & 15];
        q[i] = (i < 16 ? (byte & 15) : (byte >> 4)) - zero;
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
  for (int m = 0; m < mr; ++m) {  // the offsets' term: sum_b offset_b * xs_b
    float off = 0.0f;
    for (int64_t b = 0; wt.o && b < nb; ++b) off += wt.offset(o, b) * xs[(m0 + m) * nb + b];
    res[m] = acc[m] + off;
  }
}

template <typename S>
using RowFn = void (*)(const PartView<S>&, int64_t, int64_t, int, const int8_t*, const int8_t*, const float*,
                       const float*, int64_t, int64_t, float*);

template <typename S, int bits, int... R>
constexpr std::array<RowFn<S>, sizeof...(R)> row_table(std::integer_sequence<int, R...>) {
  return {row_dot<S, bits, R + 1>...};
}
#endif

}  // namespace lanes
