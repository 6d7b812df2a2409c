// Vectors of floats for ctxpar's CPU kernels, with GCC's vector extension:
// the source names no instruction set, and -march=native maps each vector to
// the machine's registers (one AVX register per 8 floats, two SSE ones on an
// older CPU; 16 floats are one AVX-512 register where the CPU has them).

#pragma once

#include <cstdint>
#include <cstring>

typedef float v4 __attribute__((vector_size(16)));
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
// polynomial after range reduction, relative error ~1e-7. Inputs below -87
// count as -87 (so does -inf): their exp, 2^-126 or less, is far below float32's
// rounding of the sum it joins, which always holds an exp(0) = 1.
template <typename V, typename VI>
inline V exp_nonpositive(V x) {
  const V lowest = V{} - 87.0f;
  x = x < lowest ? lowest : x;  // keeps 2^n a normal float
  // n = round(x / ln 2): adding 1.5 * 2^23 rounds to an integer held in the
  // low mantissa bits, so shifting those bits into the exponent field gives 2^n.
  const V shifted = x * 1.44269504088896341f + 12582912.0f;
  const V n = shifted - 12582912.0f;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  VI bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  bits = (bits << 23) + (127 << 23);  // the exponent field of 2^n (the offset's bits shift out)
  V two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return (p * r * r + r + 1.0f) * two_n;
}

// Horizontal max and sum of a vector's lanes, halving it each step.
inline float hmax(v4 x) {
  x = x < __builtin_shufflevector(x, x, 2, 3, 0, 1) ? __builtin_shufflevector(x, x, 2, 3, 0, 1) : x;
  return x[0] < x[1] ? x[1] : x[0];
}
inline float hmax(v8 x) {
  const v4 lo = __builtin_shufflevector(x, x, 0, 1, 2, 3), hi = __builtin_shufflevector(x, x, 4, 5, 6, 7);
  return hmax(lo < hi ? hi : lo);
}
inline float hmax(v16 x) {
  const v8 lo = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8 hi = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  return hmax(lo < hi ? hi : lo);
}
inline float hsum(v4 x) {
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1);
  return x[0] + x[1];
}
inline float hsum(v8 x) { return hsum(__builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7)); }
inline float hsum(v16 x) {
  return hsum(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
}
