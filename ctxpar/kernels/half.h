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

// Eight scales as a vector, for quant_lanes.h's AVX2 path (which every AVX2 build takes:
// F16C converts eight halves at once, and a build without it converts them one by one).
#if defined(__AVX2__)
inline __m256 load8_ps(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_ps(const Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return _mm256_setr_ps(to_float(p[0]), to_float(p[1]), to_float(p[2]), to_float(p[3]), to_float(p[4]),
                        to_float(p[5]), to_float(p[6]), to_float(p[7]));
#endif
}
// Eight values p[order[i] * stride] (a GGUF file's scales lie a block apart; quant_lanes.h
// reads them in its lanes' order): the same floats, halves converted at once.
constexpr int IN_ORDER[8] = {0, 1, 2, 3, 4, 5, 6, 7};
template <typename S>
inline __m256 load8_ps(const S* p, int64_t stride, const int* order = IN_ORDER) {
  if (stride == 1 && order == IN_ORDER) return load8_ps(p);
  const auto at = [&](int i) { return p[order[i] * stride]; };
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
