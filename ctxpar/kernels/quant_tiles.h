// The weight tiles of the block-quantized projection on CPUs with AVX-512 VNNI
// (quant_product.h: the projection they serve; quant_direct.h, quant_amx.h: the other
// integer engines, which read or fill the same tiles), and the VNNI loop over them.
//
// Per call the weight's output rows are taken 16 at a time (a tile), and a tile's
// integers are laid out for the dot-product instructions, once per block of
// activation rows (without AMX, SLICE_BLOCKS blocks of the tile's rows at a time):
//
//   row o, weights 4j..4j+3 of block b     ->    q[b][j][o % 16][0..3]   (u8 for 4 bits, s8 for 8)
//   scale of group g of row o              ->    scales[g][o % 16]       (float32)
//   offset of block b of row o             ->    offsets[b][o % 16]
//
// so one 512-bit vector holds the same four weights of the 16 outputs, which is both
// what VNNI's dpbusd multiplies against four broadcast activation bytes and AMX's
// B-tile layout. A group's integer dot product (16 or 32 weights by 16 or 32 codes)
// is exact in int32 whichever unit computes it; everything after it is one code
// shape, for output o and activation row m:
//
//   acc = 0
//   for each block b, for each group g of b:   acc = fma(float(s_g), scale_g * xd_b, acc)
//                     then, with offsets:      acc = fma(offset_b, xs_b, acc)
//   out = acc + bias
//
// (zero 8, GGUF's Q4_0: s_g is sum (q - 8) x, an integer too, and there is no offset.)
//
// one lane per output, blocks in order: every integer engine's sums take these float steps.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "quant_part.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define CTXPAR_AMX 1
#endif

namespace tiles {

constexpr int64_t T = 16;   // outputs per tile: one 512-bit vector of float32
constexpr int MR = 8;       // activation rows per pass of the VNNI loop over a tile
constexpr int64_t DIRECT_ROWS = 7;  // fewer rows than this read the weight in place (direct_rows)
constexpr int64_t DIRECT_GROUP = 3;  // rows a direct_rows pass takes: its registers' worth
constexpr int64_t SLICE_BLOCKS = 64;  // blocks of its rows a tile holds at once without AMX: 32 KB, in L1
constexpr int64_t ROW_BLOCK_BYTES = 1 << 20;  // codes of a row block without AMX (rows_per_block)

// One tile of the weight, laid out as above (buffers reused between calls).
struct Tile {
  std::vector<uint8_t> q;      // (nb, 8, 16, 4)
  std::vector<float> scales;   // (in / group, 16)
  std::vector<float> offsets;  // (nb, 16), or empty
};

// 16 rows' 16 bytes at `src + o * stride` as four vectors, dword j of each row in lane
// j of a 4 x 4 transpose: out[j] = (row 0's dword j, row 1's, ..., row 15's).
inline void gather_dwords(const uint8_t* src, int64_t stride, int64_t rows, __m512i out[4]) {
  __m128i r[T];
  for (int64_t o = 0; o < T; ++o)
    r[o] = o < rows ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + o * stride)) : _mm_setzero_si128();
  // a[k]: rows k, 4 + k, 8 + k, 12 + k in its four 128-bit lanes, so that lane L of the
  // transposed vectors holds rows 4L..4L+3, in order.
  __m512i a[4];
  for (int k = 0; k < 4; ++k) {
    __m512i v = _mm512_castsi128_si512(r[k]);
    v = _mm512_inserti32x4(v, r[4 + k], 1);
    v = _mm512_inserti32x4(v, r[8 + k], 2);
    a[k] = _mm512_inserti32x4(v, r[12 + k], 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// A 16 x 16 float matrix transposed in registers: r[i] row i in, r[c] column c out.
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int i = 0; i < 4; ++i) {  // u[4i + k], 128-bit lane L: column 4L + k of rows 4i..4i+3
    u[4 * i] = lo(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = hi(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = lo(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = hi(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 p0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x44), p1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xEE);
    const __m512 q0 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x44);
    const __m512 q1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_f32x4(p0, q0, 0x88);
    r[4 + k] = _mm512_shuffle_f32x4(p0, q0, 0xDD);
    r[8 + k] = _mm512_shuffle_f32x4(p1, q1, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(p1, q1, 0xDD);
  }
}

inline __m512 load_floats(const float* p, __mmask16 keep) { return _mm512_maskz_loadu_ps(keep, p); }
inline __m512 load_floats(const Half* p, __mmask16 keep) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, p)); }

// Element at[o] of p for each o in keep as floats, zero elsewhere. A half is read as the
// low half of 32 bits: the two bytes after a GGUF block's d (or m) are the block's own.
inline __m512 gather_floats(const float* p, __m512i at, __mmask16 keep) {
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keep, at, p, 4);
}
inline __m512 gather_floats(const Half* p, __m512i at, __mmask16 keep) {
  const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, at, p, 2);
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
}

// A (rows, cols) matrix with `stride` between rows and `step` between columns (rows <=
// 16) as floats into out (cols, 16), column-major: out[c][o] = m[o][c], zero for o >= rows.
template <typename S>
void columns(const S* m, int64_t stride, int64_t step, int64_t rows, int64_t cols, float* out) {
  // A GGUF file's scales, a block apart: a column's 16 rows in one gather.
  if (step != 1 && stride < (int64_t(1) << 27)) {
    const __mmask16 keep = __mmask16((1u << rows) - 1);
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(int32_t(stride)));
    for (int64_t c = 0; c < cols; ++c) _mm512_storeu_ps(out + c * T, gather_floats(m + c * step, at, keep));
    return;
  }
  if (step != 1) {  // rows too far apart for a gather's 32-bit offsets: one by one
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t o = 0; o < 16; ++o) out[c * T + o] = o < rows ? to_float(m[o * stride + c * step]) : 0.0f;
    return;
  }
  int64_t c0 = 0;
  for (; c0 + 16 <= cols; c0 += 16) {
    __m512 r[16];
    for (int64_t o = 0; o < 16; ++o) r[o] = o < rows ? load_floats(m + o * stride + c0, 0xFFFF) : _mm512_setzero_ps();
    transpose16(r);
    for (int64_t c = 0; c < 16; ++c) _mm512_storeu_ps(out + (c0 + c) * T, r[c]);
  }
  for (; c0 < cols; ++c0)  // the last few columns one by one: cheaper than a transpose
    for (int64_t o = 0; o < 16; ++o) out[c0 * T + o] = o < rows ? to_float(m[o * stride + c0]) : 0.0f;
}

// Dword j of one block of the tile's 16 rows (d: lane o row o's) into the block's 8 tile
// vectors q: 4 bits (j < 4), weights 4j..4j+3 from the low nibbles into q[j] and 16 + 4j..
// from the high ones into q[4 + j], each less z; 8 bits (j < 8), the bytes xor flip into q[j].
inline void put_dword(__m512i* q, int64_t bits, int64_t j, __m512i d, __m512i z, __m512i flip) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  if (bits == 4) {
    _mm512_storeu_si512(q + j, _mm512_sub_epi8(_mm512_and_si512(d, low), z));
    _mm512_storeu_si512(q + 4 + j, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(d, 4), low), z));
  } else {
    _mm512_storeu_si512(q + j, _mm512_xor_si512(d, flip));
  }
}

// The integers of rows [o0, o0 + rows) of the weight into `tile` (rows < 16: the rest zero);
// zero 8 (Q4_0): the nibbles less 8, signed bytes as an 8-bit weight's; biased (8 bits):
// w + 128 (the sign bit flipped), unsigned bytes as dpbusd's first operand takes them.
template <typename S>
void pack_q(const PartView<S>& w, int64_t bits, int64_t zero, bool biased, int64_t in, int64_t o0, int64_t rows,
            Tile& tile) {
  const int64_t nb = in / QB;
  tile.q.resize(nb * 8 * T * 4);
  const __m512i z = _mm512_set1_epi8(char(zero)), flip = _mm512_set1_epi8(char(biased ? 0x80 : 0));
  for (int64_t b = 0; b < nb; ++b) {
    __m512i* q = reinterpret_cast<__m512i*>(tile.q.data() + b * 8 * T * 4);
    const uint8_t* src = w.block(o0, b);
    // 4 bits: byte i holds weight i (low nibble) and weight 16 + i (high); 8 bits: two halves of 16 bytes.
    for (int64_t half = 0; half < (bits == 4 ? 1 : 2); ++half) {
      __m512i d[4];
      gather_dwords(src + 16 * half, w.q_row, rows, d);
      for (int j = 0; j < 4; ++j) put_dword(q, bits, 4 * half + j, d[j], z, flip);
    }
  }
}

// The tile's scales and offsets as columns (both paths read them so).
template <typename S>
void pack_columns(const PartView<S>& w, int64_t group, int64_t in, int64_t o0, int64_t rows, Tile& tile) {
  const int64_t nb = in / QB, ng = in / group;
  tile.scales.resize(ng * T);
  tile.offsets.resize(w.o ? nb * T : 0);
  columns(w.s + o0 * w.s_row, w.s_row, w.s_col, rows, ng, tile.scales.data());
  if (w.o) columns(w.o + o0 * w.o_row, w.o_row, w.o_col, rows, nb, tile.offsets.data());
}

// The float steps of one group for one row: acc = fma(float(s), scale * xd, acc).
inline __m512 scale_add(__m512i s, __m512 scale, float xd, __m512 acc) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(xd)), acc);
}
inline __m512 scale_add(__m512i s, const float* scale, float xd, __m512 acc) {
  return scale_add(s, _mm512_loadu_ps(scale), xd, acc);
}

// A block's offset term for one row, after its groups: acc = fma(offset, xs, acc).
inline __m512 offset_add(__m512 offset, float xs, __m512 acc) {
  return _mm512_fmadd_ps(offset, _mm512_set1_ps(xs), acc);
}
inline __m512 offset_add(const float* offset, float xs, __m512 acc) { return offset_add(_mm512_loadu_ps(offset), xs, acc); }

// Whether direct_rows gathers the part's scales (and offsets) itself: a GGUF file's, a block
// apart, lie in the lines its loads of the block's integers read, where laying them out
// for the tile first would be a pass of its own over the weight.
template <typename S>
inline bool gathers_scales(const PartView<S>& w) {
  constexpr int64_t far = int64_t(1) << 27;  // a gather's offsets are 32-bit
  return w.s_col != 1 && w.s_row < far && (!w.o || (w.o_col != 1 && w.o_row < far));
}

// The integer vnni_rows' tiles are offset by where they are (product's `zeroed`): 128 on 8
// bits' biased tile, else the weight's zero (Q4_0's 8), which set_row folds into the rows' sums.
inline int32_t vnni_zero(int64_t bits, int64_t zero) { return bits == 8 ? 128 : int32_t(zero); }

// The activations as vnni_rows reads them, MR rows at a time (a row group):
// codes[group][b][j][m] the four codes 4j..4j+3 of block b of row m of the group, xd and
// xs [group][b][m], and sums [group][b][g][m] each group's (of 16 or 32) sum of codes times
// -zero (vnni_zero: the integer vnni_rows' tiles are offset by), so
// that a weight vector's MR broadcasts read one line and a group's loads need one
// pointer each, not MR.
struct RowGroups {
  std::vector<int32_t> codes, sums;
  std::vector<float> xd, xs;
  int64_t nb = 0;

  // Room for n rows of `in` codes, for the weight's groups of `group`, and the row
  // group's values of no rows yet (set_row fills each row, on any thread).
  void resize(int64_t n, int64_t in, int64_t group, bool offsets) {
    nb = in / QB;
    const int64_t groups = (n + MR - 1) / MR;
    // (a last group's rows past n are never read: vnni_rows takes the rows there are)
    codes.resize(groups * nb * 8 * MR);
    xd.resize(groups * nb * MR);
    xs.resize(offsets ? groups * nb * MR : 0);
    sums.resize(groups * nb * (QB / group) * MR);
  }

  // Row m's codes q (in) and per-block values (in / 32; xs null: no offsets).
  void set_row(int64_t m, const int8_t* q, const float* row_xd, const float* row_xs, int64_t group, int32_t zero) {
    const int64_t per_block = QB / group, at = (m / MR) * nb * MR + m % MR;
    int32_t* c = codes.data() + (m / MR) * nb * 8 * MR + m % MR;
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t j = 0; j < 8; ++j) std::memcpy(c + (b * 8 + j) * MR, q + b * QB + 4 * j, 4);
      xd[at + b * MR] = row_xd[b];
      if (row_xs) xs[at + b * MR] = row_xs[b];
      // Each 8 codes' sum, +128 each (as unsigned bytes), in a 64-bit lane: a group of 16 is two lanes.
      const __m256i eights = _mm256_sad_epu8(
          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * QB)), _mm256_set1_epi8(char(0x80))),
          _mm256_setzero_si256());
      const int64_t lane[4] = {_mm256_extract_epi64(eights, 0), _mm256_extract_epi64(eights, 1),
                               _mm256_extract_epi64(eights, 2), _mm256_extract_epi64(eights, 3)};
      for (int64_t g = 0; g < per_block; ++g) {
        int64_t sum = -128 * group;
        for (int64_t k = g * group / 8; k < (g + 1) * group / 8; ++k) sum += lane[k];
        sums[(((m / MR) * nb + b) * per_block + g) * MR + m % MR] = -zero * int32_t(sum);
      }
    }
  }
};

// The first R rows of a row group against C tiles side by side (16 outputs each) with
// VNNI: the tiles' nb blocks, which are blocks kb0.. of the rows, continuing `sums`
// (sums[m * C + c]: row m's accumulator of tile c over the blocks before), for G groups a
// block (1: of 32, 2: of 16) and BITS-bit integers. Weight vector j of a block (the same
// four weights of a tile's 16 outputs) is loaded once for the R rows, and each row's four
// codes, broadcast, meet the C tiles' vectors: a load for every C dot products, which
// keeps the loads from bounding the units. The R x C int32 sums are independent chains,
// so the units take one or two a cycle while each waits out its latency; the float steps
// come once per group. The template arguments let every loop unroll and keep the sums
// and (but for a few, at 8 x 2) the accumulators in registers.
// zeroed: each group's sum starts from rows.sums, -zero x the sum of its codes (set_row's
// zero, vnni_zero), else from 0: 8 on Q4_0's unsigned tile (the nibbles as stored), 128 on
// a biased 8-bit tile (pack_q), the signed weights' integer; a signed tile (AMX's) has none.
template <int C, int R, int G, int BITS>
void vnni_rows(const Tile* const* tiles, const RowGroups& rows, int64_t group, int64_t kb0, int64_t nb, bool zeroed,
               __m512* sums) {
  constexpr int D = 8 / G;  // dwords of a group
  const bool offsets = !tiles[0]->offsets.empty();
  const int64_t at = group * rows.nb * MR + kb0 * MR;  // the group's block kb0
  const int32_t* __restrict codes = rows.codes.data() + at * 8;
  const float* __restrict xd = rows.xd.data() + at;
  const float* __restrict xs = offsets ? rows.xs.data() + at : nullptr;
  const int32_t* __restrict code_sums = rows.sums.data() + at * G;
  // The tiles' arrays, read once: the loop then keeps their addresses in registers.
  const uint8_t* q[C];
  const float *scales[C], *offs[C];
  for (int c = 0; c < C; ++c) q[c] = tiles[c]->q.data(), scales[c] = tiles[c]->scales.data(), offs[c] = tiles[c]->offsets.data();
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) acc[m][c] = sums[m * C + c];
  for (int64_t b = 0; b < nb; ++b) {
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) {
      __m512i s[R][C];
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m)
#pragma GCC unroll 2
        for (int c = 0; c < C; ++c)
          s[m][c] = zeroed ? _mm512_set1_epi32(code_sums[(b * G + g) * MR + m]) : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = g * D; j < (g + 1) * D; ++j) {
        __m512i w[C];
        __mmask64 negative[C];
#pragma GCC unroll 2
        for (int c = 0; c < C; ++c) {
          w[c] = _mm512_loadu_si512(q[c] + (b * 8 + j) * T * 4);
          if constexpr (BITS == 8) {  // dpbusd multiplies unsigned by signed: |w| by x with w's sign
            negative[c] = _mm512_movepi8_mask(w[c]);
            w[c] = _mm512_abs_epi8(w[c]);
          }
        }
#pragma GCC unroll 16
        for (int m = 0; m < R; ++m) {
          const __m512i xb = _mm512_set1_epi32(codes[(b * 8 + j) * MR + m]);
#pragma GCC unroll 2
          for (int c = 0; c < C; ++c) {
            if constexpr (BITS == 8)
              s[m][c] = _mm512_dpbusd_epi32(s[m][c], w[c],
                                            _mm512_mask_sub_epi8(xb, negative[c], _mm512_setzero_si512(), xb));
            else
              s[m][c] = _mm512_dpbusd_epi32(s[m][c], w[c], xb);
          }
        }
      }
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) {
        const __m512 scale = _mm512_loadu_ps(scales[c] + (b * G + g) * T);
#pragma GCC unroll 16
        for (int m = 0; m < R; ++m) acc[m][c] = scale_add(s[m][c], scale, xd[b * MR + m], acc[m][c]);
      }
    }
#pragma GCC unroll 2
    for (int c = 0; offsets && c < C; ++c) {
      const __m512 offset = _mm512_loadu_ps(offs[c] + b * T);
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m) acc[m][c] = offset_add(offset, xs[b * MR + m], acc[m][c]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) sums[m * C + c] = acc[m][c];
}

}  // namespace tiles
