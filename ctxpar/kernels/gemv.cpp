// y = x W^T (+ bias) against a weight packed in panels (fp32): every fp32
// projection on the CPU, a decode step's few rows and prefill's thousands.
//
// A decode step is bound by reading the weights, once per step; this kernel
// reads them at the memory bus's speed (faster than oneDNN's packed copy
// here), and within a few percent of oneDNN at prefill. Unlike oneDNN's
// copy, the layout is a plain tensor: the ranks of one host keep one copy of
// it in shared pages (ctxpar/executor/shared_weights.py).
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
//
// bfloat16 weights (a bf16 model's projections: half the bytes a decode step
// reads) use the same panels with the input indices in pairs, a pair in one
// 32-bit lane (an odd last column paired with a zero):
//
//   W (out, in)              packed (panels, ceil(in / 2), NP, 2)
//   row o, column i    ->    [o / NP][i / 2][o % NP][i % 2]
//
// and take bf16 inputs in pairs too (a bf16 model's activations as they are).
// AVX-512 BF16's dot product multiplies a lane's weight pair by the input pair
// and adds both products to the float32 accumulator in one instruction;
// elsewhere the pair's halves are widened to floats (a bf16 is the high half of
// a float) and multiplied as fp32. On CPUs with AMX-BF16, every bf16 call goes
// through the tiles of bf16_tiles.h instead, against the same panels.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "bf16_tiles.h"
#include "vec.h"

namespace {

using widest::vec;
using widest::W;
constexpr int MB = W == 16 ? 12 : 6;  // AVX-512: 24 accumulators + 2 weight vectors + 1 broadcast of 32
                                      // registers; else 12 + 2 + 1 of 16
typedef uint32_t pairs __attribute__((vector_size(sizeof(vec))));  // W bf16 weight pairs
constexpr int64_t NP = 2 * W;
constexpr int64_t ONE_BLOCK_FLOATS = 1 << 18, ROW_BLOCK_FLOATS = 1 << 15;

// A bf16 pair's two values as floats: the low half (the even column) and the high half.
inline vec low_halves(pairs p) { return reinterpret_cast<vec>(p << 16); }
inline vec high_halves(pairs p) { return reinterpret_cast<vec>(p & 0xFFFF0000u); }
inline float as_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float low_half(uint32_t p) { return as_float(p << 16); }
inline float high_half(uint32_t p) { return as_float(p & 0xFFFF0000u); }

// An output as float32, or as bf16 rounded to nearest even (NaN to the quiet NaN), as
// PyTorch's .to(torch.bfloat16) rounds.
inline void put(float* o, float v) { *o = v; }
inline void put(uint16_t* o, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  *o = v != v ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// out[m, 0..cols) for m < mb: one panel against mb input rows. E: float (fp32 weights
// and inputs, `in` of them) or uint32_t (bf16 pairs, `in` pairs); O: float or bf16 out.
template <typename E, typename O, int mb>
void panel(const E* x, int64_t x_stride, const E* p, int64_t in, const float* bias, O* out, int64_t out_stride,
           int64_t cols) {
  vec acc[mb][2] = {};
  for (int64_t i = 0; i < in; ++i) {
    if constexpr (std::is_same_v<E, float>) {
      const vec w0 = loadv<vec>(p + i * NP), w1 = loadv<vec>(p + i * NP + W);
      for (int m = 0; m < mb; ++m) {
        const float xi = x[m * x_stride + i];
        acc[m][0] += w0 * xi;
        acc[m][1] += w1 * xi;
      }
    } else {
      pairs w0, w1;
      std::memcpy(&w0, p + i * NP, sizeof w0);
      std::memcpy(&w1, p + i * NP + W, sizeof w1);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
      for (int m = 0; m < mb; ++m) {
        const __m512bh xi = (__m512bh)_mm512_set1_epi32(int(x[m * x_stride + i]));
        acc[m][0] = (vec)_mm512_dpbf16_ps((__m512)acc[m][0], (__m512bh)w0, xi);
        acc[m][1] = (vec)_mm512_dpbf16_ps((__m512)acc[m][1], (__m512bh)w1, xi);
      }
#else
      const vec w0e = low_halves(w0), w0o = high_halves(w0), w1e = low_halves(w1), w1o = high_halves(w1);
      for (int m = 0; m < mb; ++m) {
        const uint32_t xi = x[m * x_stride + i];
        const float xe = low_half(xi), xo = high_half(xi);
        acc[m][0] += w0e * xe + w0o * xo;
        acc[m][1] += w1e * xe + w1o * xo;
      }
#endif
    }
  }
  for (int m = 0; m < mb; ++m) {
    float row[NP];
    storev(row, acc[m][0]);
    storev(row + W, acc[m][1]);
    for (int64_t c = 0; c < cols; ++c) put(out + m * out_stride + c, row[c] + (bias ? bias[c] : 0.0f));
  }
}

template <typename E, typename O>
using PanelFn = void (*)(const E*, int64_t, const E*, int64_t, const float*, O*, int64_t, int64_t);

template <typename E, typename O, std::size_t... I>
constexpr auto panel_table(std::index_sequence<I...>) {
  return std::array<PanelFn<E, O>, sizeof...(I)>{panel<E, O, int(I) + 1>...};
}

// x (n, in) with x_stride elements between rows, against the packed panels; see linear_packed_f32.
template <typename E, typename O>
void packed_product(const E* x, int64_t x_stride, int64_t n, const E* packed, int64_t in, int64_t out_features,
                    const float* bias, O* out) {
  static const auto table = panel_table<E, O>(std::make_index_sequence<MB>());
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

// The bf16 product: one path for every row count in the process, AMX's tiles where the
// kernel may use them (the CPU has AMX-BF16 and Linux grants the tile state), else the panels.
template <typename O>
void bf16_product(const uint16_t* x, int64_t x_stride, int64_t n, const uint16_t* packed, int64_t pairs,
                  int64_t out_features, const float* bias, O* out) {
#if defined(CTXPAR_AMX_BF16)
  static_assert(NP == bf16_tiles::PANEL, "the tiles read the AVX-512 panels");
  if (bf16_tiles::ready()) {
    if (n > 0 && out_features > 0) bf16_tiles::product(x, x_stride, n, packed, pairs, out_features, bias, out);
    return;
  }
#endif
  packed_product(reinterpret_cast<const uint32_t*>(x), x_stride / 2, n, reinterpret_cast<const uint32_t*>(packed),
                 pairs, out_features, bias, out);
}

}  // namespace

extern "C" {

// Floats per panel row of the packed layout (the caller packs to it).
int64_t linear_panel_width() { return NP; }

// 1 where bf16 projections go through AMX's tiles (bf16_tiles.h), 0 where through the panel loop.
int64_t linear_bf16_tiles() {
#if defined(CTXPAR_AMX_BF16)
  return bf16_tiles::ready();
#else
  return 0;
#endif
}

// x (n, in) with x_stride floats between rows; packed: (ceil(out/NP), in, NP)
// as above; bias (out_features,) or null; out (n, out_features) contiguous.
void linear_packed_f32(const float* x, int64_t x_stride, int64_t n, const float* packed, int64_t in,
                       int64_t out_features, const float* bias, float* out) {
  packed_product(x, x_stride, n, packed, in, out_features, bias, out);
}

// The same for bf16: x (n, 2 * pairs) bf16 with x_stride bf16 between rows (even, the
// rows 4-byte aligned), packed (ceil(out/NP), pairs, NP, 2) bf16; bias and out float32.
void linear_packed_bf16(const uint16_t* x, int64_t x_stride, int64_t n, const uint16_t* packed, int64_t pairs,
                        int64_t out_features, const float* bias, float* out) {
  bf16_product(x, x_stride, n, packed, pairs, out_features, bias, out);
}

// The same with bf16 out (n, out_features), each output rounded to nearest even.
void linear_packed_bf16_out(const uint16_t* x, int64_t x_stride, int64_t n, const uint16_t* packed, int64_t pairs,
                            int64_t out_features, const float* bias, uint16_t* out) {
  bf16_product(x, x_stride, n, packed, pairs, out_features, bias, out);
}

}  // extern "C"
