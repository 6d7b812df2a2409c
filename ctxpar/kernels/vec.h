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

// The widest vector of floats the build has: one AVX-512 register of 16, else 8
// (one AVX register, two SSE ones). The kernels that size their loops by it share it.
namespace widest {
#ifdef __AVX512F__
typedef v16 vec;
typedef v16i veci;
#else
typedef v8 vec;
typedef v8i veci;
#endif
constexpr int64_t W = sizeof(vec) / sizeof(float);
}  // namespace widest

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

// bfloat16 (its bits as uint16_t) as floats and back: widening is exact; narrowing
// rounds to nearest even, a NaN to the quiet NaN, as PyTorch's .to(torch.bfloat16).
struct BF16 {
  uint16_t bits;
};

inline float widen(float x) { return x; }
inline float widen(BF16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t bf16_bits(uint32_t u, bool nan) { return nan ? 0x7FC0u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16; }

inline void narrow_to(float* p, float x) { *p = x; }
inline void narrow_to(BF16* p, float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  p->bits = uint16_t(bf16_bits(u, x != x));
}

// The bf16 halves (H) and the 32-bit lanes (U) of a vector of floats.
template <typename V>
struct Lanes;
template <>
struct Lanes<v8> {
  typedef uint16_t H __attribute__((vector_size(16)));
  typedef uint32_t U __attribute__((vector_size(32)));
};
template <>
struct Lanes<v16> {
  typedef uint16_t H __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(64)));
};

// W lanes of floats (V) from floats or bf16, and to them.
template <typename V>
inline V loadv(const BF16* p) {
  typedef typename Lanes<V>::H H;
  typedef typename Lanes<V>::U U;
  H h;
  std::memcpy(&h, p, sizeof h);
  const U u = __builtin_convertvector(h, U) << 16;
  V v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

template <typename V>
inline void storev(BF16* p, V v) {
  typedef typename Lanes<V>::H H;
  typedef typename Lanes<V>::U U;
  U u;
  std::memcpy(&u, &v, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  u = v != v ? U{} + 0x7FC0u : u;
  const H h = __builtin_convertvector(u, H);
  std::memcpy(p, &h, sizeof h);
}

// v rounded to T's precision, kept as floats: where PyTorch's bf16 ops round between
// two steps, the kernels round there too (identity for float).
template <typename T, typename V>
inline V rounded(V v) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return v;
  } else {
    T tmp[sizeof(V) / sizeof(float)];
    storev(tmp, v);
    return loadv<V>(tmp);
  }
}
template <typename T>
inline float rounded_one(float x) {
  T t;
  narrow_to(&t, x);
  return widen(t);
}

// Softmax weights are computed base 2: the kernels scale their queries by
// log2(e), so a score minus its row's maximum is t <= 0 and its weight 2^t;
// the log-sum-exp is then (max + log2(sum)) ln 2.
constexpr float LOG2E = 1.44269504088896341f, LN2 = 0.693147180559945309f;

// 2^t for t <= 0: t = n + f with n = round(t) and |f| <= 1/2; 2^f is a degree-5
// polynomial (fitted to relative error, 2.4e-7 at worst in float32), and 2^n
// is added to its exponent bits. Below -125 (also -inf) counts as -125: 2^-125
// is far below float32's rounding of any sum that holds a 2^0 = 1, and the
// result stays a normal float.
template <typename V, typename VI>
inline V exp2_nonpositive(V t) {
  const V lowest = V{} - 125.0f;
  t = t < lowest ? lowest : t;
  const V shifted = t + 12582912.0f;  // + 1.5 * 2^23: rounds to an integer held in the low mantissa bits
  const V f = t - (shifted - 12582912.0f);
  V p = V{} + 1.3276471290e-3f;
  p = p * f + 9.6755409613e-3f;
  p = p * f + 5.5507130921e-2f;
  p = p * f + 2.4022120237e-1f;
  p = p * f + 6.9314694405e-1f;
  p = p * f + 1.0000001192f;
  VI n_bits, p_bits;
  std::memcpy(&n_bits, &shifted, sizeof n_bits);
  std::memcpy(&p_bits, &p, sizeof p_bits);
  p_bits += n_bits << 23;  // multiply by 2^n: the offset's bits shift out, n lands in the exponent field
  std::memcpy(&p, &p_bits, sizeof p);
  return p;
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
