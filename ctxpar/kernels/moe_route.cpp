// A mixture of experts' routing and its shared expert's gate, one scalar pass a row.
//
// The expert layer's Python forward (ctxpar/layers/moe.py) and the compiled decode loop
// (decode_loop.cpp) both call these, so a token's experts, their weights and the shared
// expert's gate are the same bits on both paths; PyTorch's softmax, topk and sigmoid would
// be another arithmetic (their vector bodies and tails differ), and topk breaks ties as it
// likes. Each row computes alone: its bits never depend on the rows beside it.

#include <cmath>
#include <cstdint>
#include <vector>

extern "C" {

// logits (n, experts) float32 -> each row's top k experts by softmax score: ids (n, k) int64,
// best first, of equal scores the lower id first; weights (n, k) their scores, with renorm
// divided by their sum (+ 1e-20, transformers' guard), then times scaling.
void moe_route_f32(const float* logits, int64_t n, int64_t experts, int64_t k, int64_t renorm, float scaling,
                   float* weights, int64_t* ids) {
  std::vector<float> p(experts);
  std::vector<char> taken(experts);
  for (int64_t t = 0; t < n; ++t) {
    const float* l = logits + t * experts;
    float top = l[0];
    for (int64_t e = 1; e < experts; ++e) top = l[e] > top ? l[e] : top;
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) {
      p[e] = std::exp(l[e] - top);
      sum += p[e];
      taken[e] = 0;
    }
    for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
    float* w = weights + t * k;
    int64_t* id = ids + t * k;
    float chosen = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e)  // strictly greater: a tie keeps the lower id
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      id[j] = best;
      w[j] = p[best];
      chosen += p[best];
    }
    for (int64_t j = 0; j < k; ++j) {
      if (renorm) w[j] /= chosen + 1e-20f;
      w[j] *= scaling;
    }
  }
}

// x (n,) -> out (n,) = 1 / (1 + exp(-x)).
void sigmoid_f32(const float* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = 1.0f / (1.0f + std::exp(-x[i]));
}
}
