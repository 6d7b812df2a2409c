"""The int8 cache's decode scores as paged_decode.cpp computes them, integer dot products
of the keys' codes with q quantized to int16 (its quantize_query), checked against
float64 attention with q rounded by the same rule and with q exact."""

from __future__ import annotations

import math

import numpy as np
import torch

from helpers.attention_reference import TOL, reference

LOG2E = float(np.float32(math.log2(math.e)))  # the kernel's float32 log2(e): scores are in log2 units
QMAX = 32767  # an int16 code's largest magnitude


def rounded_query(q: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H, D) as the integer path computes with it, in float64 and log2 units: x = q * scale
    * log2(e) in float32, codes round(x / max|x| * 32767) (ties to even) times max|x| / 32767,
    the scale of each row and head (written here from that rule, not from the kernel)."""
    x = q.float() * np.float32(np.float32(scale) * np.float32(LOG2E))
    top = x.abs().amax(-1, keepdim=True)
    codes = torch.where(top > 0, torch.round(x / top * QMAX), 0.0)
    return codes.double() * (top / QMAX).double()


def check_int8_row(
    got: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> None:
    """One row's (out (H, Dv), lse (H)) over int8 keys k, values v (S, Hk, D, float64,
    dequantized) against float64 attention, twice:
    - with q rounded as the kernel rounds it: only float32's rounding differs (TOL);
    - with q exact: rounding x = q * scale * log2(e) to codes moves each value by at most
      half a code, max|x| / 65534 (plus float32's rounding of x / max|x| * 32767, under
      2^-9 of a code), so key s's score moves by at most E_s = that times ||k_s||_1
      (natural units: / log2(e)). With E = max_s E_s, every weight p_s e^(d_s) / sum_t
      p_t e^(d_t) (|d| <= E) is within a factor e^(+-2E) of p_s: out moves by at most
      (e^(2E) - 1) max_s |v_s| and lse by at most E."""
    out, lse = got
    want, want_lse = reference(rounded_query(q[None], scale), k, v, 1 / LOG2E)
    torch.testing.assert_close(out.double(), want[0], **TOL)
    torch.testing.assert_close(lse.double(), want_lse[0], **TOL)

    out_bound, lse_bound = query_rounding_bounds(q, k, v, scale)
    exact, exact_lse = reference(q[None], k, v, scale)
    assert ((out.double() - exact[0]).abs() <= out_bound[:, None] + 1e-5).all()
    assert ((lse.double() - exact_lse[0]).abs() <= lse_bound + 1e-5).all()


def query_rounding_bounds(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(H,) bounds on how far one row's out and lse (query q (H, D) over keys k and values v
    (S, Hk, D)) lie from exact attention when the scores take q rounded to int16 per head:
    (e^(2E) - 1) max|v| and E, with E as check_int8_row derives it. A soft cap and a window
    only shrink or drop the scores' moves, so the bounds hold under them too."""
    g = q.shape[0] // k.shape[1]
    top = (q.double() * scale * LOG2E).abs().amax(-1)  # (H,) max|x| of each head
    per_value = top / (2 * QMAX) * (1 + 2**-9)
    l1 = k.double().abs().sum(-1).repeat_interleave(g, dim=1)  # (S, H) ||k_s||_1 of each query head's keys
    E = (per_value[None] * l1).amax(0) / LOG2E  # (H,)
    vmax = v.double().abs().amax((0, 2)).repeat_interleave(g)  # (H,)
    return (torch.exp(2 * E) - 1) * vmax, E
