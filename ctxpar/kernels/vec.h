// Vectors of floats for ctxpar's CPU kernels, with GCC's vector extension:
// the source names no instruction set, and -march=native maps each vector to
// the machine's registers (one AVX register per 8 floats, two SSE ones on an
// older CPU; 16 floats are one AVX-512 register where the CPU has them).

#pragma once

#include <cstdint>
#include <cstring>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

template <typename V>
inline V loadv(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline void storev(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

inline v8 load8(const float* p) { return loadv<v8>(p); }

inline v8 load8(const uint16_t* p) {  // bfloat16: the high half of a float
  uint32_t bits[8];
  for (int i = 0; i < 8; ++i) bits[i] = uint32_t(p[i]) << 16;
  v8 v;
  std::memcpy(&v, bits, sizeof v);
  return v;
}

// exp(x) for x <= 0 (scores minus their maximum): Cephes' expf, a degree-5
// polynomial after range reduction, relative error ~1e-7; exactly 0 below -87
// (where float32's exp underflows), so also for x = -inf.
template <typename V, typename VI>
inline V exp_nonpositive(V x) {
  const V lowest = V{} - 87.0f;
  const auto underflow = x < lowest;
  x = underflow ? lowest : x;  // keeps 2^n a normal float
  const VI biased = __builtin_convertvector(x * 1.44269504088896341f + 128.5f, VI);  // floor(.. + 0.5) + 128
  const V n = __builtin_convertvector(biased, V) - 128.0f;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const VI bits = (biased - 1) << 23;  // 2^n: exponent n + 127
  V two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return underflow ? V{} : (p * r * r + r + 1.0f) * two_n;
}

