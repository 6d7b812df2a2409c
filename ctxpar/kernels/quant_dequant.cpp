// The rows of a block-quantized weight (quant_gemv.cpp's layout: bits 4 or 8, a scale
// per group of 16 or 32, an optional offset per 32, float32 or half) as float32: the
// embedding's rows, the weights where no kernel multiplies them, and the tests' view.
// Each weight is scale * q, then + offset: two roundings, as ctxpar's and gguf's
// dequantizers compute it (the tests compare the two bit for bit); zero 8 (Q4_0 as the
// file holds it): scale * (q - 8), exact as gguf's d * q + (-8 d) is.

#include <cstdint>

#include "half.h"
#include "quant_part.h"

namespace {


// Weights [b * 32, b * 32 + 32) of row o as float32 into y: scale * q, then + offset.
template <typename S>
inline void dequantize_block(const PartView<S>& w, int64_t bits, int64_t group, int64_t zero, int64_t o, int64_t b,
                             float* y) {
  const uint8_t* q = w.block(o, b);
  const int64_t j = b * QB / group;  // the block's first group
  const float s0 = w.scale(o, j), s1 = group == QB ? s0 : w.scale(o, j + 1);
  const float off = w.o ? w.offset(o, b) : 0.0f;
  float v[QB];
  for (int i = 0; i < 16; ++i) {
    v[i] = bits == 4 ? float((q[i] & 15) - zero) : float(int8_t(q[i]));
    v[i + 16] = bits == 4 ? float((q[i] >> 4) - zero) : float(int8_t(q[i + 16]));
  }
  for (int i = 0; i < 16; ++i) y[i] = s0 * v[i];
  for (int i = 16; i < QB; ++i) y[i] = s1 * v[i];
  if (w.o)
    for (int i = 0; i < QB; ++i) y[i] += off;
}

template <typename S>
void dequantize_rows(const QuantPart& part, int64_t bits, int64_t group, int64_t zero, const int64_t* ids,
                     int64_t first, int64_t rows, int64_t in, float* out) {
  const PartView<S> w(part);
#pragma omp parallel for schedule(static) if (rows > 1)  // one row (a decode step's embedding): no team
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < in / QB; ++b)
      dequantize_block(w, bits, group, zero, ids ? ids[r] : first + r, b, out + r * in + b * QB);
}

}  // namespace

extern "C" {

// Rows [first, first + rows) of the weight, or where ids is not null rows ids[0..rows) (an
// embedding's lookup), each in the weight (one part, quant_part.h; scales and offsets half if
// `half`, else float32), as float32 (rows, in): scale * (q - zero), then + offset (two
// roundings, as ctxpar's and gguf's dequantizers). Prefill multiplies tiles of these.
void quant_dequantize_f32(const QuantPart* part, int64_t half, int64_t bits, int64_t group, int64_t zero,
                          const int64_t* ids, int64_t first, int64_t rows, int64_t in, float* out) {
  if (half)
    dequantize_rows<Half>(*part, bits, group, zero, ids, first, rows, in, out);
  else
    dequantize_rows<float>(*part, bits, group, zero, ids, first, rows, in, out);
}

}  // extern "C"
