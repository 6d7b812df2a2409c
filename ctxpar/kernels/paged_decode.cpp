// One-query attention of many rows over a paged cache, read in place.
//
// Built on first use by ctxpar/kernels/__init__.py (g++ -O3 -march=native
// -fopenmp, no PyTorch headers) and called through ctypes with raw pointers.
// It replaces, for decode rows, the PyTorch path of gathering each row's
// context out of the cache and then calling a kernel: here each key and value
// is read once, straight from its cache slot.
//
// A sliding window (a row sees its last `window` slots: its keys in position order,
// its own last) leaves the earlier slots out before the cut below, so no task reads
// a key outside it; a soft cap passes each scaled logit x through cap · tanh(x / cap).
//
// Work is cut into tasks of (row, run of at most CHUNK keys), every KV head of
// the run in one task, so one long row still keeps every thread busy; each task
// leaves a partial (out, lse) per query head and a second pass merges a row's runs
// exactly by log-sum-exp. The cut depends on a row's length only, so a row's bits
// never depend on the threads or on the other rows.
//
// A task first loads one byte of every cache line of its run's rows, all at once:
// the misses overlap one another, where software prefetches ahead of the products
// (spread or in bursts) measured slower on AMD's cores; the passes then read the run
// (256 rows of a 1B model's int8 cache: 278 KB) from the core's L2. Those passes are
// bound by converting and multiplying, so their loops are register-blocked over the
// G query heads that share a KV head (GQA's group, up to 4 at a time): a key's vector
// of L values (L = 16 with AVX-512, else 8) is converted to floats once and multiplied
// into G x KB accumulators, G x KB = L, which one transposing add tree reduces to the
// G x KB scores; a value vector is converted once into G x W output accumulators. A
// quantized cache's codes (kv_codes.h) are read as they are: a key's scale multiplies
// its dot products, a value's scale is folded into its softmax weight. Where the group
// is large (MLA: every query head shares the one latent key), a run of keys is
// dequantized once into floats instead.
//
// An int8 key's scores are integer dot products, on the units built for them: each
// query head's q (log2 units) is rounded once per row to int16 codes and a scale,
// max |q| / 32767 (quantize_query), and a key's codes, widened to int16 once for the G
// heads, multiply them in pairs into int32 lanes (vpdpwssd: one instruction for 32
// values, where floats take a conversion of every code and a multiply-add per 16). The
// sums are exact integers, so the scores do not depend on the vectors' width or the
// order of the adds; with the softmax's sum kept in 16 lanes in every build, an
// AVX-512, an AVX-VNNI and an AVX2 CPU give a row the same bits. The cost is q's
// rounding: a score moves by at most max |q| / 65534 times the key's L1 norm
// (tests/helpers/int8_scores.py derives its tolerance from that). The weighted values
// stay float multiply-adds: the same sums in vpdpwssd (a run's weights rounded to int16,
// two keys' value codes interleaved in pairs) measured slower on Zen 5, and would round
// to 0 a weight under 2^-16 of its run's largest.

// The cache is addressed by strides, so one kernel serves
//   GQA  (num_slots, 2, Hk, D):  slot_stride 2*Hk*D, head_stride D, v_offset Hk*D
//   MLA  (num_slots, E) latents: slot_stride E, head_stride 0, v_offset 0
//        (Hk = 1; the value is the first Dv entries of the key)
// and a quantized cache's rows of 1-byte codes and float32 scales (kv_codes.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kv_codes.h"
#include "online_softmax.h"
#include "vec.h"

namespace {

using V = widest::vec;                 // the widest vector of floats: 16 lanes (AVX-512) or 8
constexpr int L = int(widest::W);      // its lanes
constexpr int64_t CHUNK = 256;         // keys per task, at most (a multiple of L)
// A row shorter than MIN_TASKS runs of CHUNK keys is cut into MIN_TASKS runs of at least
// MIN_RUN keys: a decode step's short rows would otherwise be one task each, read
// from memory by one core while the others wait. The cut depends on the row's length
// only (never on the threads), so a row has the same bits on every rank.
constexpr int64_t MIN_TASKS = 4, MIN_RUN = 32;

inline int64_t run_keys(int64_t keys) {
  const int64_t even = (keys + MIN_TASKS - 1) / MIN_TASKS;
  return std::clamp((even + 7) / 8 * 8, MIN_RUN, CHUNK);
}
// Query heads blocked per pass over the keys: a GQA group of up to 4 (Llama's) converts
// each key once; with 16 vector registers (AVX2) blocks of 3 (SmolLM2's group) still keep
// the accumulators in them. A group over G_MAX takes the fewest passes, in blocks as even
// as they go (Llama's 4 on AVX2: 2 + 2, which measured faster than 3 + 1).
#if defined(__AVX512F__)
constexpr int G_MAX = 4;
#else
constexpr int G_MAX = 3;
#endif

// L codes (or floats, or bf16) from p as floats; int8 on AVX-512 in one widening.
template <typename T>
inline V loadw(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return loadv<V>(p);
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    return loadv<V>(reinterpret_cast<const BF16*>(p));
  } else {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, int8_t>)
      return (V)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    else
      return __builtin_shufflevector(load8(p), load8(p + 8), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return load8(p);
#endif
  }
}
// Loads of the vector type VV: L lanes or eight.
template <typename VV, typename T>
inline VV load_as(const T* p) {
  if constexpr (sizeof(VV) == sizeof(V))
    return loadw(p);
  else
    return load8(p);
}

// L vectors -> one vector of their horizontal sums, lane k = a[k]'s (a transposing add tree);
// VV: 8 or 16 lanes of floats, or of int32 (the integer scores' exact sums).
template <typename VV>
inline VV reduce_lanes(const VV* a) {
  if constexpr (sizeof(VV) == 32) {
    VV t[4], u[2];
    for (int i = 0; i < 4; ++i)
      t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
             __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; ++i)
      u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
             __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
  } else {
    VV t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i)
      t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14,
                                     30) +
             __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15,
                                     31);
    for (int i = 0; i < 4; ++i)
      u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                                     29) +
             __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                     31);
    for (int i = 0; i < 2; ++i)
      w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26,
                                     27) +
             __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                     31);
    return __builtin_shufflevector(w[0], w[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(w[0], w[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
}

// Keys a dot-product block of vectors VV takes for G query heads: the G x KB partial sums
// fill the lanes of one reduction (G = 3 leaves a quarter of them 0).
template <int G, typename VV>
constexpr int KEYS_PER = int(sizeof(VV) / sizeof(float)) / (G == 3 ? 4 : G);

// Dot products of G query heads (rows of q, `stride` apart, scaled) with KEYS_PER<G, VV> keys
// (key i at rows[i] + offset) over their values [c0, c1) in vectors VV (L lanes, or 8
// where a width is an odd multiple of 8), into scores (head j's row at scores + j * CHUNK):
// each key is loaded and converted once for the G heads.
template <int G, typename VV, typename T>
inline void dots(const float* q, int64_t stride, const T* const* rows, int64_t offset, int64_t c0, int64_t c1,
                 float* scores) {
  constexpr int lanes = sizeof(VV) / sizeof(float), KB = KEYS_PER<G, VV>;
  VV acc[lanes];  // lane j * KB + i: head j's partial sums with key i
  for (int k = 0; k < lanes; ++k) acc[k] = VV{};
  int64_t c = c0;
  do {  // c0 < c1: no empty path, which would keep the accumulators in memory
    VV qc[G];
    for (int j = 0; j < G; ++j) qc[j] = load_as<VV>(q + j * stride + c);
    for (int i = 0; i < KB; ++i) {
      const VV kc = load_as<VV>(rows[i] + offset + c);
      for (int j = 0; j < G; ++j) acc[j * KB + i] += qc[j] * kc;
    }
    c += lanes;
  } while (c < c1);
  float sums[lanes];
  storev(sums, reduce_lanes(acc));
  for (int j = 0; j < G; ++j) std::memcpy(scores + j * CHUNK, sums + j * KB, KB * sizeof(float));
}

// The int8 cache's scores in integers: a query head's q as int16 codes (quantize_query),
// a key's int8 codes widened to int16, multiplied in pairs and summed into int32 lanes
// (AVX-512 VNNI's vpdpwssd, AVX-VNNI's 256-bit one, AVX2's vpmaddwd + vpaddd, or
// plain code). |q code| <= 32767 and |key code| <= 127, so a head of D <= 512 values sums
// to under 2^31 (no wrap, and vpmaddwd never saturates): every build's sum is the same
// exact integer, whatever its vector width and reduction order.
namespace int_dots {
#if defined(__AVX512BW__) && defined(__AVX512VL__)  // 32 int16 lanes, and masked 256-bit loads
#define INT_DOTS_512 1
constexpr int IW = 32;  // int16 lanes a vector
#else
constexpr int IW = 16;
#endif
typedef int16_t vs __attribute__((vector_size(2 * IW)));  // IW codes
typedef int16_t vs_loose __attribute__((vector_size(2 * IW), aligned(2)));  // the same, loaded unaligned
typedef int32_t vi __attribute__((vector_size(2 * IW)));  // IW / 2 sums of pairs
typedef float vf __attribute__((vector_size(2 * IW)));    // the sums as floats

// `count` (a multiple of 8) int8 codes at p, widened; lanes past them 0 (IW at most).
inline vs widen(const int8_t* p, int64_t count) {
#if defined(INT_DOTS_512)
  if (count >= 32) return (vs)_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (vs)_mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8((1u << count) - 1, p));  // the bytes past count unread
#elif defined(__AVX2__)
  if (count >= 16) return (vs)_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (vs)_mm256_zextsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vs v = {};
  for (int64_t i = 0; i < std::min<int64_t>(count, IW); ++i) v[i] = p[i];
  return v;
#endif
}

// acc + the sums of the pairs of products q * k, lane i = q[2i] k[2i] + q[2i+1] k[2i+1].
inline vi madd(vi acc, vs q, vs k) {
#if defined(INT_DOTS_512) && defined(__AVX512VNNI__)
  return (vi)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)q, (__m512i)k);
#elif defined(INT_DOTS_512)
  return acc + (vi)_mm512_madd_epi16((__m512i)q, (__m512i)k);
#elif defined(__AVXVNNI__)
  return (vi)_mm256_dpwssd_avx_epi32((__m256i)acc, (__m256i)q, (__m256i)k);
#elif defined(__AVX2__)
  return acc + (vi)_mm256_madd_epi16((__m256i)q, (__m256i)k);
#else
  for (int i = 0; i < IW / 2; ++i) acc[i] += int32_t(q[2 * i]) * k[2 * i] + int32_t(q[2 * i + 1]) * k[2 * i + 1];
  return acc;
#endif
}
}  // namespace int_dots

// A query head's dim values x_i = q_i * pre (log2 units, as the float path's) -> int16 codes
// round(x_i / m * 32767) (ties to even; m = max |x_i|, so |code| <= 32767) and the scale
// m / 32767, codes past dim 0 up to `padded`. Each row and head once, from its own values
// only: the codes never depend on how the row's keys are cut into tasks. A zero head gets
// codes 0 and scale 0 (scores 0, as the float path's); a NaN or infinite value, codes 0
// and scale NaN (NaN scores, as the float path's).
inline void quantize_query(const float* q, int64_t dim, int64_t padded, float pre, int16_t* codes, float* scale) {
  float top = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < dim; ++i) {
    const float x = q[i] * pre;
    finite = finite && std::isfinite(x);
    top = std::max(top, std::fabs(x));
  }
  std::fill(codes, codes + padded, int16_t(0));
  if (!finite || top == 0.0f) {
    *scale = finite ? 0.0f : NAN;
    return;
  }
  for (int64_t i = 0; i < dim; ++i) codes[i] = int16_t(std::nearbyint(q[i] * pre / top * 32767.0f));
  *scale = top / 32767.0f;
}

// The integer dots: G query heads' codes (rows of q, `stride` apart, zero past dim to a
// whole vector) with KEYS_PER keys' int8 codes (key i at rows[i] + offset), into scores
// (head j's row at scores + j * CHUNK) as floats of the exact int32 sums; each key's codes
// are widened once for the G heads.
template <int G>
inline void dots_int(const int16_t* q, int64_t stride, const int8_t* const* rows, int64_t offset, int64_t dim,
                     float* scores) {
  using namespace int_dots;
  constexpr int lanes = IW / 2, KB = lanes / (G == 3 ? 4 : G);
  vi acc[lanes];  // lane j * KB + i: head j's partial sums with key i
  for (int k = 0; k < lanes; ++k) acc[k] = vi{};
  for (int64_t c = 0; c < dim; c += IW) {
    vs qc[G];
    for (int j = 0; j < G; ++j) qc[j] = *reinterpret_cast<const vs_loose*>(q + j * stride + c);
    for (int i = 0; i < KB; ++i) {
      const vs kc = widen(rows[i] + offset + c, dim - c);
      for (int j = 0; j < G; ++j) acc[j * KB + i] = madd(acc[j * KB + i], qc[j], kc);
    }
  }
  float sums[lanes];
  storev(sums, __builtin_convertvector(reduce_lanes(acc), vf));
  for (int j = 0; j < G; ++j) std::memcpy(scores + j * CHUNK, sums + j * KB, KB * sizeof(float));
}

// out_j[0, W lanes) += sum_s w_j[s] * v[s][c, ...) for G heads, value s at rows[s] + offset;
// the G x W accumulators (vectors VV) in registers.
template <int G, int W, typename VV, typename T>
inline void weighted_values(const float* w, const T* const* rows, int64_t offset, int64_t n, int64_t c, float* out,
                            int64_t out_stride) {
  constexpr int lanes = sizeof(VV) / sizeof(float);
  VV acc[G][W] = {};
  for (int64_t s = 0; s < n; ++s) {
    const T* v = rows[s] + offset + c;
    for (int i = 0; i < W; ++i) {
      const VV vc = load_as<VV>(v + lanes * i);
      for (int j = 0; j < G; ++j) acc[j][i] += w[j * CHUNK + s] * vc;
    }
  }
  for (int j = 0; j < G; ++j) std::memcpy(out + j * out_stride, acc[j], sizeof acc[j]);
}

// Any width (a multiple of 8): W vectors a pass while G x W accumulators fit the registers.
template <int G, typename T>
void weighted_values_any(const float* w, const T* const* rows, int64_t offset, int64_t n, int64_t value_dim,
                         float* out, int64_t out_stride) {
  constexpr int W = G_MAX == 4 ? (G <= 2 ? 8 : 4) : (G == 1 ? 8 : 4);
  int64_t c = 0;
  for (; c + W * L <= value_dim; c += W * L)
    weighted_values<G, W, V>(w, rows, offset, n, c, out + c, out_stride);
  for (; c + L <= value_dim; c += L) weighted_values<G, 1, V>(w, rows, offset, n, c, out + c, out_stride);
  if (c < value_dim) weighted_values<G, 1, v8>(w, rows, offset, n, c, out + c, out_stride);
}

// Calls f(std::integral_constant<int, G>{}) for a block of G = 1 to 4 query heads
// (the blocked loops' G must be a constant for their accumulators to be registers).
template <typename F>
inline void with_group(int64_t G, F&& f) {
  if (G == 4)
    f(std::integral_constant<int, 4>{});
  else if (G == 3)
    f(std::integral_constant<int, 3>{});
  else if (G == 2)
    f(std::integral_constant<int, 2>{});
  else
    f(std::integral_constant<int, 1>{});
}

struct Task {
  int64_t row, first, last;  // keys [first, last) of the row's slots
};

// A task's float scratch: scores (and scores2, of [split, dim)), weights (heads x CHUNK),
// tops (heads), the keys' and values' scales (kv_heads x CHUNK).
struct Buffers {
  float *scores, *scores2, *weights, *tops, *sk, *sk2, *sv;
};

// A thread's scratch, kept between calls: a decode step makes one call a layer, and
// a dozen fresh allocations each would cost more than a short row's attention.
template <typename T>
struct Scratch {
  std::vector<float> qs, scores, scores2, weights, tops, sk, sk2, sv, kd;
  std::vector<const T*> rows;        // each key's cache row
  std::vector<const float*> frows;   // each key's dequantized row (kd)
  Buffers buffers() {
    return {scores.data(), scores2.data(), weights.data(), tops.data(), sk.data(), sk2.data(), sv.data()};
  }
};

// One task's keys as the passes read them: key s of KV head h at rows[s] + h * head_stride,
// its value v_offset further; n keys, nL (n rounded up to L) of rows, the padding
// repeating key n - 1. sc: where a quantized row's scales are (null: unscaled);
// split: a key's values [0, split) and [split, dim) have scales of their own.
template <typename T>
struct Keys {
  const T* const* rows;
  int64_t n, nL, head_stride, v_offset, split, row_bytes;  // row_bytes: each row's, read ahead (0: none)
  const Scales* sc;
};

// Keys [first, first + nL) of `slots` of one KV head of a quantized cache, dequantized
// (codes times their scales) into kd, a row per key: the key's dim floats, then its
// value's value_dim unless the value is the key's start under the same scale (MLA's
// latent). Returns the rows' value offset.
template <typename T>
int64_t dequantize_task(const T* cache, const int64_t* slots, int64_t n, int64_t nL, int64_t head, int64_t dim,
                        int64_t value_dim, int64_t slot_stride, int64_t head_stride, int64_t v_offset,
                        const Scales& sc, float* kd, const float** rows) {
  const bool shared = v_offset == 0 && sc.value == 0 && value_dim <= sc.split;
  const int64_t stride = shared ? dim : dim + value_dim;
  for (int64_t s = 0; s < nL; ++s) {
    const T* row = cache + slots[std::min(s, n - 1)] * slot_stride;
    const T* key = row + head * head_stride;
    const int64_t i = head * sc.head;
    const float k0 = scale_at(row, sc, i), k1 = sc.split < dim ? scale_at(row, sc, i + 1) : 0.0f;
    float* ks = kd + s * stride;
    for (int64_t c = 0; c < dim; c += 8) storev(ks + c, load8(key + c) * (c < sc.split ? k0 : k1));
    rows[s] = ks;
    if (shared) continue;
    const float v0 = scale_at(row, sc, sc.value + i);
    for (int64_t c = 0; c < value_dim; c += 8) storev(ks + dim + c, load8(key + v_offset + c) * v0);
  }
  return shared ? 0 : dim;
}

// A task's queries: kv * g heads of dim floats (scaled to log2 units), or, where codes is
// not null, of int16 codes (quantize_query) `padded` apart with a scale each.
struct Queries {
  const float* values;
  const int16_t* codes;
  const float* scales;
  int64_t padded;
};

// The `kv` KV heads of a task, each with its g query heads (q), cap > 0: scores
// soft-capped at cap (log2 units). Leaves out (kv * g x value_dim)
// and lse (kv * g) for the run. Three passes: the scores of every head, block by block of
// L keys in slot order; the softmax of each query head; the weighted values, KV head by
// KV head.
template <typename T>
void heads_over(const Queries& q, int64_t g, int64_t kv, int64_t dim, int64_t value_dim, const Keys<T>& K,
                float cap, const Buffers& w, float* out, float* lse) {
  const int64_t n = K.n, nL = K.nL, split = K.split, heads = kv * g;
  const int64_t passes = (g + G_MAX - 1) / G_MAX, block = (g + passes - 1) / passes;  // query heads a pass (G_MAX)
  const Scales* sc = K.sc;
  // Local copies of the pointers: the compiler keeps them in registers through the stores.
  float *const scores = w.scores, *const scores2 = w.scores2, *const weights = w.weights, *const tops = w.tops;
  float *const sk = w.sk, *const sk2 = w.sk2, *const sv = w.sv;
  if (K.row_bytes) {  // the run's rows into cache first: every line's load at once, overlapping
    uint8_t touched = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* row = reinterpret_cast<const uint8_t*>(K.rows[i]);
      for (int64_t b = 0; b < K.row_bytes; b += 64) touched ^= row[b];
      touched ^= row[K.row_bytes - 1];
    }
    asm volatile("" : : "r"(touched));  // kept: the loads are what is wanted
  }
  for (int64_t s = 0; s < nL; s += L) {
    if (sc)  // every head's scales of the block's keys
      for (int64_t a = s; a < std::min(s + L, n); ++a)
        for (int64_t h = 0; h < kv; ++h) {
          sk[h * CHUNK + a] = scale_at(K.rows[a], *sc, h * sc->head);
          if (split < dim) sk2[h * CHUNK + a] = scale_at(K.rows[a], *sc, h * sc->head + 1);
          sv[h * CHUNK + a] = scale_at(K.rows[a], *sc, sc->value + h * sc->head);
        }
    for (int64_t h = 0; h < kv; ++h) {
      for (int64_t j0 = 0; j0 < g; j0 += block)
        with_group(std::min(block, g - j0), [&](auto group) {
          const int64_t hq = h * g + j0;
          if constexpr (std::is_same_v<T, int8_t>)
            if (q.codes) {
              constexpr int KB = int_dots::IW / 2 / (group.value == 3 ? 4 : group.value);
              for (int64_t i = s; i < s + L; i += KB)
                dots_int<group.value>(q.codes + hq * q.padded, q.padded, K.rows + i, h * K.head_stride, dim,
                                      scores + hq * CHUNK + i);
              return;
            }
          auto block = [&](auto vector, int64_t c0, int64_t c1, float* into) {
            using VV = decltype(vector);
            constexpr int KB = KEYS_PER<group.value, VV>;
            for (int64_t i = s; i < s + L; i += KB)
              dots<group.value, VV>(q.values + hq * dim, dim, K.rows + i, h * K.head_stride, c0, c1, into + i);
          };
          for (auto [c0, c1, into] : {std::tuple{int64_t(0), split, scores}, std::tuple{split, dim, scores2}}) {
            if (c0 == c1) continue;
            if ((c1 - c0) % L == 0)
              block(V{}, c0, c1, into + hq * CHUNK);
            else
              block(v8{}, c0, c1, into + hq * CHUNK);
          }
        });
    }
  }
  for (int64_t hq = 0; hq < heads; ++hq) {
    const int64_t h = hq / g;
    float* sj = scores + hq * CHUNK;
    for (int64_t s = 0; s < nL; s += L) {
      V x = loadv<V>(sj + s);
      if (q.codes) x *= q.scales[hq];                 // an integer sum times q's scale
      if (sc) x *= loadv<V>(sk + h * CHUNK + s);  // a key's scale multiplies its dot products
      if (split < dim) x += loadv<V>(scores2 + hq * CHUNK + s) * loadv<V>(sk2 + h * CHUNK + s);
      if (cap > 0.0f) x = online_softmax::soft_capped<V, widest::veci>(x, cap);
      storev(sj + s, x);
    }
    for (int64_t s = n; s < nL; ++s) sj[s] = -INFINITY;  // padding: weight exp(-inf) = 0
    V top_v = loadv<V>(sj);
    for (int64_t s = L; s < nL; s += L) top_v = top_v < loadv<V>(sj + s) ? loadv<V>(sj + s) : top_v;
    const float top = tops[hq] = hmax(top_v);
    // The sum in 16 lanes whatever the vectors' width (two vectors of 8 alternate) and the
    // padding's weights exactly 0: the same bits in every build, as the integer scores are.
    constexpr int PARTS = 16 / L;
    V totals[PARTS] = {};
    float* wj = weights + hq * CHUNK;
    for (int64_t s = 0; s < nL; s += L) {
      const V x = loadv<V>(sj + s);
      V e = exp2_nonpositive<V, widest::veci>(x - top);
      e = x == V{} - INFINITY ? V{} : e;
      totals[s / L % PARTS] += e;
      storev(wj + s, sc ? e * loadv<V>(sv + h * CHUNK + s) : e);  // a value's scale rides on its weight
    }
    V total_v = totals[0];
    for (int p = 1; p < PARTS; ++p) total_v += totals[p];
    lse[hq] = hsum(total_v);  // the softmax's sum for now, its log below
  }
  for (int64_t h = 0; h < kv; ++h)
    for (int64_t j0 = 0; j0 < g; j0 += block)
      with_group(std::min(block, g - j0), [&](auto group) {
        const int64_t hq = h * g + j0;
        weighted_values_any<group.value>(weights + hq * CHUNK, K.rows, h * K.head_stride + K.v_offset, n,
                                         value_dim, out + hq * value_dim, value_dim);
      });
  for (int64_t hq = 0; hq < heads; ++hq) {
    const float total = lse[hq];
    for (int64_t i = 0; i < value_dim; ++i) out[hq * value_dim + i] /= total;
    lse[hq] = (tops[hq] + std::log2(total)) * LN2;
  }
}

// T: float, bfloat16 (uint16_t) or a quantized cache's codes, whose scales `sc` says
// where to find (null otherwise). window > 0: a row sees its last `window` slots only.
template <typename T>
void attend(const float* q, const T* cache, const int64_t* slots, const int64_t* starts, int64_t rows,
            int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim, int64_t slot_stride,
            int64_t head_stride, int64_t v_offset, const Scales* sc, float scale, int64_t window, float soft_cap,
            float* out, float* lse) {
  constexpr bool quantized = sizeof(T) == 1;
  const int64_t g = heads / kv_heads;  // query heads per KV head
  // An int8 key with one scale takes the integer scores (codes above) whatever its group,
  // so that every build (whose G_MAX differ) takes them; MLA's latent, whose rope key has
  // a scale of its own, stays on floats.
  const bool integer = std::is_same_v<T, int8_t> && sc->split >= dim && dim <= 512;
  // A large group converts each code g / G_MAX times in place: dequantize the run once instead.
  const bool dequantize = quantized && !integer && g > 2 * G_MAX;
  const int64_t split = quantized && !dequantize ? std::min(sc->split, dim) : dim;
  const int64_t padded = (dim + int_dots::IW - 1) / int_dots::IW * int_dots::IW;
  std::vector<int16_t> q_codes(integer ? rows * heads * padded : 0);
  std::vector<float> q_scales(integer ? rows * heads : 0);
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(rows + 1);
  for (int64_t b = 0; b < rows; ++b) {
    first_task[b] = int64_t(tasks.size());
    const int64_t first = window > 0 ? std::max(starts[b], starts[b + 1] - window) : starts[b];
    const int64_t run = run_keys(starts[b + 1] - first);  // the cut: the keys the row sees, only
    for (int64_t s = first; s < starts[b + 1]; s += run) tasks.push_back({b, s, std::min(s + run, starts[b + 1])});
  }
  const float cap = soft_cap * LOG2E;  // the scores' units
  first_task[rows] = int64_t(tasks.size());
  const int64_t n_tasks = int64_t(tasks.size());
  std::vector<float> part_out(n_tasks * heads * value_dim), part_lse(n_tasks * heads);

#pragma omp parallel if (n_tasks > 1)  // one run of keys (a row of at most MIN_RUN): a team would only wait
  {
    static thread_local Scratch<T> scratch;
    auto at_least = [](auto& v, int64_t size) {
      if (int64_t(v.size()) < size) v.resize(size);
    };
    at_least(scratch.qs, heads * dim);
    for (auto* v : {&scratch.scores, &scratch.weights}) at_least(*v, heads * CHUNK);
    if (split < dim) at_least(scratch.scores2, heads * CHUNK);
    for (auto* v : {&scratch.sk, &scratch.sk2, &scratch.sv}) at_least(*v, kv_heads * CHUNK);
    at_least(scratch.tops, heads);
    at_least(scratch.rows, CHUNK);
    at_least(scratch.frows, CHUNK);
    if (dequantize) at_least(scratch.kd, CHUNK * (dim + value_dim));  // a run's keys and values (MLA's 256 x 576)
    if (integer) {
#pragma omp for
      for (int64_t bh = 0; bh < rows * heads; ++bh)
        quantize_query(q + bh * dim, dim, padded, scale * LOG2E, q_codes.data() + bh * padded, &q_scales[bh]);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tasks; ++t) {
      const Task& task = tasks[t];
      const int64_t n = task.last - task.first, nL = (n + L - 1) / L * L;
      const int64_t* ts = slots + task.first;
      const float* qt = q + task.row * heads * dim;
      // scores in log2 units (vec.h)
      if (!integer)
        for (int64_t i = 0; i < heads * dim; ++i) scratch.qs[i] = qt[i] * (scale * LOG2E);
      float* o = part_out.data() + t * heads * value_dim;
      float* l = part_lse.data() + t * heads;
      const Buffers buffers = scratch.buffers();
      if (dequantize) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t offset = dequantize_task(cache, ts, n, nL, h, dim, value_dim, slot_stride, head_stride,
                                                 v_offset, *sc, scratch.kd.data(), scratch.frows.data());
          const Keys<float> K{scratch.frows.data(), n, nL, 0, offset, dim, 0, nullptr};
          const Queries qh{scratch.qs.data() + h * g * dim, nullptr, nullptr, 0};
          heads_over(qh, g, 1, dim, value_dim, K, cap, buffers, o + h * g * value_dim, l + h * g);
        }
        continue;
      }
      for (int64_t s = 0; s < nL; ++s) scratch.rows[s] = cache + ts[std::min(s, n - 1)] * slot_stride;
      const Keys<T> K{scratch.rows.data(), n, nL, head_stride, v_offset, split, slot_stride * int64_t(sizeof(T)),
                      quantized ? sc : nullptr};
      const int64_t first = task.row * heads;
      const Queries queries{scratch.qs.data(), integer ? q_codes.data() + first * padded : nullptr,
                            integer ? q_scales.data() + first : nullptr, padded};
      heads_over(queries, g, kv_heads, dim, value_dim, K, cap, buffers, o, l);
    }

    // Merge each row's runs per query head: out = sum_c exp(lse_c - Z) out_c, Z = logsumexp_c lse_c.
#pragma omp for
    for (int64_t bh = 0; bh < rows * heads; ++bh) {
      const int64_t b = bh / heads, h = bh % heads, t0 = first_task[b], t1 = first_task[b + 1];
      float* o = out + bh * value_dim;
      std::fill(o, o + value_dim, 0.0f);
      if (t0 == t1) {  // a row without keys: out 0, lse -inf, as the PyTorch path
        lse[bh] = -INFINITY;
        continue;
      }
      float top = part_lse[t0 * heads + h];
      for (int64_t t = t0 + 1; t < t1; ++t) top = std::max(top, part_lse[t * heads + h]);
      float total = 0.0f;
      for (int64_t t = t0; t < t1; ++t) total += std::exp(part_lse[t * heads + h] - top);
      for (int64_t t = t0; t < t1; ++t) {
        const float w = std::exp(part_lse[t * heads + h] - top) / total;
        const float* src = part_out.data() + (t * heads + h) * value_dim;
        for (int64_t d = 0; d < value_dim; ++d) o[d] += w * src[d];
      }
      lse[bh] = top + std::log(total);
    }
  }
}

}  // namespace

extern "C" {

// q (rows, heads, dim) float32; slots: the rows' cache slots back to back,
// row b's at [starts[b], starts[b+1]); window > 0: row b sees only the last `window`
// of them (0: all); soft_cap > 0: each scaled logit x becomes soft_cap · tanh(x /
// soft_cap) (0: none); out (rows, heads, value_dim) and lse (rows, heads) float32.
// Query head i uses KV head i / (heads / kv_heads).
void paged_decode_f32(const float* q, const float* cache, const int64_t* slots, const int64_t* starts, int64_t rows,
                      int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim, int64_t slot_stride,
                      int64_t head_stride, int64_t v_offset, float scale, int64_t window, float soft_cap, float* out,
                      float* lse) {
  attend(q, cache, slots, starts, rows, heads, kv_heads, dim, value_dim, slot_stride, head_stride, v_offset, nullptr,
         scale, window, soft_cap, out, lse);
}

// The same over a bfloat16 cache (q, out and lse stay float32).
void paged_decode_bf16(const float* q, const uint16_t* cache, const int64_t* slots, const int64_t* starts,
                       int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim,
                       int64_t slot_stride, int64_t head_stride, int64_t v_offset, float scale, int64_t window,
                       float soft_cap, float* out, float* lse) {
  attend(q, cache, slots, starts, rows, heads, kv_heads, dim, value_dim, slot_stride, head_stride, v_offset, nullptr,
         scale, window, soft_cap, out, lse);
}

// The same over a quantized cache of byte rows (strides in bytes): code 0 int8, 1
// float8_e4m3fn, 2 float8_e5m2; the scales as kv_codes.h's Scales.
void paged_decode_quant(const float* q, const uint8_t* cache, const int64_t* slots, const int64_t* starts,
                        int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim,
                        int64_t slot_stride, int64_t head_stride, int64_t v_offset, int64_t code,
                        int64_t scale_offset, int64_t scale_head, int64_t scale_value, int64_t split, float scale,
                        int64_t window, float soft_cap, float* out, float* lse) {
  const Scales sc{scale_offset, scale_head, scale_value, split};
  auto run = [&](auto* codes) {
    attend(q, codes, slots, starts, rows, heads, kv_heads, dim, value_dim, slot_stride, head_stride, v_offset, &sc,
           scale, window, soft_cap, out, lse);
  };
  if (code == 0) run(reinterpret_cast<const int8_t*>(cache));
  if (code == 1) run(reinterpret_cast<const E4M3*>(cache));
  if (code == 2) run(reinterpret_cast<const E5M2*>(cache));
}
}
