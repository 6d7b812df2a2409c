// The bf16 projection on CPUs with AMX-BF16: every row count, a decode step's one row
// and a prefill's thousands, goes through the same tile arithmetic, so a row's result
// never depends on the rows beside it (oneDNN's AMX path chooses its blocking by the
// row count, and its bits with it; the AVX-512 BF16 panel loop is ~4x slower at prefill).
//
// Included by gemv.cpp. It reads gemv.cpp's bf16 panels as they are: a panel row (one
// pair of input columns) holds the pair for 32 outputs side by side, 128 bytes, which
// is AMX's B-tile layout (VNNI: a pair of K in one 32-bit lane) for 16 outputs, twice.
// So the tiles are
//
//   A  16 activation rows x 16 pairs (32 bf16), a row 64 bytes         (x in place)
//   B  16 pairs x 16 outputs (x 2), a row the panel's half, 128 apart  (the panel in place)
//   C  16 rows x 16 outputs, float32
//
// and per output o of row m, over the pairs k of the input in order, tile after tile:
//
//   C = 0;  for each K tile t (16 pairs):  C += A_t B_t  (TDPBF16PS);  out = C + bias
//
// Rows go in groups of 16 (two groups at a time where there are, for four C tiles;
// a C element's sequence of instructions is the same either way); a last partial
// group is copied to 16 rows padded with zeros, and an input whose pairs the tiles do
// not divide is copied with its last tile's pairs padded with zeros (the weight's
// last tile likewise, per panel): the arithmetic of a row is one function of the row.

#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#define CTXPAR_AMX_BF16 1

#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace bf16_tiles {

constexpr int64_t T = 16;           // rows of an A tile, pairs of a K tile, outputs of a B tile
constexpr int64_t PANEL = 2 * T;    // outputs per panel (gemv.cpp's with AVX-512)
constexpr int64_t PANEL_ROW = 2 * PANEL;  // bf16 of a panel row: 32 outputs' pairs
// A work item's rows and panels, each in L2 (2 MB a core on Sapphire Rapids); of 64 KB
// to 1 MB of rows and 256 KB to 3 MB of panels, these were fastest at SmolLM2's shapes.
constexpr int64_t ROW_BLOCK_BYTES = 1 << 18, PANEL_BLOCK_BYTES = 1 << 20;

// Linux hands out AMX's tile state only on request, once per process (as quant_tiles.h).
inline bool ready() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Tiles 0-3 the sums (C of row groups 0, 1 x output halves 0, 1), 4-5 the activations,
// 6-7 the weight's halves; all 16 rows x 64 bytes. Loaded on every call, on every
// thread: oneDNN's AMX kernels (PyTorch) run on these threads too and release the
// tiles when they finish.
inline void configure() {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;  // palette 1
  uint16_t* colsb = reinterpret_cast<uint16_t*>(cfg + 16);
  uint8_t* rows = cfg + 48;
  for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = T;
  _tile_loadconfig(cfg);
}

// The C tiles of `groups` (1 or 2) row groups against one panel, over its K tiles in
// order. a: row group 0's first row, rows a_stride bytes apart (group 1 16 rows on);
// b_tail: the panel's last K tile zero-padded, where the input's pairs do not fill it.
template <int groups>
inline void panel_tiles(const uint16_t* a, int64_t a_stride, const uint16_t* panel, int64_t k_tiles,
                        const uint16_t* b_tail) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (groups == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t t = 0; t < k_tiles; ++t) {
    const uint16_t* b = b_tail && t == k_tiles - 1 ? b_tail : panel + t * T * PANEL_ROW;
    _tile_loadd(6, b, PANEL_ROW * 2);
    _tile_loadd(7, b + PANEL, PANEL_ROW * 2);
    _tile_loadd(4, a + t * 2 * T, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (groups == 2) {
      _tile_loadd(5, reinterpret_cast<const char*>(a + t * 2 * T) + T * a_stride, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// Floats to bf16, rounded to nearest even as PyTorch's .to(torch.bfloat16) rounds (NaN
// to its quiet NaN), so that writing bf16 here gives the bits converting after did.
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// A C tile (in `c`, 16 x 16) plus the bias into out (O: float, or uint16_t for bf16):
// `rows` rows, `cols` outputs.
template <typename O>
inline void store(const float* c, int64_t rows, int64_t cols, const float* bias, O* out, int64_t out_stride) {
  const __mmask16 keep = cols >= T ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(c + m * T), b);
    if constexpr (sizeof(O) == 4)
      _mm512_mask_storeu_ps(out + m * out_stride, keep, v);
    else
      _mm256_mask_storeu_epi16(out + m * out_stride, keep, to_bf16(v));
  }
}

// Rows [m0, m0 + rows) (rows <= 32) against one panel: the tiles, then C + bias into out.
template <typename O>
inline void rows_panel(const uint16_t* a, int64_t a_stride, int64_t rows, const uint16_t* panel, int64_t k_tiles,
                       const uint16_t* b_tail, int64_t o0, int64_t out_features, const float* bias, O* out) {
  alignas(64) float c[4][T * T];
  if (rows > T) {
    panel_tiles<2>(a, a_stride, panel, k_tiles, b_tail);
    _tile_stored(2, c[2], T * 4);
    _tile_stored(3, c[3], T * 4);
  } else {
    panel_tiles<1>(a, a_stride, panel, k_tiles, b_tail);
  }
  _tile_stored(0, c[0], T * 4);
  _tile_stored(1, c[1], T * 4);
  for (int h = 0; h < 2; ++h) {  // the panel's two halves of 16 outputs
    const int64_t o = o0 + h * T, cols = std::min(T, out_features - o);
    if (cols <= 0) continue;
    const float* b = bias ? bias + o : nullptr;
    store(c[h], std::min(T, rows), cols, b, out + o, out_features);
    if (rows > T) store(c[2 + h], rows - T, cols, b, out + T * out_features + o, out_features);
  }
}

// x (n, 2 * pairs) bf16, x_stride bf16 between rows, against gemv.cpp's bf16 panels;
// out (n, out_features) float32, or bf16 (O = uint16_t).
template <typename O>
void product(const uint16_t* x, int64_t x_stride, int64_t n, const uint16_t* packed, int64_t pairs,
             int64_t out_features, const float* bias, O* out) {
  const int64_t k_tiles = (pairs + T - 1) / T, tail_pairs = pairs % T;
  const int64_t kp = k_tiles * 2 * T;  // bf16 per row of the zero-padded copy
  // Rows are read in place where their K tiles are whole, in whole groups of 16; the
  // rest (an input the tiles do not divide: every row; else a last partial group)
  // from a copy padded with zeros to whole tiles and groups.
  const int64_t in_place = tail_pairs ? 0 : n / T * T;
  static thread_local std::vector<uint16_t> pad;
  const int64_t pad_rows = (n - in_place + T - 1) / T * T;
  if (int64_t(pad.size()) < pad_rows * kp) pad.resize(size_t(pad_rows * kp));
  std::fill(pad.begin(), pad.begin() + pad_rows * kp, uint16_t(0));
  for (int64_t m = in_place; m < n; ++m)
    std::memcpy(pad.data() + (m - in_place) * kp, x + m * x_stride, size_t(pairs) * 4);
  const uint16_t* copy = pad.data();
  // Work items: a block of rows (~ROW_BLOCK_BYTES of input, in L2) by a block of panels
  // (at most ~PANEL_BLOCK_BYTES of weight, in L2); within one, each group of 32 rows
  // (in L1) meets the block's panels in turn. The panels are cut into near-equal blocks,
  // a multiple of the threads in number, so that every thread gets as many panels (a
  // decode step has one row block). The cuts only share out work: an output's sums are
  // the same wherever they are cut.
  const int64_t panels = (out_features + PANEL - 1) / PANEL, threads = omp_get_max_threads();
  const int64_t rows_per_block = std::max<int64_t>(2 * T, ROW_BLOCK_BYTES / (kp * 2) / (2 * T) * (2 * T));
  const int64_t most = std::max<int64_t>(1, PANEL_BLOCK_BYTES / (kp * PANEL * 2));
  const int64_t cuts = std::min(panels, ((panels + most - 1) / most + threads - 1) / threads * threads);
  const int64_t per_block = (panels + cuts - 1) / cuts;
  const int64_t row_blocks = (n + rows_per_block - 1) / rows_per_block;
  const int64_t panel_blocks = (panels + per_block - 1) / per_block;
#pragma omp parallel
  {
    configure();
    alignas(64) uint16_t b_tail[T * PANEL_ROW];  // a panel's last K tile, zero-padded
#pragma omp for collapse(2) schedule(static) nowait  // one barrier a call: the region's end
    for (int64_t pb = 0; pb < panel_blocks; ++pb) {
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        const int64_t end = std::min(n, (rb + 1) * rows_per_block);
        // Up to two groups of 16 at a time; in place that is 16 or 32 rows (in_place and
        // the blocks' starts are multiples of 16), and a step never straddles the copy.
        for (int64_t m = rb * rows_per_block, rows; m < end; m += rows) {
          rows = std::min(2 * T, end - m);
          if (m < in_place) rows = std::min(rows, in_place - m);
          const bool own = m < in_place;
          const uint16_t* a = own ? x + m * x_stride : copy + (m - in_place) * kp;
          for (int64_t p = pb * per_block; p < std::min(panels, (pb + 1) * per_block); ++p) {
            const uint16_t* panel = packed + p * pairs * PANEL_ROW;
            if (tail_pairs) {
              std::memset(b_tail, 0, sizeof b_tail);
              std::memcpy(b_tail, panel + (k_tiles - 1) * T * PANEL_ROW, size_t(tail_pairs) * PANEL_ROW * 2);
            }
            rows_panel(a, (own ? x_stride : kp) * 2, rows, panel, k_tiles, tail_pairs ? b_tail : nullptr, p * PANEL,
                       out_features, bias, out + m * out_features);
          }
        }
      }
    }
    _tile_release();  // the thread's tile state back to init, as the next user expects
  }
}

}  // namespace bf16_tiles

#endif
