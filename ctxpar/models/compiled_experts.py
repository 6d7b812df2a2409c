"""The compiled decode loop's records of weights (kernels/decode_loop.cpp's ``Projection`` and
``Experts``): a projection's weight and bias as pointers the loop reads in place, and a layer of
experts (layers/moe.py's MoE) as ``DecoderExperts`` describes it for the loop
(models/compiled_decode.py builds both into its layers' records)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, cast

import torch

from ctxpar.layers.linear import PanelWeight, Weight
from ctxpar.layers.moe import GatedMLP, MoE
from ctxpar.layers.quant_linear import QuantParts, QuantWeight

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class ProjectionRecord(ctypes.Structure):
    """decode_loop.cpp's Projection."""

    _fields_ = [
        ("data", _ptr),  # the weight's QuantParts (kernels/quant_part.h), or fp32 panels
        ("num_parts", _i64),
        ("bias", _ptr),
        ("in_", _i64),
        ("out", _i64),
        ("bits", _i64),
        ("group", _i64),
        ("half", _i64),
        ("zero", _i64),
    ]


class ExpertsRecord(ctypes.Structure):
    """decode_loop.cpp's Experts."""

    _fields_ = [
        ("router", ProjectionRecord),
        ("expert", _ptr),  # ProjectionRecord[count][3]: gate, up, down
        ("count", _i64),
        ("top_k", _i64),
        ("renorm", _i64),
        ("inter", _i64),
        ("scaling", ctypes.c_float),
        ("shared", _ptr),  # ProjectionRecord[3]; null: no shared expert
        ("shared_inter", _i64),
        ("shared_gate", _ptr),  # ProjectionRecord; null: no gate
    ]


def address(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer, or None (a null pointer to ctypes)."""
    return None if t is None else t.data_ptr()


def projection_record(weight: Weight, bias: torch.Tensor | None) -> ProjectionRecord | None:
    """The loop's record of one projection, or None for a weight it does not read."""
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    if isinstance(weight, (QuantWeight, QuantParts)) and not weight.spread:  # the loop does not spread x
        return ProjectionRecord(
            ctypes.addressof(weight.kernel_parts),
            len(weight.kernel_parts),
            address(bias),
            weight.in_features,
            weight.out_features,
            weight.bits,
            weight.group,
            int(weight.half),
            weight.zero,
        )
    if isinstance(weight, PanelWeight) and weight.data.dtype == torch.float32:
        in_features = weight.data.shape[1]  # fp32 panels: (panels, in, panel width)
        return ProjectionRecord(address(weight.data), 0, address(bias), in_features, weight.out_features, 0, 0, 0, 0)
    if isinstance(weight, PanelWeight) and weight.data.dtype == torch.bfloat16:  # a GGUF's BF16 weight: bits 16
        pairs = weight.data.shape[1]  # bf16 panels: (panels, ceil(in / 2), panel width, 2)
        return ProjectionRecord(address(weight.data), 0, address(bias), 2 * pairs, weight.out_features, 16, 0, 0, 0)
    return None


Projection = tuple[Weight, torch.Tensor | None]  # a weight and its bias (None: none)
ExpertMLP = tuple[Projection, Projection, Projection]  # gate, up, down: down(silu(gate(x)) * up(x))


def _projections(pairs: list[Projection], kept: list[Any]) -> int | None:
    """The address of a ProjectionRecord array of ``pairs`` (appended to ``kept``), or None where one
    is a weight the loop does not read."""
    records = [r for r in (projection_record(*p) for p in pairs) if r is not None]
    if len(records) < len(pairs):
        return None
    kept.append((ProjectionRecord * len(records))(*records))
    return ctypes.addressof(kept[-1])


def experts_record(e: DecoderExperts, kept: list[Any]) -> int | None:
    """The address of the loop's record of ``e`` (appended to ``kept`` with its arrays), or None
    where the loop does not run it."""
    router = projection_record(e.router, None)
    routed = _projections([p for mlp in e.experts for p in mlp], kept)
    shared = None if e.shared is None else _projections(list(e.shared), kept)
    gate = None if e.shared_gate is None else _projections([e.shared_gate], kept)
    unread = (e.shared is not None and shared is None) or (e.shared_gate is not None and gate is None)
    if not e.loop_runs or router is None or routed is None or unread:
        return None
    sizes = (len(e.experts), e.top_k, int(e.renorm), e.inter, e.scaling)
    record = ExpertsRecord(router, routed, *sizes, shared, e.shared_inter, gate)
    kept.append(record)
    return ctypes.addressof(record)


@dataclass(frozen=True, repr=False)
class DecoderExperts:
    """A mixture of experts in a decoder layer's MLP place (layers/moe.py's MoE), as the loop
    runs it: softmax routing to the ``top_k`` best experts (``renorm``: their weights summed to
    1), each expert's output times its weight added in ascending expert order, then the shared
    expert's, times sigmoid(``shared_gate``) where it has one."""

    router: Weight  # (count, hidden) float32
    experts: list[ExpertMLP]
    top_k: int
    renorm: bool
    scaling: float  # the routed weights' factor
    inter: int  # each expert's width
    shared: ExpertMLP | None = None
    shared_inter: int = 0
    shared_gate: Projection | None = None  # (1, hidden)
    loop_runs: bool = True  # False: routing other than greedy softmax, or experts not SiLU's

    @classmethod
    def of(cls, moe: MoE) -> DecoderExperts:
        """``moe``'s experts, as the loop runs them where ``loop_runs``."""
        routed = cast(list[GatedMLP], list(moe.experts))
        shared = moe.shared_experts
        silu = all(e.hidden_act in ("silu", "swish") for e in [*routed, *([] if shared is None else [shared])])

        def mlp(e: GatedMLP) -> ExpertMLP:
            gate, up, down = e.gate_proj, e.up_proj, e.down_proj
            return (gate.weight, gate.bias), (up.weight, up.bias), (down.weight, down.bias)

        gate = moe.shared_expert_gate
        return cls(
            router=moe.gate.weight,
            experts=[mlp(e) for e in routed],
            top_k=moe.gate.top_k,
            renorm=moe.gate.norm_topk_prob,
            scaling=moe.gate.routed_scaling_factor,
            inter=routed[0].down_proj.in_features,
            shared=None if shared is None else mlp(shared),
            shared_inter=0 if shared is None else shared.down_proj.in_features,
            shared_gate=None if gate is None else (gate.weight, gate.bias),
            loop_runs=silu and moe.gate.method == "greedy",
        )
