// y = x W^T (+ bias) against a block-quantized weight, for any number of rows (a
// decode step's one, a prefill's thousands) on one path, so that a row's result
// never depends on the rows beside it: the weight stays as stored (4 or 8 bits a
// weight), and a decode step, bound by reading the weights, reads 4-8x fewer
// bytes than against fp32.
//
// The weight: row o holds in/32 blocks of 32 weights, weight i of a block
// = scale[group of i] * q[i] + offset[block] (ctxpar/layers/quant_blocks.py
// decodes every GGUF format into this form). q is stored
//   bits = 4: 16 bytes a block, q[i] in the low nibble of byte i (i < 16),
//             q[i] in the high nibble of byte i - 16 (i >= 16), q in 0..15;
//   bits = 8: 32 int8 a block.
// scales: (out, in / group), group 16 or 32; offsets (out, in / 32) or null (all
// zero); both float32, or both half (half.h) where the weight's values are halves.
// Each is read through strides (quant_part.h), so a GGUF file's blocks serve where
// they lie, and a fused projection is a list of such parts.
// zero: 0, or 8 for GGUF's Q4_0 as the file holds it (4 bits, groups of 32, no
// offsets): weight i = scale * (q[i] - 8). Every path takes sum (q - 8) x in integers
// (sum q x - 8 sum x: each block's -8 * sum of codes beside the codes).
//
// The activation row is quantized per block of 32 to int8 the way llama.cpp's
// Q8 does (d = max|x| / 127, q = round(x / d)), so a block's product is one
// integer dot product of 32 bytes by 32 bytes:
//   sum_i w_i x_i ~= sum_g scale_g dx (sum_{i in g} q_i qx_i) + offset dx sum_i qx_i.
// AVX2 does it with maddubs (u8 x s8 pairs -> s16) and madd (-> s32); VNNI's
// dpbusd does both at once. Products cannot saturate s16: a 4-bit q times
// |qx| <= 127 twice is < 2^12, and the 8-bit path multiplies |q| <= 128 by
// |qx| <= 127 (llama.cpp's sign trick: maddubs(|q|, sign(qx, q))), twice
// 32512 < 32767. Without AVX2 (the library is built per CPU, -march=native) a
// scalar loop computes the same integers. With AVX-512 VNNI, quant_product.h takes
// every call instead (16 outputs a vector, AMX-INT8 for groups of 16 rows).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "half.h"
#include "quant_part.h"
#include "quant_rows.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "quant_product.h"  // every row count on these CPUs
#define CTXPAR_TILES 1
#else
#include "quant_lanes.h"
#endif

namespace {

using activations::quantize_rows;

#if !defined(CTXPAR_TILES)
// The driving loop of quant_lanes.h's paths: the rows in passes, each output row's floats
// (and, packed, its weights) made once a pass.
using namespace lanes;
constexpr int64_t SPAN = 32;  // output rows a decode step's call takes (span_lanes)
constexpr int NR = 2;       // output rows a pass of the packed loop takes together (packed_rows)
// AVX2: rows from which packing the weights pays (packed_rows), at any width: measured on an
// AVX2-only CPU (Zen 3), the packed loop is faster for 4 and 8 bits from SmolLM2's 576 columns
// to the 1B's 8192, most at the narrow rows, whose last group the direct loop's per-row
// reductions weigh on.
constexpr int64_t PACKED_ROWS = 16;
constexpr int64_t PACKED_PASS = 64;  // and the fewest rows a pass then takes: each output row is packed once a pass

// f(std::integral_constant<int, mr>) for a run-time mr in 1..top: the row loops unroll.
template <int top = MR, typename F>
inline void with_rows(int mr, F&& f) {
  if (mr == top) return f(std::integral_constant<int, top>());
  if constexpr (top > 1) with_rows<top - 1>(mr, f);
}

// Output row o of a part with its scales and offsets as contiguous floats (the same values),
// in a buffer of the calling thread's: every pass of MR activation rows over the row reads
// them, and a GGUF file's lie a block apart as halves, one scalar load and convert each,
// which cost about a third of a prefill's time read in place. slot: which of the thread's NR
// buffers.
template <typename S>
inline __attribute__((always_inline)) PartView<float> row_floats(const PartView<S>& w, int64_t o, int64_t group,
                                                                 int64_t in, int slot) {
  static thread_local std::vector<float> bufs[NR];
  std::vector<float>& buf = bufs[slot];
  const int64_t ng = in / group, nb = in / QB;
  buf.resize(ng + nb);
  for (int64_t j = 0; j < ng; ++j) buf[j] = w.scale(o, j);
  for (int64_t b = 0; w.o && b < nb; ++b) buf[ng + b] = w.offset(o, b);
  const QuantPart part{w.block(o, 0), buf.data(), w.o ? buf.data() + ng : nullptr, 1, w.q_row, w.q_block, 0, 1, 0, 1};
  return PartView<float>(part);
}
#endif

template <typename S>
void quant_linear(const float* x, int64_t x_stride, int64_t n, int64_t in, const QuantPart* parts, int64_t num_parts,
                  int64_t bits, int64_t group, int64_t zero, const float* bias, float* out) {
  const int64_t nb = in / QB;
  int64_t out_features = 0;  // the output rows' stride: every part's outputs side by side
  for (int64_t k = 0; k < num_parts; ++k) out_features += parts[k].rows;
  // The quantized activations, kept per calling thread between calls: a decode step makes ~120.
  // (Pointers taken here: inside the parallel loop each thread would name its own vectors.)
  static thread_local std::vector<int8_t> xq_buf, xp_buf;
  static thread_local std::vector<float> xd_buf, xs_buf;
  static thread_local std::vector<int32_t> xz_buf;
  if (int64_t(xq_buf.size()) < n * in) xq_buf.resize(n * in);
  if (int64_t(xd_buf.size()) < n * nb) xd_buf.resize(n * nb), xs_buf.resize(n * nb);
  int8_t* xq = xq_buf.data();
  float *xd = xd_buf.data(), *xs = xs_buf.data();
#if defined(CTXPAR_TILES)
  const int64_t row_block = tiles::rows_per_block(in);
  // zero 8: each block's -8 * sum of codes, for sum (q - 8) x = sum q x - 8 sum x in integers.
  if (zero && int64_t(xz_buf.size()) < n * nb) xz_buf.resize(n * nb);
  int32_t* xz = zero ? xz_buf.data() : nullptr;
  static thread_local tiles::RowGroups row_groups_buf;
  tiles::RowGroups& row_groups = row_groups_buf;  // the codes as the VNNI loop reads them
  const bool grouped = n >= tiles::DIRECT_ROWS;  // fewer: a decode step's direct reads
  if (grouped) row_groups.resize(n, in, group, true);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < n; ++m) {
      quantize_rows(x + m * x_stride, x_stride, 1, in, xq + m * in, xd + m * nb, xs + m * nb, zero,
                    xz ? xz + m * nb : nullptr, nullptr);
      if (grouped) row_groups.set_row(m, xq + m * in, xd + m * nb, xs + m * nb, group, tiles::vnni_zero(bits, zero));
    }
    for (int64_t r0 = 0; r0 < n; r0 += row_block)
      for (int64_t k = 0, col = 0; k < num_parts; col += parts[k].rows, ++k)
        tiles::product(PartView<S>(parts[k]), zero, bits, group, in, out_features, xq, xd, xs, xz, row_groups, r0,
                       std::min(n, r0 + row_block), bias ? bias + col : nullptr, out + col);
  }
#else
#if defined(__AVX2__)
  // The 8-lane paths ("8 blocks at a time" above), G groups a block, packed where the rows repay
  // packing each output row's weights once a pass; either way a row's bits.
  const int G = group == QB ? 1 : 2;
  const bool packed = n >= PACKED_ROWS;
  static thread_local std::vector<int8_t> xt_buf;
  static thread_local std::vector<float> xdl_buf, xsl_buf;
  static thread_local std::vector<int32_t> xc_buf;
  const int64_t nbp = (nb + 7) / 8 * 8;  // blocks a row in transpose_row's lanes
  if (packed && int64_t(xt_buf.size()) < n * nbp * QB) xt_buf.resize(n * nbp * QB);
  bool offsets = false;
  for (int64_t k = 0; k < num_parts; ++k) offsets |= parts[k].offsets != nullptr;
  if (int64_t(xdl_buf.size()) < n * nbp) xdl_buf.resize(n * nbp);
  if (offsets && int64_t(xsl_buf.size()) < n * nbp) xsl_buf.resize(n * nbp);
  // The codes' share of the sums (xc): -shift x each group's codes, shift 128 for VNNI's biased
  // packed 8-bit weights, Q4_0's zero 8.
  const int32_t shift = packed && bits == 8 && VNNI ? 128 : int32_t(zero);
  if (shift && int64_t(xc_buf.size()) < n * nbp * G) xc_buf.resize(n * nbp * G);
  int8_t* xt = xt_buf.data();
  float *xdl = xdl_buf.data(), *xsl = offsets ? xsl_buf.data() : nullptr;
  int32_t* xc = shift ? xc_buf.data() : nullptr;
  // f(bits, G) as constants: (4, 1), (8, 1) or (8, 2).
  auto with_kind = [&](auto f) __attribute__((always_inline)) {
    if (bits == 4) return f(std::integral_constant<int, 4>(), std::integral_constant<int, 1>());
    if (G == 1) return f(std::integral_constant<int, 8>(), std::integral_constant<int, 1>());
    f(std::integral_constant<int, 8>(), std::integral_constant<int, 2>());
  };
#else
  static const auto table4 = row_table<float, 4>(std::make_integer_sequence<int, MR>());
  static const auto table8 = row_table<float, 8>(std::make_integer_sequence<int, MR>());
  const bool packed = false;
#endif
  if (int64_t(xp_buf.size()) < n * in) xp_buf.resize(n * in);
  int8_t* xp = xp_buf.data();
  // Each row's codes and lanes, a row apart from the others: a prefill's rows shared among
  // the threads (on one, the others waited through it), a decode step's on the caller's.
#pragma omp parallel for schedule(static) if (n >= PACKED_ROWS)
  for (int64_t m = 0; m < n; ++m) {
    quantize_rows(x + m * x_stride, x_stride, 1, in, xq + m * in, xd + m * nb, xs + m * nb, 0, nullptr,
                  packed ? nullptr : xp + m * in);
#if defined(__AVX2__)
    transpose_row(xq + m * in, xd + m * nb, xs + m * nb, in, G, packed ? xt + m * nbp * QB : nullptr, xdl + m * nbp,
                  xsl ? xsl + m * nbp : nullptr, xc ? xc + m * nbp * G : nullptr, shift);
#endif
  }
  // Rows a pass takes (MRs): their codes, ~256 KB (up to ~1 MB packed, at the widest rows),
  // stay in L2 while every output's weight row meets them; all of a prefill's rows at once
  // would stream from L3 again for each output.
  const int64_t pass = std::max<int64_t>(packed ? PACKED_PASS : MR, (int64_t(1) << 18) / in / MR * MR);
  for (int64_t k = 0, col = 0; k < num_parts; col += parts[k].rows, ++k) {
    const PartView<S> w(parts[k]);
    for (int64_t r0 = 0; r0 < n; r0 += pass) {
      const int64_t r1 = std::min(n, r0 + pass);
      // Output o's results for rows [m0, m0 + mr).
      auto store = [&](int64_t o, int64_t m0, int mr, const float* res) __attribute__((always_inline)) {
        for (int m = 0; m < mr; ++m) out[(m0 + m) * out_features + col + o] = res[m] + (bias ? bias[col + o] : 0.0f);
      };
#if defined(__AVX2__)
      // A decode step's rows (one pass of MR at most), their weights as stored: a call per span
      // of output rows, whose set-up a narrow row (SmolLM2's 18 blocks) would otherwise pay
      // as often as its products; each row's prefetches bring the next one's first blocks.
      if (!packed && r1 - r0 <= MR) {
        const int mr = int(r1 - r0);
#pragma omp parallel for schedule(static)
        for (int64_t o0 = 0; o0 < w.rows; o0 += SPAN) {
          const int64_t o1 = std::min(w.rows, o0 + SPAN);
          float res[SPAN * MR];
          with_rows(mr, [&](auto m) {
            with_kind([&](auto b, auto g) {
              span_lanes<b(), g(), m()>(w, o0, o1, xq, xp, xdl, xsl, xc, r0, in, res);
            });
          });
          for (int64_t o = o0; o < o1; ++o) store(o, r0, mr, res + (o - o0) * MR);
        }
        continue;
      }
#endif
#pragma omp parallel for schedule(static)
      for (int64_t o0 = 0; o0 < w.rows; o0 += NR) {
        const int nr = int(std::min<int64_t>(NR, w.rows - o0));
#if defined(__AVX2__)
        if (packed) {
          static thread_local std::vector<uint8_t> packed_buf[NR];  // the output rows' weights packed
          const PartView<float> first = row_floats(w, o0, group, in, 0);
          const PartView<float> rows[NR] = {first, nr > 1 ? row_floats(w, o0 + 1, group, in, 1) : first};
          const uint8_t* packs[NR];
          for (int j = 0; j < nr; ++j) {
            packed_buf[j].resize(nbp * QB);
            if (bits == 4)
              pack_row<4>(rows[j], 0, nb, packed_buf[j].data());
            else
              pack_row<8>(rows[j], 0, nb, packed_buf[j].data());
            packs[j] = packed_buf[j].data();
          }
          for (int64_t m0 = r0; m0 < r1; m0 += MR) {
            const int mr = int(std::min<int64_t>(MR, r1 - m0));
            float res[NR][MR];
            with_rows(mr, [&](auto m) {
              with_kind([&](auto b, auto g) {
                if (nr == NR)
                  packed_rows<b(), g(), m(), NR>(rows, packs, xt, xdl, xsl, xc, m0, in, res);
                else
                  packed_rows<b(), g(), m(), 1>(rows, packs, xt, xdl, xsl, xc, m0, in, res);
              });
            });
            for (int j = 0; j < nr; ++j) store(o0 + j, m0, mr, res[j]);
          }
          continue;
        }
#endif
        // One output row at a time, its scales made floats first (row_floats: every pass of MR
        // rows reads them; the same values as stored).
        for (int64_t o = o0; o < o0 + nr; ++o) {
          auto run = [&](const auto& row) __attribute__((always_inline)) {
            for (int64_t m0 = r0; m0 < r1; m0 += MR) {
              const int mr = int(std::min<int64_t>(MR, r1 - m0));
              float res[MR];
#if defined(__AVX2__)
              with_rows(mr, [&](auto m) {
                with_kind([&](auto b, auto g) {
                  rows_lanes<b(), g(), m()>(row, xq, xp, xdl, xsl, xc, m0, in, res);
                });
              });
#else
              (bits == 4 ? table4 : table8)[mr - 1](row, 0, group, int(zero), xq, xp, xd, xs, m0, in, res);
#endif
              store(o, m0, mr, res);
            }
          };
          run(row_floats(w, o, group, in, 0));
        }
      }
    }
  }
#endif
}

// One thread's rounds of 12 independent int8 dot-product chains in registers, the
// instructions the kernels multiply with (below); returns the integer operations done.
int64_t peak_thread(int64_t iters) {
  constexpr int K = 12;  // chains: more than the units' latency times their throughput
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(1), a[K];
  for (int k = 0; k < K; ++k) a[k] = _mm512_set1_epi32(k);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < K; ++k) a[k] = _mm512_dpbusd_epi32(a[k], w, x);
    asm volatile("" : "+v"(w), "+v"(x));  // the operands change as far as the compiler knows
  }
  for (int k = 0; k < K; ++k) asm volatile("" : : "v"(a[k]));
  return iters * K * 128;  // 64 multiply-adds a dpbusd
#elif defined(__AVX2__)
  __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi16(1), a[K];  // x: bytes or madd's ones
  for (int k = 0; k < K; ++k) a[k] = _mm256_set1_epi32(k);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < K; ++k) {
#if defined(CTXPAR_DPBUSD)
      a[k] = CTXPAR_DPBUSD(a[k], w, x);
#else  // each chain's sums as the next round's signed bytes: the pair's latency, as a chain's
      a[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a[k]), x);
#endif
    }
    asm volatile("" : "+v"(w), "+v"(x));
  }
  for (int k = 0; k < K; ++k) asm volatile("" : : "v"(a[k]));
  return iters * K * 64;  // 32 multiply-adds a 256-bit dot product
#else
  (void)iters;
  return 0;
#endif
}

}  // namespace

extern "C" {

// The int8 peak for ctxpar bench: `iters` rounds of 12 independent dot products of
// the kernels' widest kind (AVX-512 VNNI's 512-bit dpbusd; else AVX-VNNI's or AVX2's
// 256-bit maddubs and madd) on every thread of an OpenMP team, nothing else. Returns
// the integer operations done (a multiply and an add each, all threads), 0 on a CPU
// with none of them.
int64_t quant_peak_ops(int64_t iters) {
  int64_t total = 0;
#pragma omp parallel reduction(+ : total)
  total += peak_thread(iters);
  return total;
}


// x (n, in) float32, x_stride floats between rows, in a multiple of 32; the weight
// (out_features, in) as above, the rows of `num_parts` parts one after another (quant_part.h),
// their scales and offsets half if `half`, else float32; zero 0 or 8 (see the top); bias
// (out_features,) or null; out (n, out_features).
void quant_linear_f32(const float* x, int64_t x_stride, int64_t n, int64_t in, const QuantPart* parts,
                      int64_t num_parts, int64_t bits, int64_t group, int64_t half, int64_t zero, const float* bias,
                      float* out) {
  if (n == 0 || num_parts == 0) return;
  if (half)
    quant_linear<Half>(x, x_stride, n, in, parts, num_parts, bits, group, zero, bias, out);
  else
    quant_linear<float>(x, x_stride, n, in, parts, num_parts, bits, group, zero, bias, out);
}

}  // extern "C"
