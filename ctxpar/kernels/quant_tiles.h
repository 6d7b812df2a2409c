// The block-quantized projection on CPUs with AVX-512 VNNI (and AMX-INT8 where the
// CPU has it): every row count, a decode step's one row and a prefill's thousands,
// takes this one path, so a row's result never depends on the rows beside it.
//
// Included by quant_gemv.cpp (its weight layout, read through quant_part.h's strides;
// its int8 activations: xq codes, xd scales, xs = xd * sum of codes, per block of 32).
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
// one lane per output, blocks in order. Three integer engines feed it, and give the
// same bits because the integers are exact and the float steps one code shape:
//   - AMX computes 16 rows' group sums at once (rows in groups of 16, where the CPU has it);
//   - the VNNI loop the rows left over (every row without AMX), a few at a time against
//     two laid-out tiles side by side, or one;
//   - a call of fewer than DIRECT_ROWS rows (a decode step) reads the weight where it
//     lies (direct_rows, DIRECT_GROUP rows a pass over a tile): laying out a tile costs
//     more than a few rows' use of it; a GGUF file's tiles are laid out from windows of
//     its blocks (pack_window).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define CTXPAR_AMX 1
#endif

namespace tiles {

constexpr int64_t QB = 32;  // weights per block
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

// Sums of outputs' partial dot products, four outputs at a time: v[i] (output 4g + i,
// 16 int32 lanes, lane 4L + p the p-th partial of 128-bit lane L) -> t[g], lane 4L + i
// output 4g + i's sum over 128-bit lane L, by two transposing add steps within lanes;
// then spread_lanes turns t[0..3] into r[L] = (128-bit lane L's sums, outputs 0..15).
inline __m512i sum_four(const __m512i v[4]) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

inline void spread_lanes(const __m512i t[4], __m512i r[4]) {
  const __m512i p0 = _mm512_shuffle_i32x4(t[0], t[1], 0x44), p1 = _mm512_shuffle_i32x4(t[0], t[1], 0xEE);
  const __m512i q0 = _mm512_shuffle_i32x4(t[2], t[3], 0x44), q1 = _mm512_shuffle_i32x4(t[2], t[3], 0xEE);
  r[0] = _mm512_shuffle_i32x4(p0, q0, 0x88);
  r[1] = _mm512_shuffle_i32x4(p0, q0, 0xDD);
  r[2] = _mm512_shuffle_i32x4(p1, q1, 0x88);
  r[3] = _mm512_shuffle_i32x4(p1, q1, 0xDD);
}

// Blocks [b0, b0 + blocks) of a row (blocks <= 64 / bytes, `bytes` 16 or 32 a block) as one
// vector, zero past them: one load where they are adjacent, else a load a block.
template <typename S>
inline __m512i load_blocks(const PartView<S>& w, int64_t row, int64_t b0, int64_t blocks, int64_t bytes) {
  const uint8_t* p = w.block(row, b0);
  if (w.q_block == bytes) {
    const int64_t width = blocks * bytes;
    return _mm512_maskz_loadu_epi8(width == 64 ? ~__mmask64(0) : (__mmask64(1) << width) - 1, p);
  }
  if (bytes == 32) {
    const __m256i second = blocks > 1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + w.q_block))
                                      : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                              second, 1);
  }
  auto piece = [&](int64_t k) {
    return k < blocks ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k * w.q_block)) : _mm_setzero_si128();
  };
  __m512i v = _mm512_castsi128_si512(piece(0));
  v = _mm512_inserti32x4(v, piece(1), 1);
  v = _mm512_inserti32x4(v, piece(2), 2);
  return _mm512_inserti32x4(v, piece(3), 3);
}

// A GGUF file's blocks as they lie (Q4_0, Q4_1, Q8_0: d [, m] then q), a load's blocks
// (4 of 4 bits, 2 of 8) read as two 64-byte windows of a row, the first from the first
// block's d, the second ending with the last block's q: one two-source byte permute
// gathers the q bytes, and one word permute under the row's mask moves its blocks' d
// and m (8 halves) into 128-bit lane o % 4 of picks[o / 4]; after the tile's 16 rows,
// two rounds of two-source word permutes regroup them by block (regroup). Loads a block
// apart and a 16-lane gather of the scales per block cost several times more.
struct Window {
  bool on = false;
  int64_t lead = 0, tail = 0;  // bytes of a block before its q; the second window's start
  __m512i q_at, pick_at;  // permute indices: the q bytes; a row's d of blocks 0-3, then m of blocks 0-3
  __m512i by_block[2], by_pair[2];  // regroup's: rows 0-7 (or 8-15) by d or m; blocks 2h, 2h + 1 of 16 rows
};

template <typename S>
Window window_of(const PartView<S>& w, int64_t bits, int64_t group) {
  Window win;
#if defined(__AVX512VBMI__)
  const int64_t bytes = QB * bits / 8, per_load = bits == 4 ? 4 : 2, lead = w.q_block - bytes;
  const int64_t span = per_load * w.q_block, unit = int64_t(sizeof(S));
  auto before = [&](const S* p, int64_t row, int64_t col) {  // bytes from a block's q back to p's value, or 0
    const int64_t d = reinterpret_cast<const char*>(p) - reinterpret_cast<const char*>(w.q);
    return row * unit == w.q_row && col * unit == w.q_block && d < 0 && d >= -lead && d % 2 == 0 ? -d : 0;
  };
  const int64_t s_before = before(w.s, w.s_row, w.s_col), o_before = w.o ? before(w.o, w.o_row, w.o_col) : 1;
  if (unit != 2 || group != QB || lead <= 0 || span <= 64 || span > 128 || !s_before || !o_before) return win;
  const int64_t last = (per_load - 1) * w.q_block + lead - std::min(s_before, w.o ? o_before : s_before);
  if (last + 2 > 64) return win;  // every d and m in the first window
  win.on = true, win.lead = lead, win.tail = span - 64;
  alignas(64) uint8_t q_at[64];
  alignas(64) uint16_t pick_at[32], by_block[2][32], by_pair[2][32];
  for (int64_t i = 0; i < 64; ++i) {
    const int64_t at = (i / bytes) * w.q_block + lead + i % bytes;
    q_at[i] = uint8_t(at < 64 ? at : 64 + at - win.tail);
  }
  for (int64_t p = 0; p < 32; ++p) {
    const int64_t j = p % 8, k = std::min(j % 4, per_load - 1), before = j < 4 ? s_before : w.o ? o_before : 0;
    pick_at[p] = uint16_t((k * w.q_block + lead - before) / 2);
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t r = p % 8;  // by_block[h]: word p = block p / 8 (d for h 0, m for 1) of row p % 8
      by_block[h][p] = uint16_t((r / 4) * 32 + 8 * (r % 4) + 4 * h + p / 8);
      const int64_t o = p % 16;  // by_pair[h]: word p = block 2h + p / 16 of row o
      by_pair[h][p] = uint16_t((o / 8) * 32 + 8 * (2 * h + p / 16) + o % 8);
    }
  }
  win.q_at = _mm512_load_si512(q_at), win.pick_at = _mm512_load_si512(pick_at);
  for (int h = 0; h < 2; ++h) win.by_block[h] = _mm512_load_si512(by_block[h]), win.by_pair[h] = _mm512_load_si512(by_pair[h]);
#else
  (void)w, (void)bits, (void)group;
#endif
  return win;
}

// The q bytes of a load's two windows (a CPU without VBMI's byte permute never has a window on).
inline __m512i window_q(const Window& win, __m512i a, __m512i b) {
#if defined(__AVX512VBMI__)
  return _mm512_permutex2var_epi8(a, win.q_at, b);
#else
  (void)win, (void)b;
  return a;
#endif
}

// picks[4] (a window's picks of 16 rows) -> out[2]: block 2h + p / 16's value of row p % 16
// at word p of out[h], d (h_m 0) or m (1).
inline void regroup(const Window& win, const __m512i picks[4], int h_m, __m512i out[2]) {
  const __m512i low = _mm512_permutex2var_epi16(picks[0], win.by_block[h_m], picks[1]);  // rows 0-7
  const __m512i high = _mm512_permutex2var_epi16(picks[2], win.by_block[h_m], picks[3]);  // rows 8-15
  out[0] = _mm512_permutex2var_epi16(low, win.by_pair[0], high);
  out[1] = _mm512_permutex2var_epi16(low, win.by_pair[1], high);
}

// Block k's 16 halves of regroup's words, as floats.
inline __m512 halves(const __m512i words[2], int64_t k) {
  const __m512i v = words[k / 2];
  return _mm512_cvtph_ps(k % 2 ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v));
}

// R rows' activations as direct_rows reads them (R <= DIRECT_GROUP).
struct DirectRows {
  const int8_t *xq[DIRECT_GROUP], *xk[DIRECT_GROUP];
  const float *xd[DIRECT_GROUP], *xs[DIRECT_GROUP];
  const int32_t* xz[DIRECT_GROUP];  // null: no zero
};

// R rows against rows [o0, o0 + rows) of the weight read where they lie, for a few
// rows (a decode step): no tile is laid out, and each load of the weight serves the R
// rows. A 512-bit load holds 4 blocks (4 bits) or 2 (8 bits) of one output; dpbusd
// leaves partial sums of 4 products per lane, which sum_four and spread_lanes add up
// per group into one vector over the 16 outputs. The group sums are the integers
// vnni_rows finds, and the float steps are the same, so the bits are too. xk: a row's
// codes as the 4-bit loads pair them (direct_codes).
// next_rows: rows of the tile after this one, whose same bytes each load prefetches:
// the loads of a tile are 16 streams a row apart, which the hardware prefetchers do
// not run ahead of, so without it a decode step waits on memory at every tile.
template <typename S, int R, int BITS>
void direct_rows(const PartView<S>& w, int64_t group, int64_t in, int64_t o0, int64_t rows, int64_t next_rows,
                 const Tile& tile, const Window& win, const DirectRows& x, __m512* acc) {
  constexpr int64_t bytes = QB * BITS / 8, per_load = BITS == 4 ? 4 : 2;
  const int64_t nb = in / QB;
  const bool gathered = gathers_scales(w), offsets = gathered ? w.o != nullptr : !tile.offsets.empty();
  const __mmask16 keep = __mmask16((1u << rows) - 1);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i s_at = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(int32_t(w.s_row)));
  const __m512i o_at = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(int32_t(w.o_row)));
  auto scale = [&](int64_t j) {  // group j's scales of the 16 outputs
    if (gathered) return gather_floats(w.s + o0 * w.s_row + j * w.s_col, s_at, keep);
    return _mm512_loadu_ps(tile.scales.data() + j * T);
  };
  auto offset = [&](int64_t b) {
    if (gathered) return gather_floats(w.o + o0 * w.o_row + b * w.o_col, o_at, keep);
    return _mm512_loadu_ps(tile.offsets.data() + b * T);
  };
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(char(0x80));
  __m512 sum[R];  // the rows' accumulators, in registers until the end
#pragma GCC unroll 4
  for (int m = 0; m < R; ++m) sum[m] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += per_load) {
    const int64_t blocks = std::min(per_load, nb - b0);
    const int64_t width = blocks * bytes;  // bytes of codes in this load: 64, or fewer at the row's end
    const bool windowed = win.on && blocks == per_load;
    // Blocks a GGUF file holds (d before each) take more than one line a load: the last's too.
    const int64_t span = (blocks - 1) * w.q_block + bytes - 1;
    for (int64_t o = 0; o < next_rows; ++o) {
      const char* ahead = reinterpret_cast<const char*>(w.block(o0 + T + o, b0));
      _mm_prefetch(ahead, _MM_HINT_T0);
      if (span >= 64) _mm_prefetch(ahead + span, _MM_HINT_T0);
    }
    __m512i xa[R], xb[R];  // 4 bits: the codes meeting the low and high nibbles; 8 bits: xa the codes
#pragma GCC unroll 4
    for (int m = 0; m < R; ++m) {
      if constexpr (BITS == 4) {
        xa[m] = _mm512_loadu_si512(x.xk[m] + b0 * QB), xb[m] = _mm512_loadu_si512(x.xk[m] + b0 * QB + 64);
      } else {
        // dpbusd multiplies unsigned by signed: w + 128 (its sign bit flipped) by x, and
        // 128 * (the group's sum of x) subtracted after the sums (the same for every output).
        xa[m] = _mm512_maskz_loadu_epi8(width == 64 ? ~__mmask64(0) : (__mmask64(1) << width) - 1, x.xq[m] + b0 * QB);
      }
    }
    __m512i picks[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    __m512i t[R][4];
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      __m512i v[R][4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const int64_t o = 4 * g + i;
        if (o >= rows) {
#pragma GCC unroll 4
          for (int m = 0; m < R; ++m) v[m][i] = _mm512_setzero_si512();
          continue;
        }
        __m512i q;
        if (windowed) {
          const uint8_t* start = w.block(o0 + o, b0) - win.lead;
          const __m512i a = _mm512_loadu_si512(start), b = _mm512_loadu_si512(start + win.tail);
          q = window_q(win, a, b);
          picks[g] = _mm512_mask_permutexvar_epi16(picks[g], __mmask32(0xFFu << (8 * i)), win.pick_at, a);
        } else {
          q = load_blocks(w, o0 + o, b0, blocks, bytes);
        }
        if constexpr (BITS == 4) {
          const __m512i lo = _mm512_and_si512(q, low), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
#pragma GCC unroll 4
          for (int m = 0; m < R; ++m)
            v[m][i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xa[m]), hi, xb[m]);
        } else {
          const __m512i u = _mm512_xor_si512(q, flip);
#pragma GCC unroll 4
          for (int m = 0; m < R; ++m) v[m][i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xa[m]);
        }
      }
#pragma GCC unroll 4
      for (int m = 0; m < R; ++m) t[m][g] = sum_four(v[m]);
    }
    __m512 block_scale[4], block_offset[4];
    __m512i scale_words[2], offset_words[2];
    if (windowed) {
      regroup(win, picks, 0, scale_words);
      if (w.o) regroup(win, picks, 1, offset_words);
    }
    for (int64_t k = 0; k < blocks; ++k) {
      if (windowed) {
        block_scale[k] = halves(scale_words, k);
        if (w.o) block_offset[k] = halves(offset_words, k);
      } else if (BITS == 4 || group == QB) {
        block_scale[k] = scale(b0 + k);
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < R; ++m) {
      __m512i r[4];
      spread_lanes(t[m], r);
      if constexpr (BITS == 8) {
        __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, xa[m]);
        c = _mm512_add_epi32(c, _mm512_shuffle_epi32(c, _MM_PERM_BADC));
        c = _mm512_add_epi32(c, _mm512_shuffle_epi32(c, _MM_PERM_CDAB));  // each 128-bit lane's total, 4 times
        r[0] = _mm512_sub_epi32(r[0], _mm512_shuffle_i32x4(c, c, 0x00));
        r[1] = _mm512_sub_epi32(r[1], _mm512_shuffle_i32x4(c, c, 0x55));
        r[2] = _mm512_sub_epi32(r[2], _mm512_shuffle_i32x4(c, c, 0xAA));
        r[3] = _mm512_sub_epi32(r[3], _mm512_shuffle_i32x4(c, c, 0xFF));
      }
      const float *xd = x.xd[m], *xs = x.xs[m];
      for (int64_t k = 0; k < blocks; ++k) {
        const int64_t b = b0 + k;
        // Group sums of block b: 4 bits, r[k] (a block's 32 products in one 128-bit lane);
        // 8 bits, r[2k] and r[2k + 1] (its halves), added for a group of 32.
        if constexpr (BITS == 4) {  // zero 8: sum (q - 8) x = sum q x - 8 sum x
          const __m512i s = x.xz[m] ? _mm512_add_epi32(r[k], _mm512_set1_epi32(x.xz[m][b])) : r[k];
          sum[m] = scale_add(s, block_scale[k], xd[b], sum[m]);
        } else if (group == QB) {
          sum[m] = scale_add(_mm512_add_epi32(r[2 * k], r[2 * k + 1]), block_scale[k], xd[b], sum[m]);
        } else {
          sum[m] = scale_add(r[2 * k], scale(2 * b), xd[b], sum[m]);
          sum[m] = scale_add(r[2 * k + 1], scale(2 * b + 1), xd[b], sum[m]);
        }
        if (offsets) sum[m] = offset_add(windowed ? block_offset[k] : offset(b), xs[b], sum[m]);
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < R; ++m) acc[m] = sum[m];
}

// A row's codes as direct_rows' 4-bit loads pair them: per 4 blocks, the first 16 codes
// of each (which meet the weights' low nibbles), then the last 16 (the high nibbles).
inline void direct_codes(const int8_t* xq, int64_t in, int8_t* xk) {
  const int64_t nb = in / QB;
  for (int64_t b = 0; b < nb; ++b) {
    int8_t* quad = xk + (b / 4) * 4 * QB;
    std::copy(xq + b * QB, xq + b * QB + 16, quad + (b % 4) * 16);
    std::copy(xq + b * QB + 16, xq + (b + 1) * QB, quad + 64 + (b % 4) * 16);
  }
}

// pack_q and pack_columns for a GGUF file's blocks that `win` reads (Window): a load's
// blocks of each of the 16 rows come in two 64-byte windows, one byte permute gathers
// their q bytes and one word permute their d (and m), and a 16 x 16 dword transpose
// turns the 16 rows' q into the tile's vectors. pack_q's per-block loads of 16 bytes and
// pack_columns' gather per block cost several times more, which a call of a few rows
// (a decode step of 4 or more) pays in full. The tile's bytes are pack_q's, its floats
// the same halves converted, so vnni_rows computes the same bits from either.
// Prefetches the same blocks of the `next_rows` rows from `next_o` (the tile this thread
// packs after the next, as direct_rows does for the next).
template <typename S>
void pack_window(const PartView<S>& w, const Window& win, int64_t bits, int64_t zero, bool biased, int64_t in,
                 int64_t o0, int64_t rows, int64_t next_o, int64_t next_rows, Tile& tile) {
  const int64_t bytes = QB * bits / 8, per_load = bits == 4 ? 4 : 2, nb = in / QB;
  tile.q.resize(nb * 8 * T * 4);
  tile.scales.resize(nb * T);
  tile.offsets.resize(w.o ? nb * T : 0);
  const __m512i z = _mm512_set1_epi8(char(zero)), flip = _mm512_set1_epi8(char(biased ? 0x80 : 0));
  const int64_t dwords = bits == 4 ? 4 : 8;  // a block's dwords of integers
  for (int64_t b0 = 0; b0 < nb; b0 += per_load) {
    const int64_t blocks = std::min(per_load, nb - b0);
    const bool windowed = win.on && blocks == per_load;
    const int64_t span = (blocks - 1) * w.q_block + bytes - 1;
    for (int64_t o = 0; o < next_rows; ++o) {
      const char* ahead = reinterpret_cast<const char*>(w.block(next_o + o, b0));
      _mm_prefetch(ahead, _MM_HINT_T0);
      if (span >= 64) _mm_prefetch(ahead + span, _MM_HINT_T0);
    }
    __m512 r[T];  // row o's q bytes of the load's blocks, as transpose16 moves them
    __m512i picks[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int64_t o = 0; o < T; ++o) {
      __m512i q = _mm512_setzero_si512();
      if (o < rows && windowed) {
        const uint8_t* start = w.block(o0 + o, b0) - win.lead;
        const __m512i a = _mm512_loadu_si512(start), b = _mm512_loadu_si512(start + win.tail);
        q = window_q(win, a, b);
        picks[o / 4] = _mm512_mask_permutexvar_epi16(picks[o / 4], __mmask32(0xFFu << (8 * (o % 4))), win.pick_at, a);
      } else if (o < rows) {
        q = load_blocks(w, o0 + o, b0, blocks, bytes);
      }
      r[o] = _mm512_castsi512_ps(q);
    }
    transpose16(r);  // r[k]: dword k of the 16 rows, dword k % dwords of block b0 + k / dwords
    for (int64_t k = 0; k < blocks * dwords; ++k) {
      __m512i* q = reinterpret_cast<__m512i*>(tile.q.data() + (b0 + k / dwords) * 8 * T * 4);
      put_dword(q, bits, k % dwords, _mm512_castps_si512(r[k]), z, flip);
    }
    if (windowed) {
      __m512i words[2];
      regroup(win, picks, 0, words);
      for (int64_t k = 0; k < blocks; ++k)
        _mm512_storeu_ps(tile.scales.data() + (b0 + k) * T, halves(words, k));
      if (w.o) {
        regroup(win, picks, 1, words);
        for (int64_t k = 0; k < blocks; ++k)
          _mm512_storeu_ps(tile.offsets.data() + (b0 + k) * T, halves(words, k));
      }
    } else {  // the row's last blocks (fewer than a load's): gathered, as pack_columns does
      columns(w.s + o0 * w.s_row + b0 * w.s_col, w.s_row, w.s_col, rows, blocks, tile.scales.data() + b0 * T);
      if (w.o) columns(w.o + o0 * w.o_row + b0 * w.o_col, w.o_row, w.o_col, rows, blocks, tile.offsets.data() + b0 * T);
    }
  }
}

#if defined(CTXPAR_AMX)
// Linux hands out AMX's tile state only on request, once per process.
inline bool amx_ready() {
  static const bool ready = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ready;
}

// Tile registers: 0 and 1 the activations (16 rows x group bytes), 2 and 3 the
// weights (group / 4 rows x 64 bytes), 4 to 7 the sums (16 x 16 int32): unit u of
// amx_rows uses activations and weights u % 2 and sums u % 4, so that a unit's tiles
// are free while the units before it finish. Loaded on every call: other libraries on
// these threads (oneDNN's AMX kernels in PyTorch) release the tiles when they finish.
inline void amx_configure(int64_t group) {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;  // palette 1
  uint16_t* colsb = reinterpret_cast<uint16_t*>(cfg + 16);
  uint8_t* rows = cfg + 48;
  for (int t = 0; t < 2; ++t) colsb[t] = uint16_t(group), rows[t] = 16;
  for (int t = 2; t < 4; ++t) colsb[t] = 64, rows[t] = uint8_t(group / 4);
  for (int t = 4; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  _tile_loadconfig(cfg);
}

// A row group's activation scales (and scale x sum of codes, for offsets) by block,
// 16 rows side by side: scales[b * 16 + m] = xd[(m0 + m) * nb + b], so that a unit's
// float steps broadcast them from one line instead of sixteen.
struct GroupScales {
  std::vector<float> xd, xs;
  void fill(const float* xd_rows, const float* xs_rows, int64_t m0, int64_t nb, bool offsets) {
    xd.resize(nb * 16);
    xs.resize(offsets ? nb * 16 : 0);
    for (int64_t m = 0; m < 16; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        xd[b * 16 + m] = xd_rows[(m0 + m) * nb + b];
        if (offsets) xs[b * 16 + m] = xs_rows[(m0 + m) * nb + b];
      }
  }
};

// AMX's intrinsics take tile numbers as literals: unit u of amx_rows (S = u % 4) issues
// its product into tiles (S % 2, 2 + S % 2 -> 4 + S), stores unit u - 1's sums, and
// runs the float steps of unit u - 2, whose sums were stored one unit earlier. In
// program order the three are independent, so the matrix unit, the stores and the
// vector units overlap; in a unit's own order (product, store, float steps) each
// would wait on the one before.
template <int G>  // groups per block: 1 (groups of 32) or 2 (of 16)
struct AmxRows {
  static constexpr int64_t group = QB / G;
  const Tile& tile;
  int64_t bits, in, units;
  const int8_t* a;  // the group's first row of codes
  const GroupScales& gs;
  bool offsets;
  alignas(64) int32_t sums[4][16 * 16];

  template <int S>
  __attribute__((always_inline)) inline void step(int64_t u, __m512* r) {
    if (u >= 2) floats(u - 2, r);
    if (u >= 1 && u <= units) {
      if constexpr (S == 0) _tile_stored(7, sums[3], 64);
      if constexpr (S == 1) _tile_stored(4, sums[0], 64);
      if constexpr (S == 2) _tile_stored(5, sums[1], 64);
      if constexpr (S == 3) _tile_stored(6, sums[2], 64);
    }
    if (u < units) {
      const int8_t* x = a + (u / G) * QB + (u % G) * group;
      const uint8_t* w = tile.q.data() + ((u / G) * 8 + (u % G) * group / 4) * T * 4;
      if constexpr (S % 2 == 0) {
        _tile_loadd(0, x, in);
        _tile_loadd(2, w, 64);
      } else {
        _tile_loadd(1, x, in);
        _tile_loadd(3, w, 64);
      }
      if constexpr (S == 0) _tile_zero(4);
      if constexpr (S == 1) _tile_zero(5);
      if constexpr (S == 2) _tile_zero(6);
      if constexpr (S == 3) _tile_zero(7);
      if (bits == 4) {  // signed codes by unsigned nibbles
        if constexpr (S == 0) _tile_dpbsud(4, 0, 2);
        if constexpr (S == 1) _tile_dpbsud(5, 1, 3);
        if constexpr (S == 2) _tile_dpbsud(6, 0, 2);
        if constexpr (S == 3) _tile_dpbsud(7, 1, 3);
      } else {
        if constexpr (S == 0) _tile_dpbssd(4, 0, 2);
        if constexpr (S == 1) _tile_dpbssd(5, 1, 3);
        if constexpr (S == 2) _tile_dpbssd(6, 0, 2);
        if constexpr (S == 3) _tile_dpbssd(7, 1, 3);
      }
    }
  }

  // The float steps of unit v, as vnni_rows takes them: per row, the group's scale
  // times the row's, then the block's offset after its last group.
  __attribute__((always_inline)) inline void floats(int64_t v, __m512* r) {
    const int64_t b = v / G;
    const __m512 scale = _mm512_loadu_ps(tile.scales.data() + v * T);
    const int32_t* s = sums[v & 3];
    const float* xd = gs.xd.data() + b * 16;
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m)
      r[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s + 16 * m)),
                             _mm512_mul_ps(scale, _mm512_set1_ps(xd[m])), r[m]);
    if (offsets && v % G == G - 1) {
      const __m512 off = _mm512_loadu_ps(tile.offsets.data() + b * T);
      const float* xs = gs.xs.data() + b * 16;
#pragma GCC unroll 16
      for (int m = 0; m < 16; ++m) r[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(xs[m]), r[m]);
    }
  }

  void run(__m512* acc) {
    __m512 r[16];
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m) r[m] = _mm512_setzero_ps();
    int64_t u = 0;
    for (; u + 4 <= units + 2; u += 4) {
      step<0>(u, r);
      step<1>(u + 1, r);
      step<2>(u + 2, r);
      step<3>(u + 3, r);
    }
    for (; u < units + 2; ++u) {
      switch (u & 3) {
        case 0: step<0>(u, r); break;
        case 1: step<1>(u, r); break;
        case 2: step<2>(u, r); break;
        default: step<3>(u, r); break;
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m) acc[m] = r[m];
  }
};

// Rows [m0, m0 + 16) against the tile: AMX computes each group's 16 x 16 integer sums,
// then the same float steps as vnni_rows, row by row.
inline void amx_rows(const Tile& tile, int64_t bits, int64_t group, const int8_t* xq, const GroupScales& gs,
                     int64_t m0, int64_t in, __m512* acc) {
  const int64_t nb = in / QB;
  const bool offsets = !tile.offsets.empty();
  if (group == QB)
    AmxRows<1>{tile, bits, in, nb, xq + m0 * in, gs, offsets, {}}.run(acc);
  else
    AmxRows<2>{tile, bits, in, 2 * nb, xq + m0 * in, gs, offsets, {}}.run(acc);
}
#endif

// Rows a call takes at a time (a row block): with AMX ~256 KB of their codes, which stay
// in L2 while every tile of the weight passes them; without, ~1 MB over the columns a
// tile holds at once (measured best on a 1 MB L2: a row group's codes stream from it).
inline int64_t rows_per_block(int64_t in) {
#if defined(CTXPAR_AMX)
  if (amx_ready()) return std::max<int64_t>(16, (int64_t(1) << 18) / in / 16 * 16);
#endif
  return std::max<int64_t>(16, ROW_BLOCK_BYTES / std::min(in, SLICE_BLOCKS * QB) / 16 * 16);
}

inline void store_rows(const __m512* acc, int mr, int64_t o0, int64_t cols, const float* bias, float* out,
                       int64_t out_features, int64_t m0) {
  const __mmask16 keep = __mmask16((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + o0) : _mm512_setzero_ps();
  for (int m = 0; m < mr; ++m)
    _mm512_mask_storeu_ps(out + (m0 + m) * out_features + o0, keep, _mm512_add_ps(acc[m], b));
}

using VnniFn = void (*)(const Tile* const*, const RowGroups&, int64_t, int64_t, int64_t, bool, __m512*);

// vnni_rows over C tiles for 1..MR rows (index: rows - 1), G groups a block, BITS-bit integers.
template <int C, int G, int BITS, int... R>
constexpr std::array<VnniFn, sizeof...(R)> vnni_table(std::integer_sequence<int, R...>) {
  return {vnni_rows<C, R + 1, G, BITS>...};
}

// vnni_table for each kind of tile: (4 bits, groups of 32), (4, 16), (8, 32), (8, 16).
template <int C>
std::array<std::array<VnniFn, MR>, 4> vnni_tables() {
  constexpr auto rows = std::make_integer_sequence<int, MR>();
  return {vnni_table<C, 1, 4>(rows), vnni_table<C, 2, 4>(rows), vnni_table<C, 1, 8>(rows), vnni_table<C, 2, 8>(rows)};
}

// Rows [r0, r1) of the quantized activations against every output, tiles shared out
// over the threads (inside an OpenMP parallel region).
// out_features: the output rows' stride (a fused projection's parts write side by side).
template <typename S>
void product(const PartView<S>& w, int64_t zero, int64_t bits, int64_t group, int64_t in, int64_t out_features,
             const int8_t* xq, const float* xd, const float* xs, const int32_t* xz, const RowGroups& row_groups,
             int64_t r0, int64_t r1, const float* bias, float* out) {
  static const auto one_tile = vnni_tables<1>();
  static const auto two_tiles = vnni_tables<2>();
  static thread_local Tile tiles[2];
  Tile& tile = tiles[0];
  const int64_t tiles_n = (w.rows + T - 1) / T;
#if defined(CTXPAR_AMX)
  const bool amx = r1 - r0 >= 16 && amx_ready();
  static thread_local std::vector<GroupScales> group_scales;
  if (amx) {
    amx_configure(group);
    group_scales.resize((r1 - r0) / 16);
    for (int64_t g = 0; g < (r1 - r0) / 16; ++g)
      group_scales[g].fill(xd, xs, r0 + 16 * g, in / QB, w.o != nullptr);
  }
  // zero 8: AMX multiplies signed codes by the nibbles less 8 (a tile of signed bytes, as
  // an 8-bit weight's); without AMX the tile keeps the nibbles and vnni_rows subtracts.
  const bool signed_tile = amx && zero;
#else
  const bool amx = false, signed_tile = false;
#endif
  // A few rows read the weight in place; more lay each tile out once for all of them.
  const bool direct = r1 - r0 < DIRECT_ROWS;
  static thread_local std::vector<int8_t> xk;
  const int64_t xk_row = (in / QB + 3) / 4 * 4 * QB;  // a row's codes in direct_codes' order, whole quads
  if (direct && bits == 4) {
    xk.assign((r1 - r0) * xk_row, 0);
    for (int64_t m = r0; m < r1; ++m) direct_codes(xq + m * in, in, xk.data() + (m - r0) * xk_row);
  }
  if (direct) {
    using Fn = void (*)(const PartView<S>&, int64_t, int64_t, int64_t, int64_t, int64_t, const Tile&, const Window&,
                        const DirectRows&, __m512*);
    static_assert(DIRECT_GROUP == 3, "direct_rows is instantiated for 1 to 3 rows");
    static constexpr Fn fns[2][3] = {{direct_rows<S, 1, 4>, direct_rows<S, 2, 4>, direct_rows<S, 3, 4>},
                                     {direct_rows<S, 1, 8>, direct_rows<S, 2, 8>, direct_rows<S, 3, 8>}};
    const Window win = window_of(w, bits, group);
    const int64_t nb = in / QB, passes = (r1 - r0 + DIRECT_GROUP - 1) / DIRECT_GROUP;
    DirectRows x[(DIRECT_ROWS + DIRECT_GROUP - 2) / DIRECT_GROUP]{};  // pass p: rows r0 + 3p..
    for (int64_t m = r0; m < r1; ++m) {
      DirectRows& g = x[(m - r0) / DIRECT_GROUP];
      const int64_t i = (m - r0) % DIRECT_GROUP;
      g.xq[i] = xq + m * in, g.xk[i] = xk.data() + (m - r0) * xk_row, g.xd[i] = xd + m * nb, g.xs[i] = xs + m * nb;
      g.xz[i] = xz ? xz + m * nb : nullptr;
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles_n; ++t) {
      const int64_t o0 = t * T, cols = std::min(T, w.rows - o0);
      if (!gathers_scales(w)) pack_columns(w, group, in, o0, cols, tile);
      // The first pass brings the tile in from memory (and the next one's lines ahead of
      // it); the later ones find it in L1 or L2.
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t m0 = r0 + p * DIRECT_GROUP, rows = std::min(DIRECT_GROUP, r1 - m0);
        const int64_t next_rows = p == 0 ? std::clamp<int64_t>(w.rows - o0 - T, 0, T) : 0;
        __m512 acc[DIRECT_GROUP];
        fns[bits == 8][rows - 1](w, group, in, o0, cols, next_rows, tile, win, x[p], acc);
        for (int64_t m = 0; m < rows; ++m) store_rows(&acc[m], 1, o0, cols, bias, out, out_features, m0 + m);
      }
    }
    return;
  }
  const int64_t nb = in / QB;
  // Without AMX, two tiles side by side (vnni_rows), each holding SLICE_BLOCKS blocks of
  // its rows at a time (rows_per_block), the row groups' accumulators kept in `out`
  // between slices: each row's float steps still run over its blocks in order, so the
  // bits are those of one pass.
  const int64_t slice = amx ? nb : SLICE_BLOCKS, side = amx ? 1 : 2;
  // 8 bits without AMX: a biased tile, which vnni_rows takes as it takes nibbles (unsigned).
  const bool biased = bits == 8 && !amx;
  // Whether the tile's integers are offset (by vnni_zero's, which the rows' sums hold).
  const bool zeroed = !signed_tile && (biased || zero != 0);
  const Tile* const laid[2] = {&tiles[0], &tiles[1]};
  // A GGUF file's blocks, read by windows where the CPU can (pack_window).
  const Window win = gathers_scales(w) ? window_of(w, bits, group) : Window{};
  for (int64_t kb0 = 0; kb0 < nb; kb0 += slice) {
    const int64_t blocks = std::min(slice, nb - kb0), width = blocks * QB;
    const bool last = kb0 + blocks == nb;
    const PartView<S> ws = w.from_block(kb0, group);
    // No barrier between slices: a static schedule of as many pairs gives each thread
    // the same pairs in every slice, so a thread reads back the sums it stored.
#pragma omp for schedule(static) nowait
    for (int64_t p = 0; p < (tiles_n + side - 1) / side; ++p) {
      const int64_t c_n = std::min(side, tiles_n - p * side);
      int64_t o0[2], cols[2];
      __mmask16 keep[2];
      for (int64_t c = 0; c < c_n; ++c) {
        o0[c] = (p * side + c) * T, cols[c] = std::min(T, w.rows - o0[c]), keep[c] = __mmask16((1u << cols[c]) - 1);
        if (win.on) {
          const int64_t next_o = o0[c] + side * T, next_rows = std::clamp<int64_t>(w.rows - next_o, 0, T);
          pack_window(ws, win, bits, signed_tile ? zero : 0, biased, width, o0[c], cols[c], next_o, next_rows,
                      tiles[c]);
        } else {
          pack_columns(ws, group, width, o0[c], cols[c], tiles[c]);
          pack_q(ws, bits, signed_tile ? zero : 0, biased, width, o0[c], cols[c], tiles[c]);
        }
      }
      const int64_t tile_bits = signed_tile || (bits == 8 && !biased) ? 8 : 4;  // 4: unsigned bytes
      int64_t m0 = r0;
#if defined(CTXPAR_AMX)
      for (; amx && m0 + 16 <= r1; m0 += 16) {
        __m512 acc[16];
        amx_rows(tile, tile_bits, group, xq, group_scales[(m0 - r0) / 16], m0, in, acc);
        store_rows(acc, 16, o0[0], cols[0], bias, out, out_features, m0);
      }
#endif
      const int64_t kind = (tile_bits == 8 ? 2 : 0) + (group == QB ? 0 : 1);
      const VnniFn* rows_fn = c_n == 2 ? two_tiles[kind].data() : one_tile[kind].data();
      for (; m0 < r1; m0 += MR) {  // m0 - r0: 16s, so m0 starts a row group
        const int mr = int(std::min<int64_t>(MR, r1 - m0));
        __m512 acc[2 * MR];  // acc[m * c_n + c]
        for (int m = 0; m < mr; ++m)
          for (int64_t c = 0; c < c_n; ++c)
            acc[m * c_n + c] =
                kb0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(keep[c], out + (m0 + m) * out_features + o0[c]);
        // The next group's lines of `out` (its sums so far, or where it stores), for writing: a
        // wide projection's rows lie a few KB apart, and a store that waits for its line to come
        // from L3 holds up the units.
        for (int64_t m = m0 + MR; m < std::min(r1, m0 + 2 * MR); ++m)
          for (int64_t c = 0; c < c_n; ++c)
            _mm_prefetch(reinterpret_cast<const char*>(out + m * out_features + o0[c]), _MM_HINT_ET0);
        rows_fn[mr - 1](laid, row_groups, m0 / MR, kb0, blocks, zeroed, acc);
        for (int64_t c = 0; c < c_n; ++c) {
          __m512 tile_acc[MR];
          for (int m = 0; m < mr; ++m) tile_acc[m] = acc[m * c_n + c];
          if (last)
            store_rows(tile_acc, mr, o0[c], cols[c], bias, out, out_features, m0);
          else  // the sums so far, as they are
            for (int m = 0; m < mr; ++m)
              _mm512_mask_storeu_ps(out + (m0 + m) * out_features + o0[c], keep[c], tile_acc[m]);
        }
      }
    }
  }
#pragma omp barrier
#if defined(CTXPAR_AMX)
  if (amx) _tile_release();  // the thread's tile state back to init, as the next user expects
#endif
}

}  // namespace tiles
