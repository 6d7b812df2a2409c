// A block-quantized weight's scales and offsets as the kernels read them: float32, or
// IEEE half (Half) where every scale and offset of the weight is a half exactly, as
// the GGUF formats store them (ctxpar/layers/quant_linear.py): a 4-bit block of 32
// weights is then 20 bytes instead of 24, and a decode step reads that much less.

#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

struct Half {
  uint16_t bits;
};

inline float to_float(float x) { return x; }

inline float to_float(Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.bits);
#else
  const uint32_t sign = uint32_t(h.bits & 0x8000) << 16, exp = (h.bits >> 10) & 0x1f, mant = h.bits & 0x3ff;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float32
    float mag = float(mant) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &mag, sizeof bits);
    bits |= sign;
  } else {
    bits = sign | ((exp == 31 ? 255u : exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// Eight values p[order[i] * stride] as a vector, lanes whose order[i] >= count zero, for
// quant_lanes.h's AVX2 path (a row's scales in its lanes' order; a GGUF file's lie a block
// apart): the same floats; F16C converts eight halves at once, and a build without it one by one.
#if defined(__AVX2__)
template <typename S>
inline __m256 gather8_ps(const S* p, int64_t stride, const int* order, int count) {
  const auto at = [&](int i) { return order[i] < count ? p[order[i] * stride] : S{0}; };
#if defined(__F16C__)
  if constexpr (std::is_same_v<S, Half>) {
    __m128i h = _mm_cvtsi32_si128(at(0).bits);
    h = _mm_insert_epi16(h, at(1).bits, 1);
    h = _mm_insert_epi16(h, at(2).bits, 2);
    h = _mm_insert_epi16(h, at(3).bits, 3);
    h = _mm_insert_epi16(h, at(4).bits, 4);
    h = _mm_insert_epi16(h, at(5).bits, 5);
    h = _mm_insert_epi16(h, at(6).bits, 6);
    h = _mm_insert_epi16(h, at(7).bits, 7);
    return _mm256_cvtph_ps(h);
  }
#endif
  return _mm256_setr_ps(to_float(at(0)), to_float(at(1)), to_float(at(2)), to_float(at(3)), to_float(at(4)),
                        to_float(at(5)), to_float(at(6)), to_float(at(7)));
}
#endif
