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
// the run in one task, so one long row still keeps every thread busy and a
// task reads its keys' cache rows whole and in order (prefetched ahead); each
// task leaves a partial (out, lse) per query head and a second pass merges a
// row's runs exactly by log-sum-exp.
//
// A decode step is bound by the bytes it reads and, once those are in cache,
// by converting and multiplying them, so the inner loops are register-blocked
// over the G query heads that share a KV head (GQA's group): eight keys are
// converted to floats once per vector of eight of their values and multiplied
// into G x 8 accumulators (scores), and a value vector once into G x 8 output
// accumulators (weighted values), instead of once per query head. A quantized
// cache's codes (kv_codes.h) are read as they are: a key's scale multiplies its
// eight-key block of dot products, a value's scale is folded into its softmax
// weight. Where the group is large (MLA: every query head shares the one
// latent key), a run of keys is dequantized once into floats instead.
//
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
#include <type_traits>
#include <vector>

#include "kv_codes.h"
#include "online_softmax.h"
#include "vec.h"

namespace {

constexpr int64_t CHUNK = 256;  // keys per task, at most (a multiple of 8)
// A row shorter than MIN_TASKS runs of CHUNK keys is cut into MIN_TASKS runs of at least
// MIN_RUN keys: a decode step's short rows would otherwise be one task each, read
// from memory by one core while the others wait. The cut depends on the row's length
// only (never on the threads), so a row has the same bits on every rank.
constexpr int64_t MIN_TASKS = 4, MIN_RUN = 32;

inline int64_t run_keys(int64_t keys) {
  const int64_t even = (keys + MIN_TASKS - 1) / MIN_TASKS;
  return std::clamp((even + 7) / 8 * 8, MIN_RUN, CHUNK);
}
// Query heads blocked per pass over the keys: 3 x 8 accumulators fit AVX-512's 32
// vector registers; with 16 (AVX2) one head a pass keeps them out of memory.
#if defined(__AVX512VL__)
constexpr int G_MAX = 3;
#else
constexpr int G_MAX = 1;
#endif
constexpr int64_t PREFETCH = 16;  // keys ahead whose cache rows are prefetched

// Eight vectors -> one vector of their horizontal sums (a transposing add tree).
inline v8 reduce8(const v8* a) {
  v8 t[4], u[2];
  for (int i = 0; i < 4; ++i)
    t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// Dot products of G query heads (rows of q, `stride` apart, scaled) with eight keys over
// their values [c0, c1): out[j] = the eight keys' sums for head j.
template <int G, typename T>
inline void dots(const float* q, int64_t stride, const T* const* k, int64_t c0, int64_t c1, v8* out) {
  v8 acc[G][8] = {};
  for (int64_t c = c0; c < c1; c += 8)
    for (int i = 0; i < 8; ++i) {
      const v8 kc = load8(k[i] + c);  // converted once for the G heads
      for (int j = 0; j < G; ++j) acc[j][i] += load8(q + j * stride + c) * kc;
    }
  for (int j = 0; j < G; ++j) out[j] = reduce8(acc[j]);
}

// out_j[0, 8W) += sum_s w_j[s] * v[s][c, c + 8W) for G heads, the G x W accumulators in registers.
template <int G, int W, typename T>
inline void weighted_values(const float* w, int64_t w_stride, const T* const* v, int64_t n, int64_t c, float* out,
                            int64_t out_stride) {
  v8 acc[G][W] = {};
  for (int64_t s = 0; s < n; ++s)
    for (int i = 0; i < W; ++i) {
      const v8 vc = load8(v[s] + c + 8 * i);
      for (int j = 0; j < G; ++j) acc[j][i] += w[j * w_stride + s] * vc;
    }
  for (int j = 0; j < G; ++j) std::memcpy(out + j * out_stride, acc[j], sizeof acc[j]);
}

// Widths of up to 64 values a pass, in 8-value steps (W <= 8 / G keeps G x W registers).
template <int G, typename T>
void weighted_values_any(const float* w, int64_t w_stride, const T* const* v, int64_t n, int64_t value_dim,
                         float* out, int64_t out_stride) {
  constexpr int W = G == 1 ? 8 : 4;
  int64_t c = 0;
  for (; c + 8 * W <= value_dim; c += 8 * W)
    weighted_values<G, W>(w, w_stride, v, n, c, out + c, out_stride);
  for (; c < value_dim; c += 8) weighted_values<G, 1>(w, w_stride, v, n, c, out + c, out_stride);
}

// Calls f(std::integral_constant<int, G>{}) for a block of G = 1, 2 or 3 query heads
// (the blocked loops' G must be a constant for their accumulators to be registers).
template <typename F>
inline void with_group(int64_t G, F&& f) {
  if (G == 3)
    f(std::integral_constant<int, 3>{});
  else if (G == 2)
    f(std::integral_constant<int, 2>{});
  else
    f(std::integral_constant<int, 1>{});
}

struct Task {
  int64_t row, first, last;  // keys [first, last) of the row's slots
};

// Keys [first, first + n8) of `slots` of one KV head of a quantized cache, dequantized
// (codes times their scales) into kd (n8 x dim) and, unless the value is the key's
// start under the same scale (MLA's latent), vd (n8 x value_dim); keys and values
// point at each key's and value's floats. Padding past n repeats key n - 1.
template <typename T>
void dequantize_task(const T* cache, const int64_t* slots, int64_t n, int64_t n8, int64_t head, int64_t dim,
                     int64_t value_dim, int64_t slot_stride, int64_t head_stride, int64_t v_offset, const Scales& sc,
                     float* kd, float* vd, const float** keys, const float** values) {
  const bool shared = v_offset == 0 && sc.value == 0 && value_dim <= sc.split;
  for (int64_t s = 0; s < n8; ++s) {
    const T* row = cache + slots[std::min(s, n - 1)] * slot_stride;
    const T* key = row + head * head_stride;
    const int64_t i = head * sc.head;
    const float k0 = scale_at(row, sc, i), k1 = sc.split < dim ? scale_at(row, sc, i + 1) : 0.0f;
    float* ks = kd + s * dim;
    for (int64_t c = 0; c < dim; c += 8) storev(ks + c, load8(key + c) * (c < sc.split ? k0 : k1));
    keys[s] = ks;
    if (shared) {
      values[s] = ks;
      continue;
    }
    float* vs = vd + s * value_dim;
    const float v0 = scale_at(row, sc, sc.value + i);
    for (int64_t c = 0; c < value_dim; c += 8) storev(vs + c, load8(key + v_offset + c) * v0);
    values[s] = vs;
  }
}

// One KV head's g query heads over n keys (n8: n rounded up to 8, the padding
// pointing at key n - 1): q (g x dim, scaled to log2 units), keys/values pointers
// to T. sk/sk2/sv: per key, the scales of the key's values [0, split) and
// [split, dim) and of its value (null: unscaled). cap > 0: scores soft-capped at cap
// (log2 units). Leaves out (g x value_dim) and lse (g) for the run; scores and weights
// are g x CHUNK scratch, tops g.
template <typename T>
void heads_over(const float* q, int64_t g, int64_t dim, int64_t value_dim, int64_t split, const T* const* keys,
                const T* const* values, const float* sk, const float* sk2, const float* sv, int64_t n, int64_t n8,
                float cap, float* scores, float* weights, float* tops, float* out, float* lse) {
  for (int64_t j0 = 0; j0 < g; j0 += G_MAX) {
    const int64_t G = std::min<int64_t>(G_MAX, g - j0);
    for (int64_t s = 0; s < n8; s += 8) {
      v8 d[G_MAX], d2[G_MAX];
      with_group(G, [&](auto group) {
        dots<group.value>(q + j0 * dim, dim, keys + s, 0, split, d);
        if (split < dim) dots<group.value>(q + j0 * dim, dim, keys + s, split, dim, d2);
      });
      for (int64_t j = 0; j < G; ++j) {
        v8 sc = d[j];
        if (sk) sc *= load8(sk + s);
        if (split < dim) sc += sk2 ? d2[j] * load8(sk2 + s) : d2[j];
        storev(scores + (j0 + j) * CHUNK + s, sc);
      }
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * CHUNK;
    if (cap > 0.0f)
      for (int64_t s = 0; s < n8; s += 8) storev(sj + s, online_softmax::soft_capped<v8, v8i>(load8(sj + s), cap));
    for (int64_t s = n; s < n8; ++s) sj[s] = -INFINITY;  // padding: weight exp(-inf) = 0
    v8 top8 = load8(sj);
    for (int64_t s = 8; s < n8; s += 8) top8 = top8 < load8(sj + s) ? load8(sj + s) : top8;
    const float top = tops[j] = hmax(top8);
    v8 total8 = {};
    float* wj = weights + j * CHUNK;
    for (int64_t s = 0; s < n8; s += 8) {
      const v8 e = exp2_nonpositive<v8, v8i>(load8(sj + s) - top);
      total8 += e;
      storev(wj + s, sv ? e * load8(sv + s) : e);  // a value's scale rides on its weight
    }
    lse[j] = hsum(total8);  // the softmax's sum for now, its log below
  }
  for (int64_t j0 = 0; j0 < g; j0 += G_MAX) {
    const int64_t G = std::min<int64_t>(G_MAX, g - j0);
    with_group(G, [&](auto group) {
      weighted_values_any<group.value>(weights + j0 * CHUNK, CHUNK, values, n, value_dim, out + j0 * value_dim,
                                       value_dim);
    });
  }
  for (int64_t j = 0; j < g; ++j) {
    const float total = lse[j];
    for (int64_t i = 0; i < value_dim; ++i) out[j * value_dim + i] /= total;
    lse[j] = (tops[j] + std::log2(total)) * LN2;
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
  // A large group converts each code g / G_MAX times in place: dequantize the run once instead.
  const bool dequantize = quantized && g > 2 * G_MAX;
  const int64_t split = quantized && !dequantize ? std::min(sc->split, dim) : dim;
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
    // Scratch kept per thread between calls: a decode step makes one call a layer, and
    // a dozen fresh allocations each would cost more than a short row's attention.
    static thread_local std::vector<float> qs, scores, weights, tops, sk, sk2, sv, kd, vd;
    static thread_local std::vector<const T*> keys, values;
    static thread_local std::vector<const float*> fkeys, fvalues;
    auto at_least = [](auto& v, int64_t size) {
      if (int64_t(v.size()) < size) v.resize(size);
    };
    at_least(qs, heads * dim);
    for (auto* v : {&scores, &weights}) at_least(*v, g * CHUNK);
    for (auto* v : {&sk, &sk2, &sv}) at_least(*v, CHUNK);
    at_least(tops, g);
    at_least(keys, CHUNK);
    at_least(values, CHUNK);
    if (dequantize) {  // a run's dequantized keys and values (MLA's 256 x 576 floats)
      at_least(kd, CHUNK * dim);
      at_least(vd, CHUNK * value_dim);
      at_least(fkeys, CHUNK);
      at_least(fvalues, CHUNK);
    }
    const int64_t row_bytes = slot_stride * int64_t(sizeof(T));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tasks; ++t) {
      const Task& task = tasks[t];
      const int64_t n = task.last - task.first, n8 = (n + 7) / 8 * 8;
      const int64_t* ts = slots + task.first;
      const float* qt = q + task.row * heads * dim;
      for (int64_t i = 0; i < heads * dim; ++i) qs[i] = qt[i] * (scale * LOG2E);  // scores in log2 units (vec.h)
      for (int64_t h = 0; h < kv_heads; ++h) {
        float* o = part_out.data() + (t * heads + h * g) * value_dim;
        float* l = part_lse.data() + t * heads + h * g;
        const float* qh = qs.data() + h * g * dim;
        if (dequantize) {
          dequantize_task(cache, ts, n, n8, h, dim, value_dim, slot_stride, head_stride, v_offset, *sc, kd.data(),
                          vd.data(), fkeys.data(), fvalues.data());
          heads_over(qh, g, dim, value_dim, dim, fkeys.data(), fvalues.data(), nullptr, nullptr, nullptr, n, n8, cap,
                     scores.data(), weights.data(), tops.data(), o, l);
          continue;
        }
        for (int64_t s = 0; s < n8; ++s) {  // padding up to a multiple of 8 reads the last key again
          const T* row = cache + ts[std::min(s, n - 1)] * slot_stride;
          if (h == 0 && s + PREFETCH < n) {  // the whole row: every KV head's key and value, and the scales
            const char* ahead = reinterpret_cast<const char*>(cache + ts[s + PREFETCH] * slot_stride);
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b);
          }
          keys[s] = row + h * head_stride;
          values[s] = keys[s] + v_offset;
          if constexpr (quantized) {
            sk[s] = scale_at(row, *sc, h * sc->head);
            if (split < dim) sk2[s] = scale_at(row, *sc, h * sc->head + 1);
            sv[s] = scale_at(row, *sc, sc->value + h * sc->head);
          }
        }
        heads_over(qh, g, dim, value_dim, split, keys.data(), values.data(), quantized ? sk.data() : nullptr,
                   quantized ? sk2.data() : nullptr, quantized ? sv.data() : nullptr, n, n8, cap, scores.data(),
                   weights.data(), tops.data(), o, l);
      }
    }

    // Merge each row's runs per query head: out = sum_c exp(lse_c - L) out_c, L = logsumexp_c lse_c.
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
