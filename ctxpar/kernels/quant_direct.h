// A decode step's few rows against a block-quantized weight where it lies (direct_rows),
// and a GGUF file's tiles laid out from windows of its blocks (pack_window): the decode
// side of quant_product.h's projection, giving the VNNI loop's bits (quant_tiles.h).

#pragma once

#include "quant_tiles.h"

namespace tiles {

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

}  // namespace tiles
