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
//       online softmax: row max, rescale, p = 2^(score - max), scores in log2 units
//       O += P · V              M x Dv  (V rows read in place)
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

#include "kv_codes.h"
#include "online_softmax.h"
#include "vec.h"

namespace {

using widest::vec;  // AVX-512: 32 registers of 16 floats, tiles of 6 x 4 vectors (24 accumulators);
using widest::W;    // else 16 registers of 8 floats, tiles of 3 x 4 vectors (12 accumulators)
constexpr int64_t ROWS = W == 16 ? 6 : 3;
constexpr int64_t TILE = 4 * W;  // columns of a tile
// Chosen by measurement (2 threads, AVX-512, 9/3 heads of 64, 2048 queries
// after 0 and 4096 keys): 6-row tiles beat 4-row ones by 1.2x; BK 128 and
// BQ 16 or 64 were within noise of these.
constexpr int64_t BK = 64;  // keys per block (a multiple of TILE)
constexpr int64_t BQ = 32;  // queries per task

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

// Keys [s0, s0 + keys) of KV head h of a quantized cache, dequantized: K^T into
// kt (dim x BK, padding keys 0) and V into vb (keys x value_dim). k: the rows
// (k_stride bytes apart, K of head h at h * dim, scales as `sc`), v = k + V's offset.
template <typename T>
void dequantize_block(const T* k, const T* v, int64_t k_stride, int64_t s0, int64_t keys, int64_t h, int64_t dim,
                      int64_t value_dim, const Scales& sc, float* kt, float* vb) {
  for (int64_t s = 0; s < BK; ++s) {
    if (s >= keys) {
      for (int64_t d = 0; d < dim; ++d) kt[d * BK + s] = 0.0f;
      continue;
    }
    const T* row = k + (s0 + s) * k_stride;
    const float ks = scale_at(row, sc, h * sc.head), vs = scale_at(row, sc, sc.value + h * sc.head);
    for (int64_t d = 0; d < dim; d += 8) {
      const v8 x = load8(row + h * dim + d) * ks;
      for (int i = 0; i < 8; ++i) kt[(d + i) * BK + s] = x[i];
    }
    for (int64_t d = 0; d < value_dim; d += 8) {
      const v8 x = load8(v + (s0 + s) * k_stride + h * value_dim + d) * vs;
      std::memcpy(vb + s * value_dim + d, &x, sizeof x);
    }
  }
}

// T float, or a quantized cache's codes with its scales `sc` (null for float):
// prefill_attention_f32 / prefill_attention_quant below.
// with_counts and variant (a window or a soft cap) template arguments: the causal path's loops
// compile as they did before counts and variants existed (a run-time test of them there changed
// how the compiler contracted its float steps, and so a quantized cache's bits).
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
  const int64_t S_pad = round_up(S, BK), M = round_up(BQ * g, ROWS), M_vec = round_up(M, W);
  // Float keys: K^T per KV head, zero-padded to whole blocks, packed once per call:
  // (kv_heads, dim, S_pad). Quantized keys are dequantized block by block instead.
  std::vector<float> kt(quantized ? 0 : kv_heads * dim * S_pad, 0.0f);
  const int64_t q_blocks = (L + BQ - 1) / BQ;

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
        const int64_t i0 = (q_blocks - 1 - nb) * BQ, n = std::min(BQ, L - i0);
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
          online_softmax::block<with_counts || variant, false>(scores.data(), M, M_vec, BK, 1.0f, first, seen, rows,
                                             [&](int64_t m, int64_t s, vec p) {
                                               storev(scores.data() + m * BK + s, p);
                                               return p;
                                             });
          for (int64_t m = 0; m < M; m += ROWS)
            for (int64_t c = 0; c < value_dim; c += TILE)
              tile_product(scores.data() + m * BK, BK, [&](int64_t s) { return v_rows[s] + c; }, keys,
                           rescale.data() + m, o.data() + m * value_dim + c, value_dim);  // O rescaled as loaded
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
