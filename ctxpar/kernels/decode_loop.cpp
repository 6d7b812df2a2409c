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
// Projections are block-quantized (quant_gemv.cpp) or fp32 panels (gemv.cpp); the
// cache fp32 entries or quantized rows (kv_quantize.cpp, kv_codes.h).

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_part.h"

extern "C" {
void rms_norm_f32(const float* x, int64_t x_stride, float* residual, const float* weight, int64_t n, int64_t dim,
                  float eps, float* out);
void rms_norm_heads_f32(float* x, int64_t x_stride, int64_t n, int64_t heads, const float* weight, int64_t dim,
                        float eps);
void silu_mul_f32(const float* gate_up, int64_t n, int64_t inter, float* out);
void gelu_tanh_mul_f32(const float* gate_up, int64_t n, int64_t inter, float* out);
void rope_f32(float* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, const float* cos, const float* sin);
void hadamard_f32(float* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, float scale);
void quant_linear_f32(const float* x, int64_t x_stride, int64_t n, int64_t in, const QuantPart* parts,
                      int64_t num_parts, int64_t bits, int64_t group, int64_t half, int64_t zero, const float* bias,
                      float* out);
void linear_packed_f32(const float* x, int64_t x_stride, int64_t n, const float* packed, int64_t in,
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
}

namespace {

// One projection's weight: block-quantized (bits 4 or 8: its parts, quant_part.h) or,
// with bits 0, fp32 panels (data).
struct Projection {
  const void* data;  // QuantPart[num_parts], or PanelWeight.data
  int64_t num_parts;
  const float* bias;  // null: none
  int64_t in, out, bits, group, half, zero;
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
};

// The cache's format: code -1 float32 entries, else kv_codes.h's code of quantized rows;
// q_turn, kv_turn (0: not turned) the scales of the Walsh-Hadamard turn of the heads of a
// quantized cache (ctxpar/layers/kv_rotation.py): queries and output, keys and values.
struct Cache {
  int64_t code, row_bytes, scale_offset, num_runs;
  const int64_t* runs;
  float q_turn, kv_turn;
};

void project(const Projection& p, const float* x, int64_t x_stride, int64_t n, float* out) {
  if (p.bits == 0)
    linear_packed_f32(x, x_stride, n, static_cast<const float*>(p.data), p.in, p.out, p.bias, out);
  else
    quant_linear_f32(x, x_stride, n, p.in, static_cast<const QuantPart*>(p.data), p.num_parts, p.bits, p.group,
                     p.half, p.zero, p.bias, out);
}

}  // namespace

extern "C" {

// h (n, hidden) float32, updated in place through every layer (the residual stream
// before the final norm); cos, sin (n, D/2) the rows' rope tables, local_cos, local_sin
// those of the layers marked local_rope (null where none is); write_slots (n,)
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
  auto at_least = [](auto& v, int64_t size) {
    if (int64_t(v.size()) < size) v.resize(size);
  };
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
    rope_f32(qkv.data(), qkv_size, n, heads + kv_heads, dim, L.local_rope ? local_cos : cos,
             L.local_rope ? local_sin : sin);  // Q and K heads side by side
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
    project(L.gate_up, x.data(), hidden, n, gate_up.data());
    (gelu ? gelu_tanh_mul_f32 : silu_mul_f32)(gate_up.data(), n, inter, act.data());
    project(L.down, act.data(), inter, n, proj.data());
    const float* m = proj.data();
    if (L.mlp_out_norm) {
      rms_norm_f32(proj.data(), hidden, nullptr, L.mlp_out_norm, n, hidden, eps, normed.data());
      m = normed.data();
    }
    for (int64_t i = 0; i < n * hidden; ++i) h[i] += m[i];
  }
}
}
