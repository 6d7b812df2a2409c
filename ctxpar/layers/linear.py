"""Linear projections, with one CPU speed trick: weights packed once after loading.

- **fp32** and **bf16** weights are packed into ctxpar's panel layout
  (kernels/gemv.cpp), which the compiled kernel reads at the speed of oneDNN's
  own packed copy (faster at a decode step's few rows, within ~5% at prefill's
  thousands), bf16 with AVX-512 BF16's dot products where the CPU has them, and
  on CPUs with AMX-BF16 with AMX's tiles for every row count (kernels/bf16_tiles.h:
  prefill level with oneDNN's AMX path, which gives a row other bits by the row
  count; the kernel writes bf16 out). A bf16 decode step reads half the bytes of
  fp32, and takes about half the time (oneDNN's bf16 copy was no faster than fp32
  at decode). Unlike oneDNN's copy, the layout is a plain tensor: the PCP ranks
  of one host can read one copy in shared pages (ctxpar/executor/shared_weights.py).

Weights kept block-quantized (a GGUF loaded with ``quantization="gguf"``)
are ``QuantWeight``s (layers/quant_linear.py); ``linear``, ``embedding``,
``row_parts`` and ``shared_tensors`` take them like the others.

With ``CTXPAR_KERNELS=0`` at load time, fp32 weights (and bf16 where the CPU
has native bf16) are packed by oneDNN instead. Elsewhere (GPUs) weights stay
as loaded and go through ``F.linear``. The packed weight replaces the parameter, so
memory does not grow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ctxpar import kernels
from ctxpar.device import cpu_has_native_bf16
from ctxpar.kernels import panels
from ctxpar.layers.quant_linear import TILE_ROWS, QuantParts, QuantWeight, quant_linear


@dataclass
class PanelWeight:
    """An (out_features, in_features) fp32 or bf16 weight in the kernel's panel layout."""

    data: torch.Tensor  # (ceil(out / NP), in, NP) float32, or (ceil(out / NP), ceil(in / 2), NP, 2) bf16
    out_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PanelWeight:
        out_features, in_features = weight.shape
        width = panels.panel_width()
        if weight.dtype == torch.bfloat16:  # input columns in pairs, an odd last one with a zero
            padded = weight.new_zeros(-(-out_features // width) * width, in_features + in_features % 2)
            padded[:out_features, :in_features] = weight
            pairs = padded.view(-1, width, padded.shape[1] // 2, 2).permute(0, 2, 1, 3)
            return cls(pairs.contiguous(), out_features)
        padded = weight.new_zeros(-(-out_features // width) * width, in_features)
        padded[:out_features] = weight
        return cls(padded.view(-1, width, in_features).transpose(1, 2).contiguous(), out_features)


Weight = torch.Tensor | PanelWeight | QuantWeight | QuantParts


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (n, in) @ weight (out, in)^T + bias -> (n, out), for plain, packed or quantized weights."""
    if isinstance(weight, (QuantWeight, QuantParts)):
        return quant_linear(x, weight, bias)
    if isinstance(weight, PanelWeight):
        if weight.data.dtype == torch.bfloat16 and x.dtype == torch.float32:
            # A GGUF's BF16 weights in a float32 model: the weight the file's bits, x rounded to
            # bf16 (as block-quantized weights round it to int8), the sums and the result float32.
            return panels.linear_packed(x.to(torch.bfloat16), weight.data, weight.out_features, bias)
        return panels.linear_packed(x, weight.data, weight.out_features, bias, out_dtype=x.dtype)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, table: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``ids`` (n,) of an embedding table (plain or quantized) -> (n, dim) in dtype."""
    if isinstance(table, QuantWeight):
        return table.take(ids).to(dtype)
    return F.embedding(ids, table).to(dtype)  # a GGUF's BF16 table in a float32 model: its rows as floats


# Rows of a step through a model's MLP at a time where its products are row-invariant: a long
# prefill's (n, 2I) intermediate would be the step's largest buffer (2K rows of a 1B model: 134 MB).
MLP_ROWS = 512


def row_invariant(weight: Weight) -> bool:
    """Whether ``linear``'s result for a row never depends on the rows beside it: ctxpar's
    kernels' weights (packed panels, block-quantized). PyTorch's GEMMs pick their blocking,
    and so their sums' order, by the number of rows."""
    return isinstance(weight, (PanelWeight, QuantWeight, QuantParts))


def can_pack(weight: Weight) -> bool:
    """Whether ``packed`` changes this weight: on the CPU, fp32 or bf16 (without the
    kernels, bf16 only where the CPU computes it natively: elsewhere oneDNN emulates
    bf16, slowly). Never a quantized one: it is in its kernel's layout already."""
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or weight.is_mkldnn:
        return False  # a GPU's, or packed already (oneDNN's layout: packing it again fails)
    if weight.dtype in (torch.float32, torch.bfloat16) and kernels.available():
        return True
    native = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_has_native_bf16())
    return native and torch.backends.mkldnn.is_available()


def packed(weight: Weight) -> Weight:
    """The packed form of `weight` (out, in): a PanelWeight for fp32 and bf16 with the
    kernels on, oneDNN's layout otherwise where it applies, else `weight` itself."""
    if not can_pack(weight):
        return weight
    assert isinstance(weight, torch.Tensor)
    if weight.dtype in (torch.float32, torch.bfloat16) and kernels.available():
        return PanelWeight.pack(weight.detach())
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), requires_grad=False)


def pack_weight(module: nn.Module, name: str) -> None:
    """Replace `module.<name>` (out, in) by its packed form, in place."""
    weight = packed(getattr(module, name))
    if isinstance(weight, PanelWeight):
        delattr(module, name)  # a plain attribute from here on, no longer a parameter
    setattr(module, name, weight)


class Linear(nn.Linear):
    """nn.Linear (the checkpoint's names: ``weight``, ``bias``) computed by ``linear``. Once
    ``pack_linears`` has packed it (after loading), its CPU product is ctxpar's panel kernel,
    whose result for a row never depends on the rows beside it, where PyTorch's GEMMs pick
    their blocking, and so their summation order, by the number of rows."""

    def reset_parameters(self) -> None:
        """Nothing: every weight comes from the checkpoint. nn.Linear's random fill would
        write 4 bytes a weight that loading then replaces, so a model of quantized experts
        needed float32 memory for all of them while it loaded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def pack_linears(module: nn.Module) -> None:
    """Pack the weight of every ``Linear`` in ``module`` (``pack_weight``)."""
    for m in module.modules():
        if isinstance(m, Linear):
            pack_weight(m, "weight")


def row_parts(weight: Weight, parts: int) -> list[tuple[PanelWeight | QuantWeight, int, int]] | None:
    """A packed or quantized `weight` (out, in) cut into `parts` near-equal ranges of
    output rows, as views: (the range's weight, first row, end row) each; None for
    other weights. Each output computes exactly as uncut: the kernels sum every
    output over the input in one fixed order, whatever the rows around it (a
    PanelWeight is cut between panels; a QuantWeight between the tiles of
    TILE_ROWS rows that the path without kernels dequantizes, so that path
    multiplies the same tiles cut or uncut)."""
    if isinstance(weight, QuantWeight):
        tiles = -(-weight.out_features // TILE_ROWS)
        cuts = [min(weight.out_features, tiles * k // parts * TILE_ROWS) for k in range(parts + 1)]
        return [(weight.rows(lo, hi), lo, hi) for lo, hi in zip(cuts, cuts[1:])]
    if not isinstance(weight, PanelWeight):
        return None
    width, panels = weight.data.shape[2], weight.data.shape[0]
    cuts = [panels * k // parts for k in range(parts + 1)]
    out: list[tuple[PanelWeight | QuantWeight, int, int]] = []
    for lo, hi in zip(cuts, cuts[1:]):
        first = min(lo * width, weight.out_features)
        end = min(hi * width, weight.out_features)
        out.append((PanelWeight(weight.data[lo:hi], end - first), first, end))
    return out


def panel_weights(model: nn.Module) -> list[PanelWeight]:
    """Every PanelWeight held by `model`'s modules, in a fixed order (module
    registration, then attribute order): the same list on every rank."""
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, PanelWeight)]


def shared_tensors(model: nn.Module) -> list[tuple[object, str]]:
    """(holder, attribute) of every tensor of `model`'s packed and quantized weights
    (a PanelWeight's data; a QuantWeight's qs, scales, offsets, and a QuantParts' parts';
    not a file's memory map: ``mapped`` weights are the page cache's, shared already), each weight once
    (tied embeddings hold one), in a fixed order: the same list on every rank."""
    seen: set[int] = set()
    out: list[tuple[object, str]] = []
    for m in model.modules():
        for v in vars(m).values():
            if id(v) in seen:
                continue
            seen.add(id(v))
            if isinstance(v, PanelWeight):
                out.append((v, "data"))
            else:
                parts = v.parts if isinstance(v, QuantParts) else [v] if isinstance(v, QuantWeight) else []
                for w in parts:
                    if not w.mapped:
                        out += [(w, a) for a in ("qs", "scales", "offsets") if getattr(w, a) is not None]
    return out
