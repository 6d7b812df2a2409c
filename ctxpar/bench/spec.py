"""Speculative decoding: decode tokens/s with n-gram drafts against without, at P = 1 and 2.

Two workloads, greedy (so both runs must produce the same tokens, which is
checked):

- copy: the model is asked to repeat a real document of a few thousand tokens
  (Python's own argparse documentation, as ``pydoc`` renders it) and its answer
  has begun doing so: the case prompt lookup is made for;
- free: open-ended prompts, where drafts are rarely right and must not cost
  much.

With ``--draft-layers N`` the drafts come from a draft model instead (method
"draft_model"): the target's own first N layers, its embeddings and head, written
once as a Hugging Face checkpoint (a layer-skip self-draft: the same vocabulary,
no second download).

Decode speed is the tokens after the first over the time after the first token
(the prefill is the same with and without speculation); the fastest of
``--repeat`` runs is kept. At P = 1 both engines (with and without
speculation) are up at once and their runs alternate, so a machine whose load
changes slows both alike; at P > 1 (one group of ranks per process) they run
one after the other.
"""

from __future__ import annotations

import argparse
import json
import pydoc
import shutil
from pathlib import Path

from ctxpar.bench.machine_line import describe_machine
from ctxpar.checks import positive_int
from ctxpar.errors import CtxparError

FREE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "List some ideas for a weekend trip in the mountains, with reasons.",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--pcp", type=positive_int, nargs="+", default=[1, 2], help="PCP sizes to measure")
    p.add_argument("--doc-tokens", type=positive_int, default=1500, help="length of the document to copy")
    p.add_argument("--copy-tokens", type=positive_int, default=128, help="tokens generated on the copy workload")
    p.add_argument("--free-tokens", type=positive_int, default=48, help="tokens generated per free prompt")
    p.add_argument("--repeat", type=positive_int, default=2, help="runs of each workload (the fastest is kept)")
    p.add_argument("--kv-cache-bytes", type=positive_int, default=1 << 29, help="KV cache per rank of each engine")
    p.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 8}',
        help="the speculation measured (JSON, as ctxpar generate takes it)",
    )
    p.add_argument(
        "--draft-layers",
        type=positive_int,
        default=None,
        help="draft with the target's first N layers (method draft_model; k from --speculative-config)",
    )


def _first_layers(model: str | None, layers: int) -> str:
    """A checkpoint of the model's first ``layers`` layers with its embeddings, norm and head
    (in ctxpar's cache if it may be used: ctxpar.paths); its directory."""
    from safetensors.torch import load_file, save_file

    from ctxpar import paths
    from ctxpar.models import gguf
    from ctxpar.models.loader import default_model_path

    path = Path(model) if model is not None else default_model_path()
    source, _ = gguf.gguf_to_hf_dir(path, with_weights=True) if path.is_file() else (path, False)
    out = (paths.cache_dir("first-layers") or paths.temporary_dir("first-layers")) / f"{source.name}.first{layers}"
    why = paths.tree_refusal(out) if out.is_symlink() or out.exists() else None
    if why is not None:
        paths.warn_refused(f"the draft checkpoint {out}", why)
        out = paths.temporary_dir("first-layers") / out.name
    if not (out / "model.safetensors").exists():
        out.mkdir(mode=0o700, exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy(f, out / f.name)
        config = json.loads((source / "config.json").read_text())
        if layers >= config["num_hidden_layers"]:
            raise CtxparError(
                f"--draft-layers {layers}: the model has {config['num_hidden_layers']} layers; pass fewer"
            )
        config["num_hidden_layers"] = layers
        (out / "config.json").write_text(json.dumps(config))
        state = {}
        for f in source.glob("*.safetensors"):
            state.update(load_file(f))
        keep = {k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
        save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
        paths.make_private(out)
    return str(out)


def _document(tokenizer, num_tokens: int) -> str:
    """Real English text (and some code): argparse's documentation, cut at a line to about num_tokens."""
    import argparse as documented

    lines, total = [], 0
    # typeshed lacks pydoc.plaintext, which pydoc defines at import (the renderer of help() without bold)
    for line in pydoc.render_doc(documented, renderer=pydoc.plaintext).splitlines():  # type: ignore[attr-defined]
        total += len(tokenizer.encode(line + "\n", add_special_tokens=False))
        if total > num_tokens:
            break
        lines.append(line)
    return "\n".join(lines)


def _workloads(llm, doc_tokens: int) -> dict[str, list]:
    """The prompts of each workload, rendered with the model's chat template."""
    doc = _document(llm.get_tokenizer(), doc_tokens)
    ask = {"role": "user", "content": f"Repeat the following text exactly, word for word.\n\n{doc}"}
    # The answer starts with the document's first lines, as a copy under way: a 135M model
    # then carries on copying (asked cold, it summarises instead).
    started = {"role": "assistant", "content": doc[: len(doc) // 8]}
    copy = llm.apply_chat_template([ask, started], add_generation_prompt=False, continue_final_message=True)
    free = [llm.apply_chat_template([{"role": "user", "content": p}])[0] for p in FREE_PROMPTS]
    return {"copy": copy, "free": free}


def _run(llm, prompts: list, max_tokens: int) -> tuple[float, list[list[int]], dict[str, int]]:
    """Decode tokens/s of the prompts (one at a time), their tokens, and the drafts' counters."""
    from ctxpar import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens, decode_s, decoded = [], 0.0, 0
    drafts = {"drafts": 0, "drafted": 0, "accepted": 0}
    for prompt in prompts:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics
        assert m.first_token_time is not None and m.finished_time is not None  # a finished request
        decode_s += m.finished_time - m.first_token_time
        decoded += len(out.outputs[0].token_ids) - 1
        tokens.append(list(out.outputs[0].token_ids))
        drafts["drafts"] += m.num_drafts
        drafts["drafted"] += m.num_draft_tokens
        drafts["accepted"] += m.num_accepted_tokens
    return decoded / decode_s, tokens, drafts


def run(args: argparse.Namespace) -> None:
    from ctxpar import LLM

    spec = json.loads(args.speculative_config)
    if args.draft_layers is not None:
        k = spec.get("num_speculative_tokens", 4)
        spec = {
            "method": "draft_model",
            "model": _first_layers(args.model, args.draft_layers),
            "num_speculative_tokens": k,
        }
    print(describe_machine(), flush=True)
    print(f"speculative_config: {spec}", flush=True)
    lengths = {"copy": args.copy_tokens, "free": args.free_tokens}
    print("\n P | workload | off (tok/s) | on (tok/s) | speed-up | acceptance | mean accepted length | identical")
    for pcp in args.pcp:
        common = dict(
            pcp_size=pcp, enable_prefix_caching=False, kv_cache_bytes=args.kv_cache_bytes, quantization="none"
        )
        best: dict[tuple[str, str], tuple[float, list[list[int]], dict[str, int]]] = {}

        def measure(label: str, llm, workloads: dict[str, list]) -> None:
            for name, prompts in workloads.items():
                result = _run(llm, prompts, lengths[name])
                if (label, name) not in best or result[0] > best[label, name][0]:
                    best[label, name] = result

        if pcp == 1:  # both engines at once, runs alternating: a load that comes and goes hits both alike
            with LLM(args.model, **common) as off, LLM(args.model, speculative_config=spec, **common) as on:
                workloads = _workloads(off, args.doc_tokens)
                for _ in range(args.repeat):
                    measure("off", off, workloads)
                    measure("on", on, workloads)
        else:  # one group of ranks per process at a time: one engine after the other
            for label, config in (("off", None), ("on", spec)):
                with LLM(args.model, speculative_config=config, **common) as llm:
                    workloads = _workloads(llm, args.doc_tokens)
                    for _ in range(args.repeat):
                        measure(label, llm, workloads)
        for name in workloads:  # printed as each P finishes: a later failure loses nothing
            (off_rate, off_tokens, _), (on_rate, on_tokens, d) = best["off", name], best["on", name]
            rate = f"{d['accepted'] / d['drafted']:.0%}" if d["drafted"] else "-"
            length = f"{1 + d['accepted'] / d['drafts']:.2f}" if d["drafts"] else "-"
            print(
                f"{pcp:>2} | {name:>8} | {off_rate:>11.1f} | {on_rate:>10.1f} | {on_rate / off_rate:>7.2f}x | "
                f"{rate:>10} | {length:>20} | {'yes' if on_tokens == off_tokens else 'NO'}",
                flush=True,
            )
