"""bf16 weights (issue 9 item 4) against transformers run in bf16 on the same
checkpoint, with a bf16-sized tolerance: both round every op to 8 mantissa
bits, in different orders, so logits agree to a few bf16 steps of their scale,
and the argmax agrees wherever the top-2 gap is wider than that."""

from __future__ import annotations

import torch

from ctxpar.layers.linear import PanelWeight
from ctxpar.models.loader import load_model
from helpers.reference import SingleSequence


def test_bf16_prefill_and_decode_match_transformers_bf16(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    d = tiny_model_dirs["llama"]
    ours = load_model(str(d), torch.bfloat16, torch.device("cpu")).model
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="eager").eval()
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(3))
    seq = SingleSequence(ours, 32, torch.bfloat16)
    got = torch.cat([seq.step(ids[:20]), seq.step(ids[20:21]), seq.step(ids[21:22])])  # prefill, then 2 decodes
    with torch.no_grad():
        want = ref(ids[None, :22]).logits[0].float()
    scale = want.abs().max()
    assert (got - want).abs().max() <= 0.03 * scale, ((got - want).abs().max(), scale)
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.06 * scale
    assert clear.any()
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    # the projections ran on the kernel's bf16 panels (gemv.cpp)
    assert isinstance(ours.layers[0].self_attn.qkv_weight, PanelWeight)
