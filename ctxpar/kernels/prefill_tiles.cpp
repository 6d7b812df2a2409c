// Prefill attention over bf16 queries, keys and values on CPUs with AMX-BF16: the
// float32 kernel's blocking and online softmax (prefill_attention.cpp,
// online_softmax.h), with both products on AMX's tiles instead of widened floats.
//
//   for each (KV head h, block of BQ queries)                 <- one task
//     Q block: BQ queries x g heads = M rows, bf16 as given    (M x D, 16-row groups)
//     for each block of BK keys that any query sees (none wholly before the windows):
//       S = Q · K^T            (TDPBF16PS over D in 32s)       M x BK float32
//       scores = S * scale * log2(e) [soft-capped], masked (future, window's past); online softmax
//       P = 2^(score - max) rounded to bf16; row sums of those P
//       O = O * rescale + P · V  (TDPBF16PS over BK in 32s)    M x Dv float32
//     out = O / row sums,  lse = (max + log2(row sums)) ln 2
//
// B tiles want pairs along the reduced dimension (VNNI): K as (S/32, D/2, 32, 2) (a
// tile's rows 128 bytes apart: rows a power of two kilobytes apart would share L1's
// sets) and V as (S/2, Dv, 2) per KV head, packed once per call, zero keys past S. A C element's
// sequence of instructions is fixed by D, BK and its block's position: its row's
// result depends on its query and the keys it sees only, whichever rows share its
// task or call (keys a row does not see weigh exactly 0).

#include <cstdint>

#include "bf16_tiles.h"

#ifdef CTXPAR_AMX_BF16

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "online_softmax.h"

namespace {

using widest::vec;
using widest::W;
constexpr int64_t T = bf16_tiles::T;  // 16: rows of a tile, pairs of a K step, columns of a C tile
constexpr int64_t BK = 128;           // keys per block: four K steps of P · V
constexpr int64_t KG = 2 * T;         // keys per packed group of K: a 2 x 2 block's columns
constexpr int64_t BQ = 32;            // queries per task: M = 32 g rows, whole pairs of 16

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Both products run as blocks of 2 x 2 C tiles (tiles 0-3: rows r, columns c at tile
// 2r + c), 32 rows by 32 columns, over the K steps in order; per step the A tiles of
// the two row groups (4, 5) and the B tiles of the two column groups (6, 7), as
// bf16_tiles.h configures them. Four independent chains keep the unit busy. The tile
// instructions name their registers as literals: one function per register.
template <int c>
inline void tile_zero() {
  if constexpr (c == 0) _tile_zero(0);
  if constexpr (c == 1) _tile_zero(1);
  if constexpr (c == 2) _tile_zero(2);
  if constexpr (c == 3) _tile_zero(3);
}
template <int c>
inline void tile_load(const float* p, int64_t stride) {
  if constexpr (c == 0) _tile_loadd(0, p, stride);
  if constexpr (c == 1) _tile_loadd(1, p, stride);
  if constexpr (c == 2) _tile_loadd(2, p, stride);
  if constexpr (c == 3) _tile_loadd(3, p, stride);
}
template <int c>
inline void tile_store(float* p, int64_t stride) {
  if constexpr (c == 0) _tile_stored(0, p, stride);
  if constexpr (c == 1) _tile_stored(1, p, stride);
  if constexpr (c == 2) _tile_stored(2, p, stride);
  if constexpr (c == 3) _tile_stored(3, p, stride);
}

// An operand of a 2 x 2 block: group 0's step t at base + t * step, group 1 `next`
// further (bf16 elements), rows `stride` bytes apart.
struct Operand {
  const uint16_t* base;
  int64_t next, step, stride;
};

// The C tiles of a block: C tile (r, c) at base + r * 16 * ld + c * 16 floats, rows ld
// floats apart.
struct Sums {
  float* base;
  int64_t ld;
  template <int t>
  float* at() const {
    return base + (t / 2) * T * ld + (t % 2) * T;
  }
};

// C (r, c) = (zero, or the sums there) + sum over K steps t < depth, in order, of
// A_r,t B_c,t; stored there.
template <bool accumulate>
inline void block_2x2(const Operand& a, const Operand& b, int64_t depth, const Sums& c) {
  if constexpr (accumulate) {
    tile_load<0>(c.at<0>(), c.ld * 4), tile_load<1>(c.at<1>(), c.ld * 4);
    tile_load<2>(c.at<2>(), c.ld * 4), tile_load<3>(c.at<3>(), c.ld * 4);
  } else {
    tile_zero<0>(), tile_zero<1>(), tile_zero<2>(), tile_zero<3>();
  }
  for (int64_t t = 0; t < depth; ++t) {
    _tile_loadd(4, a.base + t * a.step, a.stride);
    _tile_loadd(6, b.base + t * b.step, b.stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b.base + b.next + t * b.step, b.stride);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a.base + a.next + t * a.step, a.stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  tile_store<0>(c.at<0>(), c.ld * 4), tile_store<1>(c.at<1>(), c.ld * 4);
  tile_store<2>(c.at<2>(), c.ld * 4), tile_store<3>(c.at<3>(), c.ld * 4);
}

// The weights P · V multiplies: p rounded to bf16 (nearest even, as AVX-512 BF16
// converts; it reads denormals as 0, and none reach it: a weight is 0 or at least
// 2^-125) into pb, and returned as floats, for the row sums to add the same values.
inline vec weights_bf16(vec p, uint16_t* pb) {
  __m512 x;
  std::memcpy(&x, &p, sizeof x);
  const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb), bits);
  const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);
  std::memcpy(&p, &widened, sizeof p);
  return p;
}

template <bool with_counts>
void prefill_impl(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t L, int64_t S, int64_t heads,
                  int64_t kv_heads, int64_t dim, int64_t value_dim, int64_t q_stride, int64_t k_stride,
                  int64_t v_stride, int64_t causal, const int64_t* counts, const int64_t* firsts, float scale,
                  float soft_cap, float* out, float* lse) {
  const int64_t g = heads / kv_heads, offset = causal ? S - L : S - 1;
  auto seen_by = [&](int64_t i) {  // keys query i sees (padding rows: the last query's)
    if constexpr (with_counts) return counts[std::min(i, L - 1)];
    return offset + i + 1;
  };
  auto first_of = [&](int64_t i) { return firsts ? firsts[std::min(i, L - 1)] : int64_t(0); };  // a window's
  const float scale_log2 = scale * LOG2E;
  const int64_t S_pad = round_up(S, BK), M = BQ * g, M_vec = round_up(M, W), pairs = dim / 2;
  // (kv_heads, S_pad/32, D/2, 32, 2) and (kv_heads, S_pad/2, Dv, 2), zero past S.
  std::vector<uint16_t> kp(kv_heads * pairs * S_pad * 2), vp(kv_heads * S_pad * value_dim);
  const int64_t q_blocks = (L + BQ - 1) / BQ;

#pragma omp parallel
  {
#pragma omp for collapse(2)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t s0 = 0; s0 < S_pad; s0 += BK)
        for (int64_t s = s0; s < s0 + BK; s += 2)
          for (int64_t e = 0; e < 2; ++e) {
            const bool real = s + e < S;
            for (int64_t p = 0; p < pairs; ++p)
              for (int64_t i = 0; i < 2; ++i)
                kp[(((h * S_pad + s + e) / KG * pairs + p) * KG + (s + e) % KG) * 2 + i] =
                    real ? k[(s + e) * k_stride + h * dim + 2 * p + i] : 0;
            for (int64_t d = 0; d < value_dim; ++d)
              vp[((h * S_pad + s) / 2 * value_dim + d) * 2 + e] = real ? v[(s + e) * v_stride + h * value_dim + d] : 0;
          }

    bf16_tiles::configure();
    std::vector<uint16_t> qb(M * dim), pb(M * BK);
    std::vector<float> scores(M * BK), o(M * value_dim);
    std::vector<float> top(M_vec), totals(M * W), rescale(M_vec), block_top(M_vec, 0.0f);
    const online_softmax::Rows rows{top.data(), block_top.data(), rescale.data(), totals.data()};
    // Later query blocks see more keys: hand them out first, so the threads finish together.
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t nb = 0; nb < q_blocks; ++nb)
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t i0 = (q_blocks - 1 - nb) * BQ, n = std::min(BQ, L - i0);
        std::fill(qb.begin(), qb.end(), uint16_t(0));  // padding rows score 0 and are never written out
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < g; ++j)
            std::memcpy(qb.data() + (i * g + j) * dim, q + (i0 + i) * q_stride + (h * g + j) * dim, dim * 2);
        std::fill(o.begin(), o.end(), 0.0f);
        std::fill(top.begin(), top.end(), -INFINITY);
        std::fill(totals.begin(), totals.end(), 0.0f);

        int64_t last_pos = -1, first_pos = S;  // the task's queries see keys from, up to here
        for (int64_t i = 0; i < n; ++i) {
          last_pos = std::max(last_pos, seen_by(i0 + i) - 1);
          first_pos = std::min(first_pos, first_of(i0 + i));
        }
        const uint16_t* kh = kp.data() + h * pairs * S_pad * 2;
        const uint16_t* vh = vp.data() + h * S_pad * value_dim;
        for (int64_t s0 = first_pos / BK * BK; s0 <= std::min(last_pos, S - 1); s0 += BK) {
          const int64_t keys = std::min(BK, S - s0);
          for (int64_t m = 0; m < M; m += 2 * T)  // whole blocks: keys past S are zeros, masked below
            for (int64_t c = 0; c < BK; c += 2 * T)
              block_2x2<false>({qb.data() + m * dim, T * dim, 2 * T, dim * 2},
                               {kh + (s0 + c) * pairs * 2, T * 2, T * KG * 2, KG * 4}, pairs / T,
                               {scores.data() + m * BK + c, BK});
          auto seen = [&](int64_t m) { return std::min(keys, std::max<int64_t>(0, seen_by(i0 + m / g) - s0)); };
          auto first = [&](int64_t m) { return std::min(BK, std::max<int64_t>(0, first_of(i0 + m / g) - s0)); };
          auto emit = [&](int64_t m, int64_t s, vec p) { return weights_bf16(p, pb.data() + m * BK + s); };
          if (soft_cap > 0.0f) {  // capped in log2 units, then unscaled
            online_softmax::cap_scores(scores.data(), M, BK, scale_log2, soft_cap * LOG2E);
            online_softmax::block<true, false>(scores.data(), M, M_vec, BK, 1.0f, first, seen, rows, emit);
          } else {
            online_softmax::block<true, true>(scores.data(), M, M_vec, BK, scale_log2, first, seen, rows, emit);
          }
          for (int64_t m = 0; m < M; ++m)  // a rescale of exactly 1 (the maximum stands) changes no bit
            if (rescale[m] != 1.0f)
              for (int64_t d = 0; d < value_dim; d += W)
                storev(o.data() + m * value_dim + d, loadv<vec>(o.data() + m * value_dim + d) * rescale[m]);
          for (int64_t m = 0; m < M; m += 2 * T)
            for (int64_t c = 0; c < value_dim; c += 2 * T)
              block_2x2<true>({pb.data() + m * BK, T * BK, 2 * T, BK * 2},
                              {vh + (s0 / 2 * value_dim + c) * 2, T * 2, T * value_dim * 2, value_dim * 4},
                              BK / (2 * T), {o.data() + m * value_dim + c, value_dim});
        }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < g; ++j) {
            const int64_t m = i * g + j, row = (i0 + i) * heads + h * g + j;
            online_softmax::finish(o.data() + m * value_dim, value_dim, rows, m, out + row * value_dim,
                                   lse ? lse + row : nullptr);
          }
      }
    _tile_release();  // the thread's tile state back to init, as the next user expects
  }
}

}  // namespace

#endif

extern "C" {

// Whether prefill_attention_bf16 runs here with these widths: built for and granted
// AMX-BF16, D and Dv multiples of 32.
int prefill_attention_bf16_supports(int64_t dim, int64_t value_dim) {
#ifdef CTXPAR_AMX_BF16
  return bf16_tiles::ready() && dim > 0 && value_dim > 0 && dim % (2 * T) == 0 && value_dim % (2 * T) == 0;
#else
  (void)dim, (void)value_dim;
  return 0;
#endif
}

// prefill_attention_f32's contract (prefill_attention.cpp) over bf16 q, k and v (their
// bits as uint16); out and lse float32. Callers check prefill_attention_bf16_supports.
void prefill_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t L, int64_t S,
                            int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim, int64_t q_stride,
                            int64_t k_stride, int64_t v_stride, int64_t causal, const int64_t* counts,
                            const int64_t* firsts, float scale, float soft_cap, float* out, float* lse) {
#ifdef CTXPAR_AMX_BF16
  if (!bf16_tiles::ready()) return;  // callers checked prefill_attention_bf16_supports: not reached
  auto run = counts ? prefill_impl<true> : prefill_impl<false>;
  run(q, k, v, L, S, heads, kv_heads, dim, value_dim, q_stride, k_stride, v_stride, causal, counts, firsts, scale,
      soft_cap, out, lse);
#else
  (void)q, (void)k, (void)v, (void)L, (void)S, (void)heads, (void)kv_heads, (void)dim, (void)value_dim;
  (void)q_stride, (void)k_stride, (void)v_stride, (void)causal, (void)counts, (void)firsts, (void)scale;
  (void)soft_cap, (void)out, (void)lse;
#endif
}
}
