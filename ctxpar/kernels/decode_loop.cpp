// A Llama decode step's layers in one call: the CPU's answer to CUDA graphs.
//
// A decode step of a small model is ~12 kernel calls a layer, each a few to a few
// tens of microseconds, and each call from Python costs ~10 us of its own
// (argument conversion, tensor allocation, module dispatch): a third of SmolLM2's
// step. Here the same kernels are called, with the same arguments in the same
// order, from one loop over the layers, so the step computes exactly the bits the
// Python path computes (ctxpar/models/compiled_decode.py checks that, and the
// tests compare the two).
//
// Per layer, h (n, hidden) the residual stream:
//   x = rms_norm(h); qkv = x W_qkv^T (+b); [Qwen3, Gemma 3: rms_norm of each Q and K head]; rope(q, k);
//   [a quantized cache: turn q, k, v]; K, V -> cache slots; a = attention(q, cache) [turned back];
//   o = a W_o^T (+b); [Gemma: o = rms_norm(o)]; x = rms_norm(h += o);
//   m = down(act(gate) * up), gate|up = x W_gu^T (+b), act silu or gelu_tanh (Gemma);
//   [Gemma: m = rms_norm(m)]; h += m
// or, in a mixture of experts' layer (Qwen-MoE), m = experts(x) (moe(), below).
// Projections are block-quantized (quant_gemv.cpp) or fp32 or bf16 panels (gemv.cpp); the
// cache fp32 entries or quantized rows (kv_quantize.cpp, kv_codes.h).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_part.h"
#include "vec.h"

extern "C" {
void rms_norm_f32(const float* x, int64_t x_stride, float* residual, const float* weight, int64_t n, int64_t dim,
                  float eps, float* out);
void rms_norm_heads_f32(float* x, int64_t x_stride, int64_t n, int64_t heads, const float* weight, int64_t dim,
                        float eps);
void silu_mul_f32(const float* gate_up, int64_t n, int64_t inter, float* out);
void gelu_tanh_mul_f32(const float* gate_up, int64_t n, int64_t inter, float* out);
void rope_f32(float* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, const float* cos, const float* sin);
void rope_partial_f32(float* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, int64_t rot, const float* cos,
                      const float* sin);
void hadamard_f32(float* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, float scale);
void quant_linear_f32(const float* x, int64_t x_stride, int64_t n, int64_t in, const QuantPart* parts,
                      int64_t num_parts, int64_t bits, int64_t group, int64_t half, int64_t zero, const float* bias,
                      float* out);
void linear_packed_f32(const float* x, int64_t x_stride, int64_t n, const float* packed, int64_t in,
                       int64_t out_features, const float* bias, float* out);
void linear_packed_bf16(const uint16_t* x, int64_t x_stride, int64_t n, const uint16_t* packed, int64_t pairs,
                        int64_t out_features, const float* bias, float* out);
void kv_quantize(const float* x, int64_t n, int64_t x_stride, const int64_t* runs, int64_t num_runs, int64_t code,
                 int64_t scale_offset, int64_t row_bytes, uint8_t* out);
void paged_decode_f32(const float* q, const float* cache, const int64_t* slots, const int64_t* starts, int64_t rows,
                      int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim, int64_t slot_stride,
                      int64_t head_stride, int64_t v_offset, float scale, int64_t window, float soft_cap, float* out,
                      float* lse);
void paged_decode_quant(const float* q, const uint8_t* cache, const int64_t* slots, const int64_t* starts,
                        int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim,
                        int64_t slot_stride, int64_t head_stride, int64_t v_offset, int64_t code,
                        int64_t scale_offset, int64_t scale_head, int64_t scale_value, int64_t split, float scale,
                        int64_t window, float soft_cap, float* out, float* lse);
void moe_route_f32(const float* logits, int64_t n, int64_t experts, int64_t k, int64_t renorm, float scaling,
                   float* weights, int64_t* ids);
void sigmoid_f32(const float* x, int64_t n, float* out);
}

namespace {

// One projection's weight: block-quantized (bits 4 or 8: its parts, quant_part.h) or,
// with bits 0, fp32 panels (data), with bits 16 bf16 panels (a GGUF's BF16 weights).
struct Projection {
  const void* data;  // QuantPart[num_parts], or PanelWeight.data
  int64_t num_parts;
  const float* bias;  // null: none
  int64_t in, out, bits, group, half, zero;
};

// A mixture of experts in the MLP's place (ctxpar/layers/moe.py's MoE, greedy routing, SiLU).
struct Experts {
  Projection router;         // (count, hidden) float32: the routing logits
  const Projection* expert;  // [count][3]: each expert's gate, up, down
  int64_t count, top_k, renorm, inter;
  float scaling;              // routed_scaling_factor
  const Projection* shared;   // [3]: the shared expert's gate, up, down (width shared_inter); null: none
  int64_t shared_inter;
  const Projection* shared_gate;  // (1, hidden): sigmoid of it scales the shared expert's output; null: none
};

struct Layer {
  const float* input_norm;  // (hidden,)
  const float* post_norm;   // (hidden,) of h after the attention's residual add
  Projection qkv, o, gate_up, down;
  void* cache;     // (num_slots, 2, Hk, D) float32 or (num_slots, row_bytes) quantized rows
  int64_t window;  // a sliding-window layer's keys per query (paged_decode's); 0: every key
  const float* q_norm;  // (D,) each Q head's RMSNorm (Qwen3); null: no norms of the heads
  const float* k_norm;  // (D,) each K head's
  // Gemma's sandwich norms (null: none): of the attention's output and of the MLP's, each
  // before its residual add.
  const float* attn_out_norm;
  const float* mlp_out_norm;
  int64_t local_rope;  // 1: the step's local rope tables (Gemma 3's sliding layers)
  int64_t rot;         // each Q, K head's first rot dims turn; < D: a partial rotary factor's (Phi-4-mini)
  const Experts* experts;  // the MLP's place taken by experts (gate_up, down unused); null: the dense MLP
};

// The cache's format: code -1 float32 entries, else kv_codes.h's code of quantized rows;
// q_turn, kv_turn (0: not turned) the scales of the Walsh-Hadamard turn of the heads of a
// quantized cache (ctxpar/layers/kv_rotation.py): queries and output, keys and values.
struct Cache {
  int64_t code, row_bytes, scale_offset, num_runs;
  const int64_t* runs;
  float q_turn, kv_turn;
};

template <typename V>
void at_least(V& v, int64_t size) {
  if (int64_t(v.size()) < size) v.resize(size);
}

// x (n, in) rows x_stride apart; here every x is contiguous rows of the projection's input
// (x_stride its width, which bf16 panels do not record: an odd width fills its last pair).
void project(const Projection& p, const float* x, int64_t x_stride, int64_t n, float* out) {
  if (p.bits == 16) {  // as layers/linear.py: x rounded to bf16, padded with a zero to whole pairs
    static thread_local std::vector<BF16> xb;
    const int64_t width = x_stride + x_stride % 2;
    at_least(xb, n * width);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < x_stride; ++i) narrow_to(&xb[t * width + i], x[t * x_stride + i]);
      if (width > x_stride) xb[t * width + x_stride].bits = 0;
    }
    linear_packed_bf16(reinterpret_cast<const uint16_t*>(xb.data()), width, n, static_cast<const uint16_t*>(p.data),
                       width / 2, p.out, p.bias, out);
  } else if (p.bits == 0)
    linear_packed_f32(x, x_stride, n, static_cast<const float*>(p.data), p.in, p.out, p.bias, out);
  else
    quant_linear_f32(x, x_stride, n, p.in, static_cast<const QuantPart*>(p.data), p.num_parts, p.bits, p.group,
                     p.half, p.zero, p.bias, out);
}

// out (c, hidden) = down(silu(gate(x)) * up(x)) of x (c, hidden) contiguous, p its [gate, up, down]:
// GatedMLP's forward, gate and up side by side in one (c, 2 inter) as its silu_and_mul takes them.
void gated_mlp(const Projection* p, const float* x, int64_t c, int64_t hidden, int64_t inter, float* out) {
  static thread_local std::vector<float> gate, up, gate_up, act;
  at_least(gate, c * inter), at_least(up, c * inter), at_least(gate_up, c * 2 * inter), at_least(act, c * inter);
  project(p[0], x, hidden, c, gate.data());
  project(p[1], x, hidden, c, up.data());
  for (int64_t r = 0; r < c; ++r) {
    std::memcpy(gate_up.data() + r * 2 * inter, gate.data() + r * inter, inter * sizeof(float));
    std::memcpy(gate_up.data() + r * 2 * inter + inter, up.data() + r * inter, inter * sizeof(float));
  }
  silu_mul_f32(gate_up.data(), c, inter, act.data());
  project(p[2], act.data(), inter, c, out);
}

// out (n, hidden) = the experts' output for x (n, hidden) contiguous, as MoE.forward computes it:
// route each row (moe_route_f32); from zeros, for each expert in ascending order with rows routed
// to it, its output for those rows times each row's weight added to them; then + the shared
// expert's output, times sigmoid of its gate. Each product is rounded before its sum, as PyTorch's
// separate ops round it: products and sums are separate loops through memory, which GCC does not
// contract into multiply-adds as it may a product and a sum of one loop (-ffp-contract=fast, its
// C++ default).
void moe(const Experts& E, const float* x, int64_t n, int64_t hidden, float* out) {
  static thread_local std::vector<float> logits, weights, picked_w, xs, ys, shared, gate, sig;
  static thread_local std::vector<int64_t> ids, picked;
  const int64_t k = E.top_k;
  at_least(logits, n * E.count), at_least(weights, n * k), at_least(ids, n * k), at_least(picked, n);
  at_least(picked_w, n), at_least(xs, n * hidden), at_least(ys, n * hidden);
  project(E.router, x, hidden, n, logits.data());
  moe_route_f32(logits.data(), n, E.count, k, E.renorm, E.scaling, weights.data(), ids.data());
  std::fill(out, out + n * hidden, 0.0f);
  for (int64_t e = 0; e < E.count; ++e) {
    int64_t c = 0;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < k; ++j)
        if (ids[t * k + j] == e) picked[c] = t, picked_w[c++] = weights[t * k + j];
    if (c == 0) continue;
    for (int64_t r = 0; r < c; ++r)
      std::memcpy(xs.data() + r * hidden, x + picked[r] * hidden, hidden * sizeof(float));
    gated_mlp(E.expert + 3 * e, xs.data(), c, hidden, E.inter, ys.data());
    for (int64_t r = 0; r < c; ++r)
      for (int64_t i = 0; i < hidden; ++i) ys[r * hidden + i] *= picked_w[r];
    for (int64_t r = 0; r < c; ++r)
      for (int64_t i = 0; i < hidden; ++i) out[picked[r] * hidden + i] += ys[r * hidden + i];
  }
  if (!E.shared) return;
  at_least(shared, n * hidden);
  gated_mlp(E.shared, x, n, hidden, E.shared_inter, shared.data());
  if (E.shared_gate) {
    at_least(gate, n), at_least(sig, n);
    project(*E.shared_gate, x, hidden, n, gate.data());
    sigmoid_f32(gate.data(), n, sig.data());
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < hidden; ++i) shared[t * hidden + i] *= sig[t];
  }
  for (int64_t i = 0; i < n * hidden; ++i) out[i] += shared[i];
}

}  // namespace

extern "C" {

// h (n, hidden) float32, updated in place through every layer (the residual stream
// before the final norm); cos, sin (n, rot/2) the rows' rope tables (rot: a layer's),
// local_cos, local_sin those of the layers marked local_rope (null where none is); write_slots (n,)
// each token's cache slot; slots/starts the rows' context slots (paged_decode's);
// soft_cap the attention logits' (0: none); gelu: the MLP's gelu_tanh(gate) * up, else silu's.
void llama_decode_layers(const Layer* layers, int64_t num_layers, const Cache* cache, float* h, int64_t n,
                         int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim, int64_t inter, float eps,
                         const float* cos, const float* sin, const float* local_cos, const float* local_sin,
                         const int64_t* write_slots, const int64_t* slots, const int64_t* starts, float scale,
                         float soft_cap, int64_t gelu) {
  const int64_t q_size = heads * dim, kv_size = kv_heads * dim, qkv_size = q_size + 2 * kv_size;
  // Scratch kept between steps (a decode step is one call): sizes grow with the batch only.
  static thread_local std::vector<float> x, qkv, q, attn, lse, proj, normed, gate_up, act;
  static thread_local std::vector<uint8_t> rows;
  at_least(x, n * hidden), at_least(qkv, n * qkv_size), at_least(q, n * q_size), at_least(attn, n * q_size);
  at_least(lse, n * heads), at_least(proj, n * hidden), at_least(normed, n * hidden);
  at_least(gate_up, n * 2 * inter), at_least(act, n * inter);
  if (cache->code >= 0) at_least(rows, n * cache->row_bytes);
  for (int64_t l = 0; l < num_layers; ++l) {
    const Layer& L = layers[l];
    rms_norm_f32(h, hidden, nullptr, L.input_norm, n, hidden, eps, x.data());
    project(L.qkv, x.data(), hidden, n, qkv.data());
    if (L.q_norm) {
      rms_norm_heads_f32(qkv.data(), qkv_size, n, heads, L.q_norm, dim, eps);
      rms_norm_heads_f32(qkv.data() + q_size, qkv_size, n, kv_heads, L.k_norm, dim, eps);
    }
    // Q and K heads side by side, by the kernel elementwise.rope_ picks for the forward
    const float* rc = L.local_rope ? local_cos : cos;
    const float* rs = L.local_rope ? local_sin : sin;
    if (L.rot < dim)
      rope_partial_f32(qkv.data(), qkv_size, n, heads + kv_heads, dim, L.rot, rc, rs);
    else
      rope_f32(qkv.data(), qkv_size, n, heads + kv_heads, dim, rc, rs);
    if (cache->kv_turn != 0) {
      hadamard_f32(qkv.data(), qkv_size, n, heads, dim, cache->q_turn);
      hadamard_f32(qkv.data() + q_size, qkv_size, n, 2 * kv_heads, dim, cache->kv_turn);  // K then V heads
    }
    const float* entries = qkv.data() + q_size;  // (n, 2, Hk, D) rows qkv_size apart
    if (cache->code < 0) {
      float* c = static_cast<float*>(L.cache);
      for (int64_t t = 0; t < n; ++t)
        std::memcpy(c + write_slots[t] * 2 * kv_size, entries + t * qkv_size, 2 * kv_size * sizeof(float));
    } else {
      kv_quantize(entries, n, qkv_size, cache->runs, cache->num_runs, cache->code, cache->scale_offset,
                  cache->row_bytes, rows.data());
      uint8_t* c = static_cast<uint8_t*>(L.cache);
      for (int64_t t = 0; t < n; ++t)
        std::memcpy(c + write_slots[t] * cache->row_bytes, rows.data() + t * cache->row_bytes, cache->row_bytes);
    }
    for (int64_t t = 0; t < n; ++t)  // the queries as the kernel takes them: (n, H, D) contiguous
      std::memcpy(q.data() + t * q_size, qkv.data() + t * qkv_size, q_size * sizeof(float));
    if (cache->code < 0)
      paged_decode_f32(q.data(), static_cast<const float*>(L.cache), slots, starts, n, heads, kv_heads, dim, dim,
                       2 * kv_size, dim, kv_size, scale, L.window, soft_cap, attn.data(), lse.data());
    else
      paged_decode_quant(q.data(), static_cast<const uint8_t*>(L.cache), slots, starts, n, heads, kv_heads, dim, dim,
                         cache->row_bytes, dim, kv_size, cache->code, cache->scale_offset, 1, kv_heads, dim, scale,
                         L.window, soft_cap, attn.data(), lse.data());
    if (cache->kv_turn != 0) hadamard_f32(attn.data(), q_size, n, heads, dim, cache->q_turn);  // turned back
    project(L.o, attn.data(), q_size, n, proj.data());
    const float* o = proj.data();
    if (L.attn_out_norm) {
      rms_norm_f32(proj.data(), hidden, nullptr, L.attn_out_norm, n, hidden, eps, normed.data());
      o = normed.data();
    }
    rms_norm_f32(o, hidden, h, L.post_norm, n, hidden, eps, x.data());  // h += o, x = norm(h)
    if (L.experts) {
      moe(*L.experts, x.data(), n, hidden, proj.data());
    } else {
      project(L.gate_up, x.data(), hidden, n, gate_up.data());
      (gelu ? gelu_tanh_mul_f32 : silu_mul_f32)(gate_up.data(), n, inter, act.data());
      project(L.down, act.data(), inter, n, proj.data());
    }
    const float* m = proj.data();
    if (L.mlp_out_norm) {
      rms_norm_f32(proj.data(), hidden, nullptr, L.mlp_out_norm, n, hidden, eps, normed.data());
      m = normed.data();
    }
    for (int64_t i = 0; i < n * hidden; ++i) h[i] += m[i];
  }
}
}
