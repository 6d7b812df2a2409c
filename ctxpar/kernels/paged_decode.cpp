// One-query attention of many rows over a paged cache, read in place.
//
// Built on first use by ctxpar/kernels/__init__.py (g++ -O3 -march=native
// -fopenmp, no PyTorch headers) and called through ctypes with raw pointers.
// It replaces, for decode rows, the PyTorch path of gathering each row's
// context out of the cache and then calling a kernel: here each key and value
// is read once, straight from its cache slot.
//
// Inner loops work on eight floats at a time (vec.h): eight keys' dot products
// reduce together, the softmax weights are 2^t polynomials (vec.h), and a
// value block's accumulators stay in registers over the keys.
//
// Work is cut into tasks of (row, KV head, run of at most CHUNK keys) so that
// one long row still keeps every thread busy; each task leaves a partial
// (out, lse) and a second pass merges a row's runs exactly by log-sum-exp.
//
// The cache is addressed by strides, so one kernel serves
//   GQA  (num_slots, 2, Hk, D):  slot_stride 2*Hk*D, head_stride D, v_offset Hk*D
//   MLA  (num_slots, E) latents: slot_stride E, head_stride 0, v_offset 0
//        (Hk = 1; the value is the first Dv entries of the key)
// and a quantized cache's rows of 1-byte codes and float32 scales (kv_codes.h),
// each task's run of keys dequantized once, in the kernel, into floats in cache.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kv_codes.h"
#include "vec.h"

namespace {

constexpr int64_t CHUNK = 256;  // keys per task (a multiple of 8)

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

// One query head (dim floats, scaled) against eight keys -> their eight scores.
template <typename T>
inline v8 dot8(const float* q, const T* const* k, int64_t dim) {
  v8 acc[8] = {};
  for (int64_t c = 0; c < dim; c += 8) {
    const v8 qc = load8(q + c);
    for (int i = 0; i < 8; ++i) acc[i] += qc * load8(k[i] + c);
  }
  return reduce8(acc);
}

// out[0, 8W) = sum_s p[s] * v[s][c, c + 8W), the W accumulators in registers.
template <int W, typename T>
inline void weighted_values(const float* p, const T* const* v, int64_t n, int64_t c, float* out) {
  v8 acc[W] = {};
  for (int64_t s = 0; s < n; ++s) {
    const float ps = p[s];  // broadcast by the vector product
    for (int i = 0; i < W; ++i) acc[i] += ps * load8(v[s] + c + 8 * i);
  }
  std::memcpy(out, acc, sizeof acc);
}

template <typename T>
void weighted_values_any(const float* p, const T* const* v, int64_t n, int64_t c, int64_t width, float* out) {
  switch (width / 8) {  // width: a multiple of 8, at most 64
    case 1: return weighted_values<1>(p, v, n, c, out);
    case 2: return weighted_values<2>(p, v, n, c, out);
    case 3: return weighted_values<3>(p, v, n, c, out);
    case 4: return weighted_values<4>(p, v, n, c, out);
    case 5: return weighted_values<5>(p, v, n, c, out);
    case 6: return weighted_values<6>(p, v, n, c, out);
    case 7: return weighted_values<7>(p, v, n, c, out);
    default: return weighted_values<8>(p, v, n, c, out);
  }
}

struct Task {
  int64_t row, head, first, last;  // keys [first, last) of the row's slots
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

// T: float, bfloat16 (uint16_t) or a quantized cache's codes, whose scales `sc` says
// where to find (null otherwise). A quantized task's keys and values are dequantized
// once into floats (a run of at most CHUNK keys, in L2) for its g query heads,
// instead of converting each code g times.
template <typename T>
void attend(const float* q, const T* cache, const int64_t* slots, const int64_t* starts, int64_t rows,
            int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim, int64_t slot_stride,
            int64_t head_stride, int64_t v_offset, const Scales* sc, float scale, float* out, float* lse) {
  constexpr bool quantized = sizeof(T) == 1;
  const int64_t g = heads / kv_heads;  // query heads per KV head
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(rows * kv_heads + 1);
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t h = 0; h < kv_heads; ++h) {
      first_task[b * kv_heads + h] = int64_t(tasks.size());
      for (int64_t s = starts[b]; s < starts[b + 1]; s += CHUNK)
        tasks.push_back({b, h, s, std::min(s + CHUNK, starts[b + 1])});
    }
  first_task[rows * kv_heads] = int64_t(tasks.size());
  const int64_t n_tasks = int64_t(tasks.size());
  std::vector<float> part_out(n_tasks * g * value_dim), part_lse(n_tasks * g);

#pragma omp parallel
  {
    std::vector<float> qs(g * dim), scores(g * CHUNK);
    std::vector<const T*> keys(CHUNK), values(CHUNK);
    std::vector<const float*> fkeys(quantized ? CHUNK : 0), fvalues(quantized ? CHUNK : 0);
    // Dequantized keys and values of a task: kept per thread between calls (MLA's
    // 256 x 576 floats would otherwise be a fresh mapping, page faults and all, per call).
    static thread_local std::vector<float> kd, vd;
    if (quantized && kd.size() < size_t(CHUNK * dim)) kd.resize(CHUNK * dim);
    if (quantized && vd.size() < size_t(CHUNK * value_dim)) vd.resize(CHUNK * value_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n_tasks; ++t) {
      const Task& task = tasks[t];
      const int64_t n = task.last - task.first, n8 = (n + 7) / 8 * 8;
      const float* qt = q + (task.row * heads + task.head * g) * dim;
      for (int64_t i = 0; i < g * dim; ++i) qs[i] = qt[i] * (scale * LOG2E);  // scores in log2 units (vec.h)
      float* o = part_out.data() + t * g * value_dim;
      // The task's g query heads over its keys and values (pointers to T, or to floats).
      auto heads_over = [&](const auto* const* key, const auto* const* value) {
        for (int64_t j = 0; j < g; ++j) {
          float* sj = scores.data() + j * CHUNK;
          for (int64_t s = 0; s < n8; s += 8) {
            const v8 sc8 = dot8(qs.data() + j * dim, key + s, dim);
            std::memcpy(sj + s, &sc8, sizeof sc8);
          }
          for (int64_t s = n; s < n8; ++s) sj[s] = -INFINITY;  // padding: weight exp(-inf) = 0
          v8 top8 = load8(sj);
          for (int64_t s = 8; s < n8; s += 8) top8 = top8 < load8(sj + s) ? load8(sj + s) : top8;
          float top = top8[0];
          for (int i = 1; i < 8; ++i) top = std::max(top, top8[i]);
          v8 total8 = {};
          for (int64_t s = 0; s < n8; s += 8) {
            const v8 e = exp2_nonpositive<v8, v8i>(load8(sj + s) - top);
            std::memcpy(sj + s, &e, sizeof e);
            total8 += e;
          }
          const float total = ((total8[0] + total8[4]) + (total8[1] + total8[5])) +
                              ((total8[2] + total8[6]) + (total8[3] + total8[7]));
          part_lse[t * g + j] = (top + std::log2(total)) * LN2;
          float* oj = o + j * value_dim;
          for (int64_t c = 0; c < value_dim; c += 64)  // 64 values at a time, in registers
            weighted_values_any(sj, value, n, c, std::min<int64_t>(64, value_dim - c), oj + c);
          for (int64_t i = 0; i < value_dim; ++i) oj[i] /= total;
        }
      };
      if constexpr (quantized) {
        dequantize_task(cache, slots + task.first, n, n8, task.head, dim, value_dim, slot_stride, head_stride,
                        v_offset, *sc, kd.data(), vd.data(), fkeys.data(), fvalues.data());
        heads_over(fkeys.data(), fvalues.data());
      } else {
        for (int64_t s = 0; s < n8; ++s) {  // padding up to a multiple of 8 reads the last key again
          keys[s] = cache + slots[task.first + std::min(s, n - 1)] * slot_stride + task.head * head_stride;
          values[s] = keys[s] + v_offset;
        }
        heads_over(keys.data(), values.data());
      }
    }

    // Merge each (row, KV head)'s runs: out = sum_c exp(lse_c - L) out_c, L = logsumexp_c lse_c.
#pragma omp for
    for (int64_t bh = 0; bh < rows * kv_heads; ++bh) {
      const int64_t b = bh / kv_heads, h = bh % kv_heads, t0 = first_task[bh], t1 = first_task[bh + 1];
      for (int64_t j = 0; j < g; ++j) {
        float* o = out + ((b * heads + h * g + j) * value_dim);
        float* l = lse + b * heads + h * g + j;
        std::fill(o, o + value_dim, 0.0f);
        if (t0 == t1) {  // a row without keys: out 0, lse -inf, as the PyTorch path
          *l = -INFINITY;
          continue;
        }
        float top = part_lse[t0 * g + j];
        for (int64_t t = t0 + 1; t < t1; ++t) top = std::max(top, part_lse[t * g + j]);
        float total = 0.0f;
        for (int64_t t = t0; t < t1; ++t) total += std::exp(part_lse[t * g + j] - top);
        for (int64_t t = t0; t < t1; ++t) {
          const float w = std::exp(part_lse[t * g + j] - top) / total;
          const float* src = part_out.data() + (t * g + j) * value_dim;
          for (int64_t d = 0; d < value_dim; ++d) o[d] += w * src[d];
        }
        *l = top + std::log(total);
      }
    }
  }
}

}  // namespace

extern "C" {

// q (rows, heads, dim) float32; slots: the rows' cache slots back to back,
// row b's at [starts[b], starts[b+1]); out (rows, heads, value_dim) and lse
// (rows, heads) float32. Query head i uses KV head i / (heads / kv_heads).
void paged_decode_f32(const float* q, const float* cache, const int64_t* slots, const int64_t* starts, int64_t rows,
                      int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim, int64_t slot_stride,
                      int64_t head_stride, int64_t v_offset, float scale, float* out, float* lse) {
  attend(q, cache, slots, starts, rows, heads, kv_heads, dim, value_dim, slot_stride, head_stride, v_offset, nullptr,
         scale, out, lse);
}

// The same over a bfloat16 cache (q, out and lse stay float32).
void paged_decode_bf16(const float* q, const uint16_t* cache, const int64_t* slots, const int64_t* starts,
                       int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim,
                       int64_t slot_stride, int64_t head_stride, int64_t v_offset, float scale, float* out,
                       float* lse) {
  attend(q, cache, slots, starts, rows, heads, kv_heads, dim, value_dim, slot_stride, head_stride, v_offset, nullptr,
         scale, out, lse);
}

// The same over a quantized cache of byte rows (strides in bytes): code 0 int8, 1
// float8_e4m3fn, 2 float8_e5m2; the scales as kv_codes.h's Scales.
void paged_decode_quant(const float* q, const uint8_t* cache, const int64_t* slots, const int64_t* starts,
                        int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim,
                        int64_t slot_stride, int64_t head_stride, int64_t v_offset, int64_t code,
                        int64_t scale_offset, int64_t scale_head, int64_t scale_value, int64_t split, float scale,
                        float* out, float* lse) {
  const Scales sc{scale_offset, scale_head, scale_value, split};
  auto run = [&](auto* codes) {
    attend(q, codes, slots, starts, rows, heads, kv_heads, dim, value_dim, slot_stride, head_stride, v_offset, &sc,
           scale, out, lse);
  };
  if (code == 0) run(reinterpret_cast<const int8_t*>(cache));
  if (code == 1) run(reinterpret_cast<const E4M3*>(cache));
  if (code == 2) run(reinterpret_cast<const E5M2*>(cache));
}
}
