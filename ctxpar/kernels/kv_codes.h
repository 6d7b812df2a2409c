// A quantized KV cache's 1-byte codes (ctxpar/layers/kv_quant.py), read as floats
// by the attention kernels: load8 of eight codes -> eight floats, which the caller
// multiplies by the entry's scale. x86 has no fp8 conversion before AVX10.2: see
// load8 below (and a 256-entry table where neither AVX2 nor F16C is there).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

struct E4M3 {  // float8_e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities
  uint8_t bits;
};
struct E5M2 {  // float8_e5m2: 5 exponent bits (bias 15), 2 mantissa bits
  uint8_t bits;
};

// Value of an fp8 byte with `mant` mantissa bits and exponent bias `bias` (finite codes;
// the quantizer never writes NaN or infinity codes).
inline float fp8_value(int b, int mant, int bias) {
  const int m = b & ((1 << mant) - 1), e = (b >> mant) & ((1 << (7 - mant)) - 1);
  const float mag = e == 0 ? std::ldexp(float(m), 1 - bias - mant)  // subnormal: 0.m * 2^(1 - bias)
                           : std::ldexp(float(m + (1 << mant)), e - bias - mant);  // 1.m * 2^(e - bias)
  return b & 0x80 ? -mag : mag;
}

struct Fp8Table {
  float value[256];
  Fp8Table(int mant, int bias) {
    for (int b = 0; b < 256; ++b) value[b] = fp8_value(b, mant, bias);
  }
};
inline const Fp8Table E4M3_TABLE(3, 7), E5M2_TABLE(2, 15);

// Eight codes -> eight floats. GCC's vector extension converts bytes lane by lane in
// scalar code, and a table gather is slow on some CPUs (AMD's); with AVX2 and F16C,
// int8 is one sign extension, and fp8 becomes fp16 by moving its bits (exactly):
// e5m2 is the high byte of an fp16; e4m3's exponent and mantissa shifted into
// fp16's read as its value times 2^(7 - 15) (a normal's exponent and a subnormal's
// step alike), so the result is multiplied by 2^8.
#if defined(__AVX2__) && defined(__F16C__)
inline __m128i load8_u16(const uint8_t* p) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline v8 load8(const int8_t* p) {
  return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline v8 load8(const E5M2* p) { return (v8)_mm256_cvtph_ps(_mm_slli_epi16(load8_u16(&p->bits), 8)); }
inline v8 load8(const E4M3* p) {
  const __m128i b = load8_u16(&p->bits);
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  return (v8)_mm256_cvtph_ps(h) * 256.0f;
}
#else
inline v8 load8(const int8_t* p) {
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = float(p[i]);
  return v;
}
inline v8 load8(const E4M3* p) {
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = E4M3_TABLE.value[p[i].bits];
  return v;
}
inline v8 load8(const E5M2* p) {
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = E5M2_TABLE.value[p[i].bits];
  return v;
}
#endif

// Where a quantized cache keeps its float32 scales: at byte `offset` of each token's
// row, one per run of the entry (ctxpar/layers/kv_quant.py). Key values [0, split)
// of KV head h take scale index h * head, values [split, dim) index h * head + 1
// (MLA's rope key); head h's value takes index value + h * head.
struct Scales {
  int64_t offset, head, value, split;
};

// Scale number i of the row that starts at `row` (rows are bytes: a float may be unaligned).
inline float scale_at(const void* row, const Scales& sc, int64_t i) {
  float s;
  std::memcpy(&s, static_cast<const char*>(row) + sc.offset + 4 * i, sizeof s);
  return s;
}
