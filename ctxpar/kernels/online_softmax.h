// Flash attention's online softmax over one block of keys, for the prefill kernels
// (prefill_attention.cpp: float32 products; prefill_tiles.cpp: AMX-BF16 products).
// Each step works row by row in a fixed order, so a query's bits depend on its own
// scores only, never on the rows beside it in the task.
//
//   scores (M x BK, log2 units)  --mask, row maxima-->  block_top
//   top, block_top               --new maxima-->        top, rescale (exactly 1 where
//                                                        the maximum stands)
//   scores - top                 --2^t, row sums-->     p (emitted), totals
//
// Rows are padded to whole vectors (extra rows' block maxima stay 0: finite). Row
// sums stay W partial sums per row until the end (no horizontal add per block).
//
// A sliding window hides a row's keys before its first one too (``first``): a block
// the row sees nothing of, before or after its keys, weighs exactly 0 for it (with
// zero_unseen), so a kernel may skip such blocks or not, and a row's bits do not
// depend on which rows share its task. A soft-capped logit (Gemma 2) passes through
// cap · tanh(logit / cap) before any of it (``soft_cap``).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace online_softmax {

using widest::vec;
using widest::veci;
using widest::W;

// Per-row state of a task: M rows, M_vec = M rounded up to whole vectors.
struct Rows {
  float* top;        // (M_vec) running maxima
  float* block_top;  // (M_vec) this block's maxima
  float* rescale;    // (M_vec) what this block multiplies the older sums by
  float* totals;     // (M, W) partial row sums
};

// One block: row m of `scores` (BK apart) sees keys [first(m), seen(m)) of the block
// (the rest, and keys past `keys`, are masked). The scores are in log2 units times 1 / scale
// where `scaled` (else scale is 1): a score is x * scale, and a row's maximum
// max(x) * scale, the same float as max(x * scale) since rounding is monotonic.
// zero_unseen: a key the row does not see weighs
// exactly 0, not 2^-125, so that keys only other rows see (or that a shorter key
// tensor lacks) change no bit of this row. emit(m, s, p) takes the weights of W keys
// [s, s + W) of row m and returns what the row's sum adds (the weights as the
// products will use them).
// A row may see no key of the block, or none yet (a window's first blocks): its
// running max stays -inf, and with zero_unseen its weights 0 (never 2^(-inf - -inf)).
template <bool zero_unseen, bool scaled, typename First, typename Seen, typename Emit>
inline void block(float* scores, int64_t M, int64_t M_vec, int64_t BK, float scale, First first, Seen seen,
                  const Rows& rs, Emit emit) {
  for (int64_t m = 0; m < M; ++m) {  // mask the future (and padding keys), the window's past, row maxima
    float* row = scores + m * BK;
    for (int64_t s = 0; s < first(m); ++s) row[s] = -INFINITY;
    for (int64_t s = seen(m); s < BK; ++s) row[s] = -INFINITY;
    vec tops = loadv<vec>(row);
    for (int64_t s = W; s < BK; s += W) tops = tops < loadv<vec>(row + s) ? loadv<vec>(row + s) : tops;
    rs.block_top[m] = scaled ? hmax(tops) * scale : hmax(tops);
  }
  // Without a window every row sees key 0, so after the first block its running max is
  // finite; with one, a row whose max is still -inf keeps rescale 1 (old == new).
  for (int64_t m = 0; m < M_vec; m += W) {  // new maxima and rescales, W rows at a time
    const vec old_top = loadv<vec>(rs.top + m), bt = loadv<vec>(rs.block_top + m);
    const vec new_top = old_top < bt ? bt : old_top;
    // 0 on the first block; exactly 1 where the maximum stands (the polynomial's 2^0 is
    // 1 + 1.2e-7), so a block no query of the row sees changes nothing: a query's
    // output is the same bits whichever queries share its task (PCP's chunks).
    const vec r = exp2_nonpositive<vec, veci>(old_top - new_top);
    storev(rs.rescale + m, old_top == new_top ? vec{} + 1.0f : r);
    storev(rs.top + m, new_top);
  }
  for (int64_t m = 0; m < M; ++m) {  // p = 2^(score - max), row sums
    float* row = scores + m * BK;
    vec sum = loadv<vec>(rs.totals + m * W) * rs.rescale[m];
    for (int64_t s = 0; s < BK; s += W) {
      const vec x = scaled ? loadv<vec>(row + s) * scale : loadv<vec>(row + s);
      vec p = exp2_nonpositive<vec, veci>(x - rs.top[m]);
      if constexpr (zero_unseen) p = x == vec{} - INFINITY ? vec{} : p;
      sum += emit(m, s, p);
    }
    storev(rs.totals + m * W, sum);
  }
}

// Row m's output: its weighted sum o (value_dim) over its total, into dst; its
// log-sum-exp (natural log) into *lse if not null. A row that saw no key (a shard
// holding none of a query's window) gets out 0 and lse -inf, which weighs nothing in
// a merge.
inline void finish(const float* o, int64_t value_dim, const Rows& rs, int64_t m, float* dst, float* lse) {
  const float total = hsum(loadv<vec>(rs.totals + m * W));
  if (total == 0.0f) {
    std::fill(dst, dst + value_dim, 0.0f);
    if (lse) *lse = -INFINITY;
    return;
  }
  for (int64_t d = 0; d < value_dim; ++d) dst[d] = o[d] / total;
  if (lse) *lse = (rs.top[m] + std::log2(total)) * LN2;
}

// cap · tanh(x / cap) of each lane, for a soft-capped logit x (finite: the kernels
// mask after capping): tanh(y) = sign(y) (1 - e) / (1 + e) with e = 2^(-2 |y| log2 e) <= 1, which
// exp2_nonpositive gives to ~2.4e-7, so the capped logit is within ~cap · 3e-7.
template <typename V, typename VI>
inline V soft_capped(V x, float cap) {
  const V y = x * (1.0f / cap), a = y < 0 ? -y : y;
  const V e = exp2_nonpositive<V, VI>(a * (-2.0f * LOG2E));
  const V t = (1.0f - e) / (1.0f + e);
  return (y < 0 ? -t : t) * cap;
}

// Scores (M rows of BK) times `pre`, soft-capped at `cap` (in the scores' units).
inline void cap_scores(float* scores, int64_t M, int64_t BK, float pre, float cap) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t s = 0; s < BK; s += W) {
      float* p = scores + m * BK + s;
      storev(p, soft_capped<vec, veci>(loadv<vec>(p) * pre, cap));
    }
}

}  // namespace online_softmax
