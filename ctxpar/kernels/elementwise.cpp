// The elementwise steps of a decoder layer, each one pass over memory, over fp32 or
// bf16 (T: float or BF16; bf16 is computed in floats, rounded where PyTorch's bf16
// ops round: the residual sum, the normalised row before the weight, the SiLU before
// the product; rope's rotation rounds once):
//
//   rms_norm   out = x / sqrt(mean(x^2) + eps) * weight, optionally after the
//              residual add it follows (residual += x, then the norm of it);
//              rms_norm_heads the same over each head of (n, heads, dim), in place
//   silu_mul   SwiGLU's silu(gate) * up from the fused gate|up projection
//   gelu_tanh_mul  Gemma's gelu_tanh(gate) * up, likewise
//   rope       rotary embedding in place, half-split pairs (i, i + rot/2) of each head's first
//              rot dims (rot = dim: the whole head; Phi-4-mini turns 3/4 and passes the rest)
//
// PyTorch runs each as a chain of passes (rms_norm 5, rope 7 and a cat,
// silu * up 3 with a copy of the strided gate) and, for a decode step's few
// tokens, pays a dispatch per pass. Rows are split over the threads only when
// there are enough of them to pay for waking the threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using widest::vec;
using widest::veci;
using widest::W;
constexpr int64_t PARALLEL_FLOATS = 1 << 15;  // below this much work per call, one thread

// One row: xi (dim,), src its residual row (residual += xi first) or xi itself, oi the
// output row (may be xi: each element is read before it is written).
template <typename T>
void rms_norm_row(const T* xi, T* src, bool residual, const T* weight, int64_t dim, float eps, T* oi) {
  vec squares = {};
  float tail = 0.0f;
  int64_t j = 0;
  for (; j + W <= dim; j += W) {
    vec v = loadv<vec>(xi + j);
    if (residual) {
      v = rounded<T>(v + loadv<vec>(src + j));
      storev(src + j, v);
    }
    squares += v * v;
  }
  for (; j < dim; ++j) {
    float v = widen(xi[j]);
    if (residual) narrow_to(src + j, v = rounded_one<T>(widen(src[j]) + v));
    tail += v * v;
  }
  const float inv = 1.0f / std::sqrt((hsum(squares) + tail) / float(dim) + eps);
  for (j = 0; j + W <= dim; j += W) storev(oi + j, rounded<T>(loadv<vec>(src + j) * inv) * loadv<vec>(weight + j));
  for (; j < dim; ++j) narrow_to(oi + j, rounded_one<T>(widen(src[j]) * inv) * widen(weight[j]));
}

template <typename T>
void rms_norm(const T* x, int64_t x_stride, T* residual, const T* weight, int64_t n, int64_t dim, float eps,
              T* out) {
#pragma omp parallel for if (n * dim >= PARALLEL_FLOATS)
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * x_stride;
    rms_norm_row(xi, residual ? residual + i * dim : const_cast<T*>(xi), residual != nullptr, weight, dim, eps,
                 out + i * dim);
  }
}

// Each head of each token its own row (Qwen3's and Gemma 3's norms of the Q and K heads).
template <typename T>
void rms_norm_heads(T* x, int64_t x_stride, int64_t n, int64_t heads, const T* weight, int64_t dim, float eps) {
#pragma omp parallel for if (n * heads * dim >= PARALLEL_FLOATS)
  for (int64_t r = 0; r < n * heads; ++r) {
    T* row = x + (r / heads) * x_stride + (r % heads) * dim;
    rms_norm_row(row, row, false, weight, dim, eps, row);
  }
}

// act(gate) * up for a gated MLP, act(x) = x sigmoid(z): SwiGLU's silu at z = x, and Gemma's
// gelu_tanh(x) = x (1 + tanh(y)) / 2 = x sigmoid(2y) at z = 2y, y = sqrt(2/pi) (x + 0.044715 x^3).
// x / (1 + e^-z) is written with e = exp(-|z|) <= 1 so the exp never overflows: x / (1 + e)
// for z >= 0, x e / (1 + e) below; the activation is rounded to T before the product, as
// PyTorch's float32 activation cast to bf16 and multiplied in bf16 is.
template <bool gelu, typename T>
void gated_mul(const T* gate_up, int64_t n, int64_t inter, T* out) {
  constexpr float KAPPA = 0.044715f, TWO_BETA = 1.5957691216057308f;  // 2 sqrt(2/pi)
#pragma omp parallel for if (n * inter >= PARALLEL_FLOATS)
  for (int64_t i = 0; i < n; ++i) {
    const T* g = gate_up + i * 2 * inter;
    const T* u = g + inter;
    T* oi = out + i * inter;
    int64_t j = 0;
    for (; j + W <= inter; j += W) {
      const vec x = loadv<vec>(g + j);
      vec z = x;
      if constexpr (gelu) z = (x + KAPPA * (x * x * x)) * TWO_BETA;
      const vec e = exp2_nonpositive<vec, veci>((z < 0 ? z : -z) * LOG2E);
      storev(oi + j, rounded<T>((z < 0 ? x * e : x) / (1.0f + e)) * loadv<vec>(u + j));
    }
    for (; j < inter; ++j) {
      const float x = widen(g[j]), z = gelu ? (x + KAPPA * (x * x * x)) * TWO_BETA : x, e = std::exp(-std::fabs(z));
      narrow_to(oi + j, rounded_one<T>((z < 0 ? x * e : x) / (1.0f + e)) * widen(u[j]));
    }
  }
}

template <typename T>
void rope(T* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, int64_t rot, const float* cos,
          const float* sin) {
  const int64_t half = rot / 2;
#pragma omp parallel for if (n * heads * dim >= PARALLEL_FLOATS)
  for (int64_t i = 0; i < n; ++i) {
    const float* c = cos + i * half;
    const float* s = sin + i * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* a = x + i * x_stride + h * dim;
      T* b = a + half;
      int64_t k = 0;
      for (; k + W <= half; k += W) {
        const vec ak = loadv<vec>(a + k), bk = loadv<vec>(b + k), ck = loadv<vec>(c + k), sk = loadv<vec>(s + k);
        storev(a + k, ak * ck - bk * sk);
        storev(b + k, bk * ck + ak * sk);
      }
      for (; k < half; ++k) {
        const float ak = widen(a[k]), bk = widen(b[k]);
        narrow_to(a + k, ak * c[k] - bk * s[k]);
        narrow_to(b + k, bk * c[k] + ak * s[k]);
      }
    }
  }
}

// A head's run of NV whole vectors, turned in registers (hadamard_f32): the stages of
// strides below W pair lanes of one vector (a lane permutation, then a + b or b - a by
// lane), the wider ones pair whole vectors.
template <int NV>
void hadamard_runs(float* x, int64_t x_stride, int64_t runs, int64_t heads, float scale) {
  veci lane;
  for (int j = 0; j < W; ++j) lane[j] = j;
#pragma omp parallel for if (runs * NV * W >= PARALLEL_FLOATS)
  for (int64_t i = 0; i < runs; ++i) {
    float* r = x + i / heads * x_stride + i % heads * NV * W;
    vec v[NV];
    for (int k = 0; k < NV; ++k) {
      v[k] = loadv<vec>(r + k * W);
      for (int h = 1; h < W; h *= 2) {  // lane j pairs with lane j ^ h: (a, b) = (v[j], v[j + h]) at bit h 0
        const vec partner = __builtin_shuffle(v[k], lane ^ h);
        v[k] = (lane & h) ? partner - v[k] : v[k] + partner;
      }
    }
    for (int h = 1; h < NV; h *= 2)
      for (int s = 0; s < NV; s += 2 * h)
        for (int j = s; j < s + h; ++j) {
          const vec a = v[j], b = v[j + h];
          v[j] = a + b, v[j + h] = a - b;
        }
    for (int k = 0; k < NV; ++k) storev(r + k * W, v[k] * scale);
  }
}

}  // namespace

extern "C" {

// x (n, dim) with x_stride elements between rows; residual (n, dim) contiguous
// or null; out (n, dim) contiguous (may be x itself when x_stride == dim).
void rms_norm_f32(const float* x, int64_t x_stride, float* residual, const float* weight, int64_t n,
                  int64_t dim, float eps, float* out) {
  rms_norm(x, x_stride, residual, weight, n, dim, eps, out);
}
void rms_norm_bf16(const BF16* x, int64_t x_stride, BF16* residual, const BF16* weight, int64_t n, int64_t dim,
                   float eps, BF16* out) {
  rms_norm(x, x_stride, residual, weight, n, dim, eps, out);
}

// x (n, heads, dim) in place, heads contiguous, x_stride elements between tokens:
// each head normalised as a row of rms_norm (the same bits as rms_norm of that row).
void rms_norm_heads_f32(float* x, int64_t x_stride, int64_t n, int64_t heads, const float* weight, int64_t dim,
                        float eps) {
  rms_norm_heads(x, x_stride, n, heads, weight, dim, eps);
}
void rms_norm_heads_bf16(BF16* x, int64_t x_stride, int64_t n, int64_t heads, const BF16* weight, int64_t dim,
                         float eps) {
  rms_norm_heads(x, x_stride, n, heads, weight, dim, eps);
}

// gate_up (n, 2 * inter): each row's gate then up; out (n, inter) contiguous.
void silu_mul_f32(const float* gate_up, int64_t n, int64_t inter, float* out) {
  gated_mul<false>(gate_up, n, inter, out);
}
void silu_mul_bf16(const BF16* gate_up, int64_t n, int64_t inter, BF16* out) {
  gated_mul<false>(gate_up, n, inter, out);
}
void gelu_tanh_mul_f32(const float* gate_up, int64_t n, int64_t inter, float* out) {
  gated_mul<true>(gate_up, n, inter, out);
}
void gelu_tanh_mul_bf16(const BF16* gate_up, int64_t n, int64_t inter, BF16* out) {
  gated_mul<true>(gate_up, n, inter, out);
}

// x (n, heads, dim) in place, heads contiguous, x_stride elements between
// tokens; cos, sin (n, dim / 2) contiguous float32. Pairs (k, k + dim/2) rotate:
// (a, b) -> (a cos - b sin, b cos + a sin).
void rope_f32(float* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, const float* cos,
              const float* sin) {
  rope(x, x_stride, n, heads, dim, dim, cos, sin);
}
void rope_bf16(BF16* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, const float* cos,
               const float* sin) {
  rope(x, x_stride, n, heads, dim, dim, cos, sin);
}

// rope_f32 of each head's first rot dims (rot even, <= dim), the others left as they are
// (transformers' partial_rotary_factor: Phi-4-mini's); cos, sin (n, rot / 2). Pairs (k, k + rot/2).
void rope_partial_f32(float* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, int64_t rot,
                      const float* cos, const float* sin) {
  rope(x, x_stride, n, heads, dim, rot, cos, sin);
}
void rope_partial_bf16(BF16* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, int64_t rot,
                       const float* cos, const float* sin) {
  rope(x, x_stride, n, heads, dim, rot, cos, sin);
}

// x (n, heads, dim) in place, heads contiguous, x_stride floats between tokens:
// each head's run times the Walsh-Hadamard matrix (Sylvester's order, not
// normalised), then times scale (a power of two: exact). Stage h turns the pairs
// (j, j + h) of each block of 2h into (a + b, a - b): the order of
// ctxpar.layers.kv_rotation's PyTorch path, so the two give the same bits.
// Heads of 1 to 16 whole vectors are turned in registers (hadamard_runs); others go
// W runs at a time through a (dim, W) tile, one run a lane, so that every stage is
// whole-vector sums and differences. Either way each value takes the same operations
// in the same order.
void hadamard_f32(float* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, float scale) {
  const int64_t runs = n * heads, tiles = (runs + W - 1) / W;
  if (dim == W) return hadamard_runs<1>(x, x_stride, runs, heads, scale);
  if (dim == 2 * W) return hadamard_runs<2>(x, x_stride, runs, heads, scale);
  if (dim == 4 * W) return hadamard_runs<4>(x, x_stride, runs, heads, scale);
  if (dim == 8 * W) return hadamard_runs<8>(x, x_stride, runs, heads, scale);
  if (dim == 16 * W) return hadamard_runs<16>(x, x_stride, runs, heads, scale);
#pragma omp parallel if (runs * dim >= PARALLEL_FLOATS)
  {
    std::vector<float> tile(dim * W);
#pragma omp for
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = t * W, lanes = std::min<int64_t>(W, runs - r0);
      auto run = [&](int64_t l) { return x + (r0 + l) / heads * x_stride + (r0 + l) % heads * dim; };
      for (int64_t l = 0; l < W; ++l) {
        const float* r = l < lanes ? run(l) : nullptr;  // lanes past the last run compute zeros
        for (int64_t k = 0; k < dim; ++k) tile[k * W + l] = r ? r[k] : 0.0f;
      }
      for (int64_t h = 1; h < dim; h *= 2)
        for (int64_t s = 0; s < dim; s += 2 * h)
          for (int64_t j = s; j < s + h; ++j) {
            const vec a = loadv<vec>(tile.data() + j * W), b = loadv<vec>(tile.data() + (j + h) * W);
            storev(tile.data() + j * W, a + b);
            storev(tile.data() + (j + h) * W, a - b);
          }
      for (int64_t l = 0; l < lanes; ++l) {
        float* r = run(l);
        for (int64_t k = 0; k < dim; ++k) r[k] = tile[k * W + l] * scale;
      }
    }
  }
}
}
