// Quantizing a layer's new KV-cache entries into the rows of a quantized cache
// (layout: ctxpar/layers/kv_quant.py): per token and run, scale = max|x| / the
// code's largest value, codes = x / scale rounded to int8 or float8 (round to
// nearest, ties to even, as PyTorch's conversions). One pass instead of the
// dozen small PyTorch ops per layer a decode step would otherwise pay for.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

using widest::vec;
using widest::veci;
using widest::W;
typedef int8_t bytes __attribute__((vector_size(W)));  // W int8 codes

// The float8 code (sign, exponent bits, `mant` mantissa bits, bias `bias`) nearest
// to v, |v| at most the largest finite value (the caller clamps): the step between
// neighbours is 2^(e - mant) at exponent e, never finer than the subnormals' step.
uint8_t to_fp8(float v, int mant, int bias) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (a == 0.0f) return sign;
  int e;
  std::frexp(a, &e);                      // a = f * 2^e, f in [0.5, 1)
  e = std::max(e - 1, 1 - bias);          // a's exponent, at least the smallest normal one
  int k = int(std::nearbyint(std::ldexp(a, mant - e)));  // a / step, ties to even
  if (k == 2 << mant) k = 1 << mant, ++e;  // rounded up to the next power of two
  if (k < (1 << mant)) return sign | uint8_t(k);        // subnormal: exponent field 0
  return sign | uint8_t(((e + bias) << mant) | (k - (1 << mant)));
}

// x[0, len) * inv, clamped to +-127 and rounded to nearest (ties to even) into int8
// codes: the scalar steps of kv_quantize, W lanes at a time where whole vectors fit.
// Adding and taking away 1.5 * 2^23 rounds a float of magnitude below 2^22 to an
// integer as nearbyint does (the sum's unit is 1), and the integer converts exactly.
void int8_codes(const float* x, int64_t len, float inv, uint8_t* out) {
  constexpr float ROUND = 12582912.0f;
  int64_t i = 0;
  for (; i + W <= len; i += W) {
    vec v = loadv<vec>(x + i) * inv;
    v = v < -127.0f ? vec{} - 127.0f : v;
    v = v > 127.0f ? vec{} + 127.0f : v;
    const bytes codes = __builtin_convertvector(__builtin_convertvector((v + ROUND) - ROUND, veci), bytes);
    std::memcpy(out + i, &codes, sizeof codes);
  }
  for (; i < len; ++i) out[i] = uint8_t(int8_t(std::nearbyint(std::clamp(x[i] * inv, -127.0f, 127.0f))));
}

// The largest |x[i]| of x[0, len).
float abs_max(const float* x, int64_t len) {
  vec top = {};
  int64_t i = 0;
  for (; i + W <= len; i += W) {
    const vec v = loadv<vec>(x + i), a = v < 0.0f ? -v : v;
    top = top < a ? a : top;
  }
  float amax = hmax(top);
  for (; i < len; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

}  // namespace

extern "C" {

// x (n, width) float32 rows (x_stride floats apart); runs: num_runs widths that
// sum to width; code 0 int8, 1 float8_e4m3fn, 2 float8_e5m2; out (n, row_bytes)
// uint8 rows: the codes at byte 0, the float32 scales at scale_offset.
void kv_quantize(const float* x, int64_t n, int64_t x_stride, const int64_t* runs, int64_t num_runs, int64_t code,
                 int64_t scale_offset, int64_t row_bytes, uint8_t* out) {
  const float qmax = code == 0 ? 127.0f : code == 1 ? 448.0f : 57344.0f;
#pragma omp parallel for if (n > 16)
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x + t * x_stride;
    uint8_t* row = out + t * row_bytes;
    std::memset(row, 0, row_bytes);
    int64_t at = 0;
    for (int64_t r = 0; r < num_runs; ++r) {
      const float scale = abs_max(xt + at, runs[r]) / qmax, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      std::memcpy(row + scale_offset + 4 * r, &scale, sizeof scale);
      if (code == 0) int8_codes(xt + at, runs[r], inv, row + at);
      for (int64_t i = at; code != 0 && i < at + runs[r]; ++i)
        row[i] = to_fp8(std::clamp(xt[i] * inv, -qmax, qmax), code == 1 ? 3 : 2, code == 1 ? 7 : 15);
      at += runs[r];
    }
  }
}
}
