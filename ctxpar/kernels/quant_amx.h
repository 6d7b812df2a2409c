// AMX-INT8's group sums of 16 rows at once against quant_tiles.h's tiles (their layout
// is AMX's B-tile layout), where the CPU has it: quant_product.h's third integer engine.

#pragma once

#include "quant_tiles.h"

namespace tiles {

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

}  // namespace tiles
