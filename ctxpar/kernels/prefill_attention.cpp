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
// dequantized as it is reached, K^T into a (D x BK) tile and V into (BK x Dv)
// rows: the context is never dequantized whole. A block is converted once per
// task, one conversion per value against the M rows' multiply-adds with it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "kv_codes.h"
#include "online_softmax.h"
#include "vec.h"

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
  for (int64_t d = 0; d < depth; ++d) {
    const float* bd_row = b(d);
    vec bd[4];
    for (int i = 0; i < 4; ++i) bd[i] = loadv<vec>(bd_row + i * W);
    for (int64_t r = 0; r < ROWS; ++r) {
      const float ar = a[r * lda + d];  // broadcast by the vector product
      for (int i = 0; i < 4; ++i) acc[r][i] += ar * bd[i];
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

// Keys [s0, s0 + keys) of KV head h of a quantized cache, dequantized: K^T into
// kt (dim x BK, padding keys 0) and V into vb (keys x value_dim). k: the rows
// (k_stride bytes apart, K of head h at h * dim, scales as `sc`), v = k + V's offset.
// K goes W keys by W dims at a time: dequantized a key a row, then transposed in
// registers (a scalar store per value cost more than the products it feeds).
template <typename T>
void dequantize_block(const T* k, const T* v, int64_t k_stride, int64_t s0, int64_t keys, int64_t h, int64_t dim,
                      int64_t value_dim, const Scales& sc, float* kt, float* vb) {
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
  for (int64_t s = 0; s < keys; ++s) {
    const T* row = k + (s0 + s) * k_stride;
    const float vs = scale_at(row, sc, sc.value + h * sc.head);
    for (int64_t d = 0; d < value_dim; d += 8) {
      const v8 x = load8(v + (s0 + s) * k_stride + h * value_dim + d) * vs;
      std::memcpy(vb + s * value_dim + d, &x, sizeof x);
    }
  }
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
  constexpr bool quantized = sizeof(T) == 1;
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

    std::vector<float> qb(M * dim), scores(M * BK), o(M * value_dim);
    std::vector<float> top(M_vec), totals(M * W), rescale(M_vec), block_top(M_vec, 0.0f);
    const online_softmax::Rows rows{top.data(), block_top.data(), rescale.data(), totals.data()};
    std::vector<const float*> v_rows(BK);
    std::vector<float> kt_block(quantized ? dim * BK : 0), v_block(quantized ? BK * value_dim : 0);
    // Later query blocks see more keys: hand them out first, so the threads finish together.
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t nb = 0; nb < q_blocks; ++nb)
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t i0 = (q_blocks - 1 - nb) * bq, n = std::min(bq, L - i0);
        std::fill(qb.begin(), qb.end(), 0.0f);  // padding rows score 0 and are never written out
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < g; ++j)
            for (int64_t d = 0; d < dim; ++d)
              qb[(i * g + j) * dim + d] = q[(i0 + i) * q_stride + (h * g + j) * dim + d] * scale_log2;
        std::fill(o.begin(), o.end(), 0.0f);
        std::fill(top.begin(), top.end(), -INFINITY);
        std::fill(totals.begin(), totals.end(), 0.0f);

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
            dequantize_block(k, v, k_stride, s0, keys, h, dim, value_dim, *sc, kt_block.data(), v_block.data());
            kt_s0 = kt_block.data(), kt_ld = BK;
            for (int64_t s = 0; s < keys; ++s) v_rows[s] = v_block.data() + s * value_dim;
          } else {
            for (int64_t s = 0; s < keys; ++s) v_rows[s] = v + (s0 + s) * v_stride + h * value_dim;
          }
          for (int64_t m = 0; m < M; m += ROWS)
            for (int64_t c = 0; c < BK; c += TILE)
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
                                               storev(scores.data() + m * BK + s, p);
                                               return p;
                                             });
          // P · V over the keys some row of the tile sees: past them every weight is exactly 0.
          for (int64_t m = 0; m < M; m += ROWS) {
            int64_t depth = 0;
            for (int64_t r = 0; r < ROWS; ++r) depth = std::max(depth, seen(m + r));
            for (int64_t c = 0; c < value_dim; c += TILE)
              tile_product(scores.data() + m * BK, BK, [&](int64_t s) { return v_rows[s] + c; }, depth,
                           rescale.data() + m, o.data() + m * value_dim + c, value_dim);  // O rescaled as loaded
          }
        }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < g; ++j) {
            const int64_t m = i * g + j, row = (i0 + i) * heads + h * g + j;
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
