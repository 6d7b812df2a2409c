"""A tiny DeepSeek-V3 checkpoint with a multi-token-prediction layer, and what that layer
drafts computed with transformers' own modules.

transformers' DeepSeek-V3 ignores MTP layers, so the checkpoint is built by hand: the
target's tensors, plus ``model.layers.{L}.*`` (a decoder layer donated by a random
(L + 1)-layer model, the norms, the projection and the embedding). The head is left
out, as the layer then shares the model's ``lm_head``.

The reference runs the layer as a one-layer transformers DeepseekV3 model whose
input embeddings are the MTP's combination of the target's normed states and the
next tokens' embeddings, following vLLM's DeepSeek MTP (embedding first).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def add_mtp_layer(model_dir: Path, out: Path, seed: int = 0, damp: float = 0.25) -> Path:
    """A copy of the tiny DeepSeek-V3 checkpoint at ``model_dir`` with one MTP layer.

    Random layers draft nothing the target agrees with, so both are made to lean on
    the token: every attention and MLP output projection is scaled by ``damp`` (the
    target's logits then mostly follow its last token: a near-bigram model), and the
    layer's projection mostly passes the next token's embedding, with its output norm
    the target's final one (so it drafts what the target would say after that token).
    Attention still shapes every token, so the drafts are right often, not always.
    """
    from transformers import AutoConfig

    from helpers.deepseek_configs import save_tiny_deepseek

    config = AutoConfig.from_pretrained(model_dir)
    L, H = config.num_hidden_layers, config.hidden_size
    donor = copy.deepcopy(config)
    donor.num_hidden_layers = L + 1
    donor_dir = save_tiny_deepseek(donor, out.parent / f"{out.name}_donor", seed=seed + 1)
    state = _state(model_dir)
    prefix = f"model.layers.{L}."
    state.update({k: v for k, v in _state(donor_dir).items() if k.startswith(prefix)})
    for k in state:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            state[k] = state[k] * damp
    g = torch.Generator().manual_seed(seed)
    state[prefix + "enorm.weight"] = torch.ones(H)
    state[prefix + "hnorm.weight"] = 1 + 0.2 * torch.randn(H, generator=g)
    state[prefix + "eh_proj.weight"] = torch.cat([torch.eye(H), 0.1 * torch.randn(H, H, generator=g)], dim=1)
    state[prefix + "shared_head.norm.weight"] = state["model.norm.weight"].clone()
    state[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    out.mkdir()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((model_dir / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(raw))
    return out


class MTPReference:
    """The target (transformers) and the MTP layer (a one-layer transformers model)."""

    def __init__(self, mtp_dir: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(mtp_dir, dtype=torch.float32).eval()
        config = AutoConfig.from_pretrained(mtp_dir)
        L = config.num_hidden_layers
        state = _state(mtp_dir)
        prefix = f"model.layers.{L}."
        self.eps = config.rms_norm_eps
        self.embed = state[prefix + "embed_tokens.weight"]
        self.enorm, self.hnorm = state[prefix + "enorm.weight"], state[prefix + "hnorm.weight"]
        self.eh_proj = state[prefix + "eh_proj.weight"]
        layer_dir = mtp_dir.parent / f"{mtp_dir.name}_layer"
        if not layer_dir.exists():
            mtp_only = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
            block = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            one = {f"model.layers.0.{k}": v for k, v in block.items() if not k.startswith(mtp_only)}
            one["model.embed_tokens.weight"] = self.embed
            one["model.norm.weight"] = state[prefix + "shared_head.norm.weight"]
            one["lm_head.weight"] = state["lm_head.weight"]
            layer_dir.mkdir()
            save_file(one, layer_dir / "model.safetensors", metadata={"format": "pt"})
            raw = json.loads((mtp_dir / "config.json").read_text())
            raw.update(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)  # layer 0: MoE
            (layer_dir / "config.json").write_text(json.dumps(raw))
        self.layer = AutoModelForCausalLM.from_pretrained(layer_dir, dtype=torch.float32).eval()

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    @torch.no_grad()
    def drafts(self, known: list[int], k: int) -> list[int]:
        """The k greedy drafts for known tokens t_0 .. t_{n-1}: the layer over
        (h_i, t_{i+1}) for i <= n - 2, then over (its own last state, the last draft)."""
        ids = torch.tensor([known])
        h = self.target.model(input_ids=ids[:, :-1]).last_hidden_state[0]  # (n - 1, H) normed
        tokens = list(known[1:])
        states = list(h)
        drafts: list[int] = []
        captured: list[torch.Tensor] = []
        hook = self.layer.model.layers[0].register_forward_hook(
            lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o)
        )
        try:
            for _ in range(k):
                e = self._norm(self.embed[torch.tensor(tokens)], self.enorm)
                x = torch.cat([e, self._norm(torch.stack(states), self.hnorm)], dim=-1) @ self.eh_proj.T
                captured.clear()
                logits = self.layer(inputs_embeds=x[None]).logits[0, -1]
                drafts.append(int(torch.argmax(logits)))
                g = captured[0].reshape(len(tokens), -1)[-1]  # the layer's output state, before the norm
                tokens.append(drafts[-1])
                states.append(g)
        finally:
            hook.remove()
        return drafts
