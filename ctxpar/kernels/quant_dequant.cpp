// The rows of a block-quantized weight (quant_gemv.cpp's layout: bits 4 or 8, a scale
// per group of 16 or 32, an optional offset per 32, float32 or half) as float32: prefill
// multiplies tiles of them with the fp32 GEMM (gemv.cpp), and tests read them back.
// Each weight is scale * q, then + offset: two roundings, as ctxpar's and gguf's
// dequantizers compute it (built with -std=c++17: no fused multiply-add contraction).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "half.h"

namespace {

constexpr int64_t QB = 32;  // weights per block

// Weights [b * 32, b * 32 + 32) of row o as float32 into y: scale * q, then + offset.
template <typename S>
inline void dequantize_block(const uint8_t* qs, const S* scales, const S* offsets, int64_t bits, int64_t group,
                             int64_t o, int64_t b, int64_t in, float* y) {
  const int64_t nb = in / QB;
  const uint8_t* q = qs + o * (in * bits / 8) + b * (QB * bits / 8);
  const S* sc = scales + o * (in / group) + b * QB / group;
  const float s0 = to_float(sc[0]), s1 = to_float(group == QB ? sc[0] : sc[1]);
  const float off = offsets ? to_float(offsets[o * nb + b]) : 0.0f;
  float v[QB];
  for (int i = 0; i < 16; ++i) {
    v[i] = bits == 4 ? float(q[i] & 15) : float(int8_t(q[i]));
    v[i + 16] = bits == 4 ? float(q[i] >> 4) : float(int8_t(q[i + 16]));
  }
  for (int i = 0; i < 16; ++i) y[i] = s0 * v[i];
  for (int i = 16; i < QB; ++i) y[i] = s1 * v[i];
  if (offsets)
    for (int i = 0; i < QB; ++i) y[i] += off;
}

// f(scales, offsets) with the pointers as their type: half if `half`, else float32.
template <typename F>
inline void with_scales(const void* scales, const void* offsets, int64_t half, F&& f) {
  if (half)
    f(static_cast<const Half*>(scales), static_cast<const Half*>(offsets));
  else
    f(static_cast<const float*>(scales), static_cast<const float*>(offsets));
}

}  // namespace

extern "C" {

// Rows [first, first + rows) of the weight as float32 (rows, in): scale * q, then + offset
// (two roundings, as ctxpar's and gguf's dequantizers). Prefill multiplies tiles of these.
void quant_dequantize_f32(const uint8_t* qs, const void* scales, const void* offsets, int64_t half, int64_t bits,
                          int64_t group, int64_t first, int64_t rows, int64_t in, float* out) {
  with_scales(scales, offsets, half, [&](auto* sc, auto* off) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < in / QB; ++b)
        dequantize_block(qs, sc, off, bits, group, first + r, b, in, out + r * in + b * QB);
  });
}

// The same rows written straight into gemv.cpp's panel layout, (ceil(rows / np), in, np):
// row r, weight i at [r / np][i][r % np], the last panel's missing rows zero. Prefill's
// tiles go to the fp32 panel kernel without a transposing copy.
void quant_dequantize_panels_f32(const uint8_t* qs, const void* scales, const void* offsets, int64_t half,
                                 int64_t bits, int64_t group, int64_t first, int64_t rows, int64_t in, int64_t np,
                                 float* out) {
  const int64_t panels = (rows + np - 1) / np;
  with_scales(scales, offsets, half, [&](auto* sc, auto* off) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      float* panel = out + p * in * np;
      const int64_t lanes = std::min(np, rows - p * np);
      std::vector<float> block(np * QB, 0.0f);  // one block of the panel's rows, row-major; missing rows stay 0
      for (int64_t b = 0; b < in / QB; ++b) {
        for (int64_t lane = 0; lane < lanes; ++lane)
          dequantize_block(qs, sc, off, bits, group, first + p * np + lane, b, in, block.data() + lane * QB);
        for (int i = 0; i < QB; ++i)  // transposed: each weight's np rows side by side, whole cache lines
          for (int64_t lane = 0; lane < np; ++lane) panel[(b * QB + i) * np + lane] = block[lane * QB + i];
      }
    }
  });
}


}  // extern "C"
