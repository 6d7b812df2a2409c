// The rows of a block-quantized weight (quant_gemv.cpp's layout: bits 4 or 8, a scale
// per group of 16 or 32, an optional offset per 32, float32 or half) as float32: the
// embedding's rows, the weights where no kernel multiplies them, and the tests' view.
// Each weight is scale * q, then + offset: two roundings, as ctxpar's and gguf's
// dequantizers compute it (the tests compare the two bit for bit); zero 8 (Q4_0 as the
// file holds it): scale * (q - 8), exact as gguf's d * q + (-8 d) is.

#include <cstdint>

#include "half.h"

namespace {

constexpr int64_t QB = 32;  // weights per block

// Weights [b * 32, b * 32 + 32) of row o as float32 into y: scale * q, then + offset.
template <typename S>
inline void dequantize_block(const uint8_t* qs, const S* scales, const S* offsets, int64_t bits, int64_t group,
                             int64_t zero, int64_t o, int64_t b, int64_t in, float* y) {
  const int64_t nb = in / QB;
  const uint8_t* q = qs + o * (in * bits / 8) + b * (QB * bits / 8);
  const S* sc = scales + o * (in / group) + b * QB / group;
  const float s0 = to_float(sc[0]), s1 = to_float(group == QB ? sc[0] : sc[1]);
  const float off = offsets ? to_float(offsets[o * nb + b]) : 0.0f;
  float v[QB];
  for (int i = 0; i < 16; ++i) {
    v[i] = bits == 4 ? float((q[i] & 15) - zero) : float(int8_t(q[i]));
    v[i + 16] = bits == 4 ? float((q[i] >> 4) - zero) : float(int8_t(q[i + 16]));
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

// Rows [first, first + rows) of the weight as float32 (rows, in): scale * (q - zero), then + offset
// (two roundings, as ctxpar's and gguf's dequantizers). Prefill multiplies tiles of these.
void quant_dequantize_f32(const uint8_t* qs, const void* scales, const void* offsets, int64_t half, int64_t bits,
                          int64_t group, int64_t zero, int64_t first, int64_t rows, int64_t in, float* out) {
  with_scales(scales, offsets, half, [&](auto* sc, auto* off) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < in / QB; ++b)
        dequantize_block(qs, sc, off, bits, group, zero, first + r, b, in, out + r * in + b * QB);
  });
}

}  // extern "C"
