// Causal attention of a prefill chunk: L queries that are the last L of S
// keys (query i at position S - L + i sees keys 0 .. S - L + i), unmasked
// (every query sees every key), or with a key count per query (query i sees
// keys 0 .. counts[i] - 1: DCP's shards, whose keys up to a query's position
// are a prefix of the shard), grouped-query heads, fp32. A sliding window gives
// each query its first key too (query i sees no key before firsts[i]; one left no
// key gets out 0, lse -inf), and a soft cap passes each scaled logit through
// cap · tanh(x / cap) (online_softmax.h). Flash attention's blocking, with register-tiled inner products:
//
//   for each (KV head h, block of BQ queries)            <- one task
//     Q block: BQ queries x g heads = M rows, scaled      (packed, M x D)
//     for each block of BK keys that any query sees (from the block of the task's
//     first key: blocks wholly before every query's window are skipped):
//       scores = Q · K^T        M x BK  (K^T packed once per call, D x S)
//       [soft cap]; mask the block's future keys (diagonal blocks only) and the
//       window's past ones
//       online softmax: row max, rescale, p = 2^(score - max), scores in log2 units,
//       p = 0 exactly for a key the row does not see
//       O += P · V              M x Dv  (V rows read in place; a tile of rows up to the
//                                        last key one of them sees)
//     out = O / row sums,  lse = (max + log2(row sums)) ln 2
//
// Both products run as tiles of ROWS rows x 4 vectors whose accumulators stay
// in registers: each step broadcasts one float of the left operand and fuses
// it into 4 vectors of the right one.
//
// Over a quantized cache's rows (kv_codes.h) each block of BK keys is
// converted as it is reached: the context is never dequantized whole. A block
// is converted once per task, one conversion per value against the M rows'
// multiply-adds with it. fp8 blocks are dequantized, K^T into a (D x BK) tile
// and V into (BK x Dv) rows, for the float products above.
//
// int8 blocks stay integers, and both products are integer dot products
// (vpdpwssd: AVX-512 VNNI, or AVX-VNNI's 256-bit one; else vpmaddwd + vpaddd),
// each instruction two multiply-adds a lane against an FMA's one:
//   scores: each query row is rounded once to int16 codes with its own scale
//     (max |q| / 32767: a function of that row alone, so a token's codes are the
//     same whatever task, chunk or rank holds it); the keys' codes, widened to
//     int16, are laid out as pairs of dims across keys (pack_key_pairs), so a
//     broadcast pair of a row meets W keys and no score needs a horizontal sum;
//     the int32 sum times the row's and the key's scales is the score.
//   P · V: each row's weights of the block times the values' scales are rounded
//     to int16 codes with a scale a row (max / 32767), and the values' codes are
//     laid out as pairs of keys (pack_value_pairs), a broadcast pair of weights
//     against W dims; O adds the int32 sums times the row's scale.
// The rounding moves a score by at most 2^-16 of max|q| · sum|k| and a weight by
// 2^-16 of its block's largest (tests/helpers/attention_reference.py's int8_bounds),
// far under the int8 codes' own rounding (2^-8 of an entry's largest). The sums
// are exact (int32 cannot overflow up to 512 dims, nor 64 keys a block) and integer
// addition has no order, so every instruction set finds the same sums; with the
// row sums kept as 16 partial sums on every vector width (add_sums) and no product
// fused into an add on one build but not another (rounded_apart), the haswell,
// alderlake and AVX-512 builds give the same bits. Chosen by measurement on a
// 2-core Zen 5 (1 thread, 9/3 and 32/8 heads of 64, 512 and 2048 tokens): 1.1-1.25x
// the speed of dequantizing the blocks to floats, most of it from the scores (P · V's
// integer products add 1.05-1.1x: rounding the weights costs much of what they save);
// the integer products are then about three quarters of the kernel's time. On Zen 3's
// AVX2 (vpmaddwd + vpaddd) 1.5-1.7x at the same shapes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "kv_codes.h"
#include "online_softmax.h"
#include "vec.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using widest::vec;  // AVX-512: 32 registers of 16 floats, tiles of 6 x 4 vectors (24 accumulators);
using widest::W;    // else 16 registers of 8 floats, tiles of 3 x 4 vectors (12 accumulators)
using widest::veci;
constexpr int64_t ROWS = W == 16 ? 6 : 3;
constexpr int64_t TILE = 4 * W;  // columns of a tile
// Chosen by measurement (2 threads, AVX-512, 9/3 heads of 64, 2048 queries
// after 0 and 4096 keys): 6-row tiles beat 4-row ones by 1.2x; BK 128 was within
// noise of 64. A quantized cache's blocks are dequantized once per task: 64 queries
// a task (not 32) halve that, 1.1x at 2048 tokens (1 thread, 9/3 heads of 64).
// Which queries share a task changes no bit of theirs (online_softmax.h).
constexpr int64_t BK = 64;  // keys per block (a multiple of TILE)
constexpr int64_t BQ = 64;  // queries per task, at most

// c[r][0, TILE) = (c[r][0, TILE) * keep[r] if keep) + sum_d a[r][d] * b(d)[0, TILE)
// for r < ROWS: a and c row-major with strides lda and ldc, b(d) the address of
// row d of the right operand (K^T rows, or V rows where they lie in memory).
template <typename Rows>
inline void tile_product(const float* a, int64_t lda, Rows b, int64_t depth, const float* keep, float* c,
                         int64_t ldc) {
  vec acc[ROWS][4] = {};
  if (keep)
    for (int64_t r = 0; r < ROWS; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = loadv<vec>(c + r * ldc + i * W) * keep[r];
  // The rows' broadcasts held and the right operand's vectors taken one at a time: ROWS x 4
  // accumulators, ROWS broadcasts and one vector fill AVX2's 16 registers (all 4 vectors
  // held as well, GCC kept an accumulator on the stack, each step waiting on its store).
  for (int64_t d = 0; d < depth; ++d) {
    const float* bd_row = b(d);
    float ar[ROWS];  // broadcast by the vector products
    for (int64_t r = 0; r < ROWS; ++r) ar[r] = a[r * lda + d];
    for (int i = 0; i < 4; ++i) {
      const vec bd = loadv<vec>(bd_row + i * W);
      for (int64_t r = 0; r < ROWS; ++r) acc[r][i] += ar[r] * bd;
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int i = 0; i < 4; ++i) storev(c + r * ldc + i * W, acc[r][i]);
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// W codes from p as floats (load8's, eight at a time).
template <typename T>
inline vec load_codes(const T* p) {
#ifdef __AVX512F__
  const v8 lo = load8(p), hi = load8(p + 8);
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return load8(p);
#endif
}

// Stage b of a W x W transpose (transpose below): rows i and i + b (i & b == 0) swap
// their off-diagonal b x b blocks, one two-vector permutation a row.
template <int b>
inline void transpose_stage(vec* r) {
  veci lane;
  for (int j = 0; j < W; ++j) lane[j] = j;
  const veci high = (lane & b) != 0;  // lanes of the right-hand block
  const veci take_low = high ? lane - b + int(W) : lane, take_high = high ? lane + int(W) : lane + b;
  for (int i = 0; i < W; ++i)
    if (!(i & b)) {
      const vec x = r[i], y = r[i + b];
      r[i] = __builtin_shuffle(x, y, take_low), r[i + b] = __builtin_shuffle(x, y, take_high);
    }
  if constexpr (b > 1) transpose_stage<b / 2>(r);
}

// Rows r[0, W) of a W x W block, transposed in place: log2(W) stages.
inline void transpose(vec* r) { transpose_stage<W / 2>(r); }

// Keys [s0, s0 + keys) of KV head h of a quantized cache, dequantized into kt
// (dim x BK, padding keys 0). k: the rows (k_stride bytes apart, K of head h at h * dim,
// scales as `sc`). W keys by W dims at a time: dequantized a key a row, then transposed in
// registers (a scalar store per value cost more than the products it feeds).
template <typename T>
void dequantize_keys(const T* k, int64_t k_stride, int64_t s0, int64_t keys, int64_t h, int64_t dim,
                     const Scales& sc, float* kt) {
  for (int64_t s1 = 0; s1 < BK; s1 += W)
    for (int64_t d0 = 0; d0 < dim; d0 += W) {
      vec r[W];
      for (int64_t s = 0; s < W; ++s) {
        const T* row = k + (s0 + s1 + s) * k_stride;
        r[s] = s1 + s < keys ? load_codes(row + h * dim + d0) * scale_at(row, sc, h * sc.head) : vec{};
      }
      transpose(r);
      for (int64_t d = 0; d < W; ++d) storev(kt + (d0 + d) * BK + s1, r[d]);
    }
}

// The same keys' values dequantized into vb (keys x value_dim); v = k + V's offset.
template <typename T>
void dequantize_values(const T* k, const T* v, int64_t k_stride, int64_t s0, int64_t keys, int64_t h,
                       int64_t value_dim, const Scales& sc, float* vb) {
  for (int64_t s = 0; s < keys; ++s) {
    const T* row = k + (s0 + s) * k_stride;
    const float vs = scale_at(row, sc, sc.value + h * sc.head);
    for (int64_t d = 0; d < value_dim; d += 8) {
      const v8 x = load8(v + (s0 + s) * k_stride + h * value_dim + d) * vs;
      std::memcpy(vb + s * value_dim + d, &x, sizeof x);
    }
  }
}

// v as computed, rounded: the compiler may not fuse the product that made it into an add
// that follows (one FMA on one build, a multiply and an add on another, or where the
// vector width changes which products meet which adds).
inline vec rounded_apart(vec v) {
#if defined(__AVX512F__)
  __asm__("" : "+v"(v));  // in its register: costs no instruction
#elif defined(__AVX__)
  __asm__("" : "+x"(v));
#else
  __asm__("" : "+m"(v));  // two SSE registers: through memory
#endif
  return v;
}

// int8 blocks' products as integer dot products. A lane of veci holds a pair of int16 (two
// dims, or two keys; the lower first), and dot_pairs adds a.lo · b.lo + a.hi · b.hi to each lane of acc:
// AVX-512 VNNI's vpdpwssd, AVX-VNNI's 256-bit one, else vpmaddwd + vpaddd. They compute
// the same int32: no product pair saturates (q's codes stop at +-32767, so never
// -32768 · -32768), no sum overflows (MAX_INT_DIM; P · V's 64 keys a block are far
// under it), and integer sums do not depend on their order, so every build gets the same.
typedef int16_t pairs __attribute__((vector_size(sizeof(vec))));           // 2W int16: W pairs
typedef int16_t halves __attribute__((vector_size(sizeof(vec) / 2)));      // W int16
typedef int8_t codes __attribute__((vector_size(sizeof(vec) / 2)));        // 2W int8
// veci read where it lies (a word's alignment): one vector load. Copied into a veci with memcpy,
// GCC moved it 16 bytes at a time through the stack, and the products' 32-byte loads of the
// copy then waited on the two stores (no forwarding across them).
typedef int32_t veci_loose __attribute__((vector_size(sizeof(veci)), aligned(4)));
// A score's sum: dim / 2 pairs of at most 2 · 32767 · 128 each, under 2^31 - 1 up to 512 dims.
constexpr int64_t MAX_INT_DIM = 512;

inline veci dot_pairs(veci acc, veci a, veci b) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return (veci)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, (__m512i)b);
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  return (veci)_mm512_add_epi32((__m512i)acc, _mm512_madd_epi16((__m512i)a, (__m512i)b));
#elif !defined(__AVX512F__) && defined(__AVXVNNI__)
  return (veci)_mm256_dpwssd_avx_epi32((__m256i)acc, (__m256i)a, (__m256i)b);
#elif !defined(__AVX512F__) && defined(__AVX2__)
  return (veci)_mm256_add_epi32((__m256i)acc, _mm256_madd_epi16((__m256i)a, (__m256i)b));
#else
  const pairs x = (pairs)a, y = (pairs)b;
  for (int j = 0; j < W; ++j) acc[j] += int32_t(x[2 * j]) * y[2 * j] + int32_t(x[2 * j + 1]) * y[2 * j + 1];
  return acc;
#endif
}

// t rounded to the nearest integer, ties to even (|t| < 2^22): cvtps2dq under the default
// rounding mode; elsewhere adding and taking away 1.5 · 2^23, which float holds exactly.
inline veci nearest(vec t) {
#if defined(__AVX512F__)
  return (veci)_mm512_cvtps_epi32((__m512)t);
#elif defined(__AVX__)
  return (veci)_mm256_cvtps_epi32((__m256)t);
#else
  return __builtin_convertvector((t + 12582912.0f) - 12582912.0f, veci);
#endif
}

// Row x (n floats, n a multiple of W) as int16 codes (pairs as int32 words) and their
// scale, max |x| / 32767: a function of the row alone, so a query gets the same codes
// whatever task, chunk or rank holds it (and a row of weights the same whatever rows share
// its tile). A row of zeros gets scale 0; one with a NaN or an infinity codes 0 and scale
// NaN (its results NaN, as float products would make them).
inline float quantize_row(const float* x, int64_t n, int32_t* out) {
  vec tops{}, bad{};
  for (int64_t d = 0; d < n; d += W) {
    const vec v = loadv<vec>(x + d), a = v < 0 ? -v : v;
    tops = tops < a ? a : tops;
    bad += v - v;  // NaN where any lane is NaN or infinite
  }
  const float top = hmax(tops);
  const bool finite = hsum(bad) == 0.0f;
  if (!finite || top == 0.0f) {
    std::fill(out, out + n / 2, 0);
    return finite ? 0.0f : NAN;
  }
  // x / top · 32767 lies in [-32767, 32767] (up to its float rounding); x · (32767 / top)
  // where that quotient is finite (top over ~1e-34), else divided.
  const float inv = 32767.0f / top;
  for (int64_t d = 0; d < n; d += W) {
    const vec t = rounded_apart(std::isinf(inv) ? loadv<vec>(x + d) / top * 32767.0f : loadv<vec>(x + d) * inv);
    const halves c = __builtin_convertvector(nearest(t), halves);
    std::memcpy(out + d / 2, &c, sizeof c);
  }
  return top / 32767.0f;
}

// Keys [s0, s0 + keys) of KV head h's int8 codes widened to int16 pairs: word p of kp's
// row of key s, kp[p * BK + s], holds dims 2p and 2p + 1 (padding keys 0), so the products
// broadcast a query's pair against W keys at once and no score needs a horizontal sum; ks
// (BK) the keys' scales. W keys by W pairs at a time: widened a key a row, then transposed
// in registers as dequantize_keys does (32-bit words move as floats do).
inline void pack_key_pairs(const int8_t* k, int64_t k_stride, int64_t s0, int64_t keys, int64_t h, int64_t dim,
                           const Scales& sc, int32_t* kp, float* ks) {
  for (int64_t s1 = 0; s1 < BK; s1 += W)
    for (int64_t d0 = 0; d0 < dim; d0 += 2 * W) {
      vec r[W];
      for (int64_t s = 0; s < W; ++s) {
        r[s] = vec{};
        if (s1 + s < keys) {
          codes c;
          std::memcpy(&c, k + (s0 + s1 + s) * k_stride + h * dim + d0, sizeof c);
          const pairs wide = __builtin_convertvector(c, pairs);
          std::memcpy(&r[s], &wide, sizeof wide);
        }
      }
      transpose(r);
      for (int64_t p = 0; p < W; ++p) std::memcpy(kp + (d0 / 2 + p) * BK + s1, &r[p], sizeof(vec));
    }
  for (int64_t s = 0; s < BK; ++s) ks[s] = s < keys ? scale_at(k + (s0 + s) * k_stride, sc, h * sc.head) : 0.0f;
}

// The value pairs of keys [s0, s0 + keys) of KV head h, for P · V: word c of vp's row p,
// vp[p * value_dim + c], holds dim c of keys 2p and 2p + 1 (a missing key's 0), so the
// products broadcast a row's weights of two keys against W dims at once. v = k + V's offset.
inline void pack_value_pairs(const int8_t* v, int64_t k_stride, int64_t s0, int64_t keys, int64_t h,
                             int64_t value_dim, int32_t* vp) {
  typedef int8_t lane_codes __attribute__((vector_size(W)));
  typedef uint32_t vecu __attribute__((vector_size(sizeof(vec))));
  for (int64_t s = 0; s < keys; s += 2)
    for (int64_t c = 0; c < value_dim; c += W) {
      lane_codes lo, hi{};
      std::memcpy(&lo, v + (s0 + s) * k_stride + h * value_dim + c, sizeof lo);
      if (s + 1 < keys) std::memcpy(&hi, v + (s0 + s + 1) * k_stride + h * value_dim + c, sizeof hi);
      const vecu word = (__builtin_convertvector(lo, vecu) & 0xFFFFu) | (__builtin_convertvector(hi, vecu) << 16);
      std::memcpy(vp + s / 2 * value_dim + c, &word, sizeof word);
    }
}

// A tile of integer products: acc[r][i] = sum_p a[r][p] · b(p)[i W, (i + 1) W) for r < ROWS,
// i < 4, over `depth` pairs (a's rows of pairs lda words apart, b(p) the address of the
// right operand's row p of pairs); out(r, i, acc[r][i]) takes each W lanes.
template <typename Rows, typename Out>
inline void tile_pairs(const int32_t* a, int64_t lda, Rows b, int64_t depth, Out out) {
  veci acc[ROWS][4] = {};
  for (int64_t p = 0; p < depth; ++p) {
    const int32_t* bp_row = b(p);
    veci bp[4];
    for (int i = 0; i < 4; ++i) bp[i] = (veci)*reinterpret_cast<const veci_loose*>(bp_row + i * W);
    for (int64_t r = 0; r < ROWS; ++r) {
      const veci ar = veci{} + a[r * lda + p];  // a row's pair, broadcast
      for (int i = 0; i < 4; ++i) acc[r][i] = dot_pairs(acc[r][i], ar, bp[i]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int i = 0; i < 4; ++i) out(r, i, acc[r][i]);
}

// int8 blocks' row sums as 16 partial sums on every build (lane j adds the weights of keys
// j, j + 16, ...), so that a row's total, and so its output, is the same float whatever
// the build's vector width (float and fp8 blocks keep online_softmax's W sums). add: the weights of W keys [s, s + W) of a row whose sums are `sums`,
// after the block's rescale at its first key; to_totals: the W partial sums that
// online_softmax::finish reduces as vec.h's hsum reduces the 16.
inline void add_sums(float* sums, int64_t s, float rescale, vec p) {
  if (s == 0)
    for (int64_t i = 0; i < 16; i += W) storev(sums + i, rounded_apart(loadv<vec>(sums + i) * rescale));
  storev(sums + s % 16, loadv<vec>(sums + s % 16) + p);
}
inline void to_totals(const float* sums, float* totals) {
  if constexpr (W == 16)
    storev(totals, loadv<vec>(sums));
  else
    storev(totals, loadv<vec>(sums) + loadv<vec>(sums + 8));
}

// T float, or a quantized cache's codes with its scales `sc` (null for float):
// prefill_attention_f32 / prefill_attention_quant below.
// with_counts and variant (a window or a soft cap) template arguments: the causal path's loops
// test neither at run time. Every path weighs a key a row does not see exactly 0 (zero_unseen),
// so that P · V may stop at the last key a tile's rows see, and a row's bits depend neither on
// the rows beside it nor on how many keys the call holds past its own.
template <bool with_counts, bool variant, typename T>
void prefill_impl(const float* q, const T* k, const T* v, int64_t L, int64_t S, int64_t heads, int64_t kv_heads,
                  int64_t dim, int64_t value_dim, int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t causal,
                  const int64_t* counts, const int64_t* firsts, const Scales* sc, float scale, float soft_cap,
                  float* out, float* lse) {
  constexpr bool quantized = sizeof(T) == 1, int8 = std::is_same_v<T, int8_t>;
  // int8 blocks: both products integer dot products (pack_key_pairs, pack_value_pairs,
  // tile_pairs) where the scores' int32 sums cannot overflow; else floats, or dequantized.
  const bool integer = int8 && dim <= MAX_INT_DIM;
  // Keys query i sees: its count, or up to offset + i (bottom-right causal, or every key);
  // from its first (a window's), or key 0. A task's padding rows (i >= L) read the last
  // query's; they are never written out.
  const int64_t g = heads / kv_heads, offset = causal ? S - L : S - 1;
  auto seen_by = [&](int64_t i) {
    if constexpr (with_counts) return counts[std::min(i, L - 1)];
    return offset + i + 1;
  };
  auto first_of = [&](int64_t i) -> int64_t {
    if constexpr (variant) return firsts ? firsts[std::min(i, L - 1)] : 0;
    return 0;
  };
  const float scale_log2 = scale * LOG2E;  // scores in log2 units (vec.h)
  // Fewer queries a task where that leaves each thread under two tasks (a short chunk), and no
  // padding rows for queries a chunk lacks.
  const int64_t threads = omp_get_max_threads();
  const int64_t bq = std::min(BQ, std::max<int64_t>(1, (L * kv_heads + 2 * threads - 1) / (2 * threads)));
  const int64_t S_pad = round_up(S, BK), M = round_up(bq * g, ROWS), M_vec = round_up(M, W);
  // Float keys: K^T per KV head, zero-padded to whole blocks, packed once per call:
  // (kv_heads, dim, S_pad). Quantized keys are dequantized block by block instead.
  std::vector<float> kt(quantized ? 0 : kv_heads * dim * S_pad, 0.0f);
  const int64_t q_blocks = (L + bq - 1) / bq;

#pragma omp parallel
  {
    if constexpr (!quantized) {
#pragma omp for collapse(2)
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t s0 = 0; s0 < S; s0 += BK)
          for (int64_t s = s0; s < std::min(S, s0 + BK); ++s)
            for (int64_t d = 0; d < dim; ++d) kt[(h * dim + d) * S_pad + s] = k[s * k_stride + h * dim + d];
    }

    std::vector<float> qb(integer ? 0 : M * dim), scores(M * BK), o(M * value_dim), sums(integer ? M * 16 : 0);
    std::vector<float> top(M_vec), totals(M * W), rescale(M_vec), block_top(M_vec, 0.0f);
    const online_softmax::Rows rows{top.data(), block_top.data(), rescale.data(), totals.data()};
    std::vector<const float*> v_rows(BK);
    std::vector<float> kt_block(quantized && !integer ? dim * BK : 0), v_block(quantized && !integer ? BK * value_dim : 0);
    // int8 keys: the task's queries as int16 pairs (M, dim / 2) with a scale a row (times
    // scale_log2), and a block's keys as pairs (dim / 2, BK) with a scale a key.
    std::vector<int32_t> qi(integer ? M * dim / 2 : 0), kp(integer ? dim / 2 * BK : 0);
    std::vector<float> q_scale(integer ? M : 0), k_scale(integer ? BK : 0);
    // And for P · V: each row's weights of the block times the values' scales, as int16
    // pairs (M, BK / 2) with a scale a row; the block's values as pairs of keys (BK / 2, value_dim).
    std::vector<int32_t> wi(integer ? M * BK / 2 : 0), vp(integer ? BK / 2 * value_dim : 0);
    std::vector<float> w_scale(integer ? M : 0), v_scale(integer ? BK : 0);
    // Later query blocks see more keys: hand them out first, so the threads finish together.
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t nb = 0; nb < q_blocks; ++nb)
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t i0 = (q_blocks - 1 - nb) * bq, n = std::min(bq, L - i0);
        // Padding rows score 0 and are never written out.
        if (integer) {
          std::fill(qi.begin(), qi.end(), 0), std::fill(q_scale.begin(), q_scale.end(), 0.0f);
          for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < g; ++j) {
              const int64_t m = i * g + j;
              q_scale[m] = quantize_row(q + (i0 + i) * q_stride + (h * g + j) * dim, dim, qi.data() + m * dim / 2);
              q_scale[m] *= scale_log2;
            }
        } else {
          std::fill(qb.begin(), qb.end(), 0.0f);
          for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < g; ++j)
              for (int64_t d = 0; d < dim; ++d)
                qb[(i * g + j) * dim + d] = q[(i0 + i) * q_stride + (h * g + j) * dim + d] * scale_log2;
        }
        std::fill(o.begin(), o.end(), 0.0f);
        std::fill(top.begin(), top.end(), -INFINITY);
        std::fill(totals.begin(), totals.end(), 0.0f);
        std::fill(sums.begin(), sums.end(), 0.0f);  // int8 blocks' row sums (add_sums)

        int64_t last_pos = -1, first_pos = S;  // the task's queries see keys from, up to here
        for (int64_t i = 0; i < n; ++i) {
          last_pos = std::max(last_pos, seen_by(i0 + i) - 1);
          first_pos = std::min(first_pos, first_of(i0 + i));
        }
        for (int64_t s0 = first_pos / BK * BK; s0 <= std::min(last_pos, S - 1); s0 += BK) {
          const int64_t keys = std::min(BK, S - s0);
          const float* kt_s0 = kt.data() + h * dim * S_pad + s0;  // row d of K^T at kt_s0 + d * kt_ld
          int64_t kt_ld = S_pad;
          if constexpr (quantized) {
            if constexpr (int8)
              if (integer) {
                pack_key_pairs(k, k_stride, s0, keys, h, dim, *sc, kp.data(), k_scale.data());
                pack_value_pairs(v, k_stride, s0, keys, h, value_dim, vp.data());
                for (int64_t s = 0; s < BK; ++s)
                  v_scale[s] = s < keys ? scale_at(k + (s0 + s) * k_stride, *sc, sc->value + h * sc->head) : 0.0f;
              }
            if (!integer) {
              dequantize_keys(k, k_stride, s0, keys, h, dim, *sc, kt_block.data());
              dequantize_values(k, v, k_stride, s0, keys, h, value_dim, *sc, v_block.data());
              kt_s0 = kt_block.data(), kt_ld = BK;
              for (int64_t s = 0; s < keys; ++s) v_rows[s] = v_block.data() + s * value_dim;
            }
          } else {
            for (int64_t s = 0; s < keys; ++s) v_rows[s] = v + (s0 + s) * v_stride + h * value_dim;
          }
          for (int64_t m = 0; m < M; m += ROWS)
            for (int64_t c = 0; c < BK; c += TILE)
              if (integer)
                tile_pairs(qi.data() + m * dim / 2, dim / 2, [&](int64_t p) { return kp.data() + p * BK + c; },
                           dim / 2, [&](int64_t r, int i, veci acc) {
                             const vec ks = loadv<vec>(k_scale.data() + c + i * W);
                             storev(scores.data() + (m + r) * BK + c + i * W,
                                    __builtin_convertvector(acc, vec) * q_scale[m + r] * ks);
                           });
              else
                tile_product(qb.data() + m * dim, dim, [&](int64_t d) { return kt_s0 + d * kt_ld + c; }, dim,
                             nullptr, scores.data() + m * BK + c, BK);
          auto seen = [&](int64_t m) { return std::min(keys, std::max<int64_t>(0, seen_by(i0 + m / g) - s0)); };
          auto first = [&](int64_t m) -> int64_t {
            if constexpr (variant) return std::min(BK, std::max<int64_t>(0, first_of(i0 + m / g) - s0));
            return 0;
          };
          if constexpr (variant)
            if (soft_cap > 0.0f) online_softmax::cap_scores(scores.data(), M, BK, 1.0f, soft_cap * LOG2E);
          online_softmax::block<true, false>(scores.data(), M, M_vec, BK, 1.0f, first, seen, rows,
                                             [&](int64_t m, int64_t s, vec p) {
                                               if (!integer) {
                                                 storev(scores.data() + m * BK + s, p);
                                                 return p;
                                               }
                                               // Integer P · V's weights: times the values' scales;
                                               // the row's sums in `sums` instead.
                                               storev(scores.data() + m * BK + s, p * loadv<vec>(v_scale.data() + s));
                                               add_sums(sums.data() + m * 16, s, rescale[m], p);
                                               return vec{};
                                             });
          if (integer)
            for (int64_t m = 0; m < M; ++m) w_scale[m] = quantize_row(scores.data() + m * BK, BK, wi.data() + m * BK / 2);
          // P · V over the keys some row of the tile sees: past them every weight is exactly 0.
          for (int64_t m = 0; m < M; m += ROWS) {
            int64_t depth = 0;
            for (int64_t r = 0; r < ROWS; ++r) depth = std::max(depth, seen(m + r));
            for (int64_t c = 0; c < value_dim; c += TILE)
              if (integer)  // O rescaled, plus the sums at the row's scale, each rounded on its own
                tile_pairs(wi.data() + m * BK / 2, BK / 2, [&](int64_t p) { return vp.data() + p * value_dim + c; },
                           (depth + 1) / 2, [&](int64_t r, int i, veci acc) {
                             float* dst = o.data() + (m + r) * value_dim + c + i * W;
                             storev(dst, rounded_apart(loadv<vec>(dst) * rescale[m + r]) +
                                             rounded_apart(__builtin_convertvector(acc, vec) * w_scale[m + r]));
                           });
              else
                tile_product(scores.data() + m * BK, BK, [&](int64_t s) { return v_rows[s] + c; }, depth,
                             rescale.data() + m, o.data() + m * value_dim + c, value_dim);  // O rescaled as loaded
          }
        }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < g; ++j) {
            const int64_t m = i * g + j, row = (i0 + i) * heads + h * g + j;
            if (integer) to_totals(sums.data() + m * 16, totals.data() + m * W);
            online_softmax::finish(o.data() + m * value_dim, value_dim, rows, m, out + row * value_dim,
                                   lse ? lse + row : nullptr);
          }
      }
  }
}

}  // namespace

template <typename T>
void prefill(const float* q, const T* k, const T* v, int64_t L, int64_t S, int64_t heads, int64_t kv_heads,
             int64_t dim, int64_t value_dim, int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t causal,
             const int64_t* counts, const int64_t* firsts, const Scales* sc, float scale, float soft_cap, float* out,
             float* lse) {
  const bool variant = firsts || soft_cap > 0.0f;
  auto run = counts ? (variant ? prefill_impl<true, true, T> : prefill_impl<true, false, T>)
                    : (variant ? prefill_impl<false, true, T> : prefill_impl<false, false, T>);
  run(q, k, v, L, S, heads, kv_heads, dim, value_dim, q_stride, k_stride, v_stride, causal, counts, firsts, sc, scale,
      soft_cap, out, lse);
}

extern "C" {

// q (L, H, D) with q_stride floats between tokens; k, v: key/value s of KV
// head h at k + s * k_stride + h * D and v + s * v_stride + h * Dv; counts
// (L,), if not null: query i sees keys [0, counts[i]) (1 <= counts[i] <= S);
// else causal: query i sees keys up to S - L + i (L <= S), or every key; firsts
// (L,), if not null: query i sees no key before firsts[i] (0 <= firsts[i] <= S; a
// query left no key gets out 0, lse -inf); soft_cap > 0: each scaled logit x becomes
// soft_cap · tanh(x / soft_cap) (0: none); out (L, H, Dv) contiguous; lse (L, H) or
// null. D and Dv multiples of the vector width W (Dv of 4W).
void prefill_attention_f32(const float* q, const float* k, const float* v, int64_t L, int64_t S, int64_t heads,
                           int64_t kv_heads, int64_t dim, int64_t value_dim, int64_t q_stride, int64_t k_stride,
                           int64_t v_stride, int64_t causal, const int64_t* counts, const int64_t* firsts,
                           float scale, float soft_cap, float* out, float* lse) {
  prefill(q, k, v, L, S, heads, kv_heads, dim, value_dim, q_stride, k_stride, v_stride, causal, counts, firsts,
          nullptr, scale, soft_cap, out, lse);
}

// The same over S rows of a quantized cache (row_bytes apart; K of head h at byte
// h * D, V at v_offset + h * Dv; code 0 int8, 1 float8_e4m3fn, 2 float8_e5m2; the
// scales as kv_codes.h's Scales, one per K or V head).
void prefill_attention_quant(const float* q, const uint8_t* rows, int64_t L, int64_t S, int64_t heads,
                             int64_t kv_heads, int64_t dim, int64_t value_dim, int64_t q_stride, int64_t row_bytes,
                             int64_t v_offset, int64_t causal, const int64_t* counts, const int64_t* firsts,
                             int64_t code, int64_t scale_offset, int64_t scale_head, int64_t scale_value, float scale,
                             float soft_cap, float* out, float* lse) {
  const Scales sc{scale_offset, scale_head, scale_value, dim};
  auto run = [&](auto* codes) {
    prefill(q, codes, codes + v_offset, L, S, heads, kv_heads, dim, value_dim, q_stride, row_bytes, row_bytes, causal,
            counts, firsts, &sc, scale, soft_cap, out, lse);
  };
  if (code == 0) run(reinterpret_cast<const int8_t*>(rows));
  if (code == 1) run(reinterpret_cast<const E4M3*>(rows));
  if (code == 2) run(reinterpret_cast<const E5M2*>(rows));
}

// Whether prefill_attention_f32 takes these widths (they depend on the vector width).
int prefill_attention_supports(int64_t dim, int64_t value_dim) { return dim % W == 0 && value_dim % TILE == 0; }
}
