// The block-quantized projection on CPUs with AVX-512 VNNI (and AMX-INT8 where the
// CPU has it): every row count, a decode step's one row and a prefill's thousands,
// takes this one path, so a row's result never depends on the rows beside it.
//
// Included by quant_gemv.cpp (its weight layout, read through quant_part.h's strides;
// its int8 activations: xq codes, xd scales, xs = xd * sum of codes, per block of 32).
//
// The weight is laid out in tiles (quant_tiles.h), whose float steps are one code shape.
// Three integer engines feed them, and give the same bits because the integers are exact:
//   - AMX computes 16 rows' group sums at once (rows in groups of 16, where the CPU has
//     it; quant_amx.h);
//   - the VNNI loop (quant_tiles.h) the rows left over (every row without AMX), a few at a time against
//     two laid-out tiles side by side, or one;
//   - a call of fewer than DIRECT_ROWS rows (a decode step) reads the weight where it
//     lies (direct_rows, DIRECT_GROUP rows a pass over a tile): laying out a tile costs
//     more than a few rows' use of it; a GGUF file's tiles are laid out from windows of
//     its blocks (pack_window; both in quant_direct.h).

#pragma once

#include "quant_amx.h"
#include "quant_direct.h"
#include "quant_tiles.h"

namespace tiles {

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
