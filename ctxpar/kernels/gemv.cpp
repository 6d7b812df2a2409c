// y = x W^T (+ bias) against a weight packed in panels (fp32): every fp32
// projection on the CPU, a decode step's few rows and prefill's thousands.
//
// A decode step is bound by reading the weights, once per step; this kernel
// reads them at the memory bus's speed (faster than oneDNN's packed copy
// here), and within a few percent of oneDNN at prefill. Unlike oneDNN's
// copy, the layout is a plain tensor: the ranks of one host keep one copy of
// it in shared pages (ctxpar/parallel/shared_weights.py).
//
// Layout: the weight's output rows in panels of NP (two vectors: 32 floats
// with AVX-512, 16 with AVX2), each panel stored input-major, so one input
// index holds the panel's NP outputs side by side; a last partial panel is
// zero-padded:
//
//   W (out, in)              packed (panels, in, NP)
//   row o, column i    ->    [o / NP][i][o % NP]
//
// For each panel and each group of up to MB input rows, the kernel keeps
// MB x 2 vector accumulators: per input index it loads the panel's two
// vectors once and does 2 MB fused multiply-adds with the broadcast inputs.

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "vec.h"

namespace {

#ifdef __AVX512F__
typedef v16 vec;
constexpr int MB = 12;  // 24 accumulators + 2 weight vectors + 1 broadcast of 32 registers
#else
typedef v8 vec;
constexpr int MB = 6;  // 12 + 2 + 1 of 16
#endif
constexpr int64_t W = sizeof(vec) / sizeof(float);
constexpr int64_t NP = 2 * W;
constexpr int64_t ONE_BLOCK_FLOATS = 1 << 18, ROW_BLOCK_FLOATS = 1 << 15;

// out[m, 0..cols) for m < mb: one panel against mb input rows.
template <int mb>
void panel(const float* x, int64_t x_stride, const float* p, int64_t in, const float* bias, float* out,
           int64_t out_stride, int64_t cols) {
  vec acc[mb][2] = {};
  for (int64_t i = 0; i < in; ++i) {
    const vec w0 = loadv<vec>(p + i * NP), w1 = loadv<vec>(p + i * NP + W);
    for (int m = 0; m < mb; ++m) {
      const float xi = x[m * x_stride + i];
      acc[m][0] += w0 * xi;
      acc[m][1] += w1 * xi;
    }
  }
  for (int m = 0; m < mb; ++m) {
    float row[NP];
    storev(row, acc[m][0]);
    storev(row + W, acc[m][1]);
    for (int64_t c = 0; c < cols; ++c) out[m * out_stride + c] = row[c] + (bias ? bias[c] : 0.0f);
  }
}

typedef void (*PanelFn)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);

template <std::size_t... I>
constexpr auto panel_table(std::index_sequence<I...>) {
  return std::array<PanelFn, sizeof...(I)>{panel<int(I) + 1>...};
}

}  // namespace

extern "C" {

// Floats per panel row of the packed layout (the caller packs to it).
int64_t linear_panel_width() { return NP; }

// x (n, in) with x_stride floats between rows; packed: (ceil(out/NP), in, NP)
// as above; bias (out_features,) or null; out (n, out_features) contiguous.
void linear_packed_f32(const float* x, int64_t x_stride, int64_t n, const float* packed, int64_t in,
                       int64_t out_features, const float* bias, float* out) {
  static const auto table = panel_table(std::make_index_sequence<MB>());
  if (n == 0 || out_features == 0) return;
  // Inputs that fit in L2 go in one block, so the weights stream past them once (a
  // decode step's rows); larger ones in blocks of ~128 KB of rows, which stay in L2
  // while the weight panels pass (from L3: a layer's weights fit there).
  const int64_t row_block =
      n * in <= ONE_BLOCK_FLOATS ? n : std::max<int64_t>(MB, ROW_BLOCK_FLOATS / in / MB * MB);
  const int64_t panels = (out_features + NP - 1) / NP, row_blocks = (n + row_block - 1) / row_block;
  // Consecutive (row block, panel) pairs go to one thread: its row block stays in
  // L2 while the panels stream past it.
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t o = p * NP, cols = out_features - o < NP ? out_features - o : NP;
      const int64_t end = std::min(n, (rb + 1) * row_block);
      for (int64_t m = rb * row_block; m < end; m += MB) {
        const int64_t mb = end - m < MB ? end - m : MB;
        table[mb - 1](x + m * x_stride, x_stride, packed + p * in * NP, in, bias ? bias + o : nullptr,
                      out + m * out_features + o, out_features, cols);
      }
    }
  }
}

}  // extern "C"
