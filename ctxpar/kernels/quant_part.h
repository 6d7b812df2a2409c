// Where a block-quantized weight's bytes lie, as the quantized kernels read them.
//
// A weight's rows hold blocks of 32 weights: integers q (16 bytes of nibbles or 32
// int8), a scale per group of 16 or 32 and an optional offset per block (the form of
// quant_gemv.cpp's top). Each of the three is reached through strides, so that one
// kernel reads both layouts a weight comes in:
//
//   ctxpar's own (layers/quant_linear.py), the three in tensors of their own:
//     q  [row o][block b][16|32 bytes]   q_row = in * bits / 8, q_block = 32 * bits / 8
//     scales [row o][group j]            s_row = in / group,    s_col = 1
//     offsets [row o][block b]           o_row = in / 32,       o_col = 1
//
//   a GGUF file's blocks where the file's memory map holds them (Q4_0, Q4_1, Q8_0:
//   d, [m,] q per block, no copy), the three interleaved a block apart:
//     | d | q[16 or 32] | d | q ... |     q_block = 18 (Q4_0) or 34 (Q8_0); s_col the same in halves
//     | d | m | q[16]   | d | m | q ... | Q4_1: 20 bytes a block, m the offset
//
// A fused projection (QKV, gate|up) is a list of parts, one weight each, whose
// outputs lie side by side in the output rows: its parts stay where they are.

#pragma once

#include <cstdint>

#include "half.h"

constexpr int64_t QB = 32;  // weights per block

extern "C" {
// One part of a projection: `rows` output rows; scales and offsets float32 or half (the
// call says which), offsets null where the weight has none.
struct QuantPart {
  const uint8_t* q;
  const void* scales;
  const void* offsets;
  int64_t rows, q_row, q_block, s_row, s_col, o_row, o_col;
};
}

// A part with its scales' type: S float or Half.
template <typename S>
struct PartView {
  const uint8_t* q;
  const S* s;
  const S* o;
  int64_t rows, q_row, q_block, s_row, s_col, o_row, o_col;

  explicit PartView(const QuantPart& p)
      : q(p.q), s(static_cast<const S*>(p.scales)), o(static_cast<const S*>(p.offsets)), rows(p.rows),
        q_row(p.q_row), q_block(p.q_block), s_row(p.s_row), s_col(p.s_col), o_row(p.o_row), o_col(p.o_col) {}

  const uint8_t* block(int64_t row, int64_t b) const { return q + row * q_row + b * q_block; }
  // The part from block b of each row on (of 32 weights; scales per `group`): a slice of its columns.
  PartView from_block(int64_t b, int64_t group) const {
    PartView v = *this;
    v.q += b * q_block;
    v.s += b * (32 / group) * s_col;
    if (o) v.o += b * o_col;
    return v;
  }
  // Output row `row` alone, as row 0 of the view.
  PartView at_row(int64_t row) const {
    PartView v = *this;
    v.q += row * q_row;
    v.s += row * s_row;
    if (o) v.o += row * o_row;
    return v;
  }
  float scale(int64_t row, int64_t j) const { return to_float(s[row * s_row + j * s_col]); }
  float offset(int64_t row, int64_t b) const { return to_float(o[row * o_row + b * o_col]); }
};
