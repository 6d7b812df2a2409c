"""Speculative decoding: decode tokens/s with n-gram drafts against without, at P = 1 and 2.

Two workloads, greedy (so both runs must produce the same tokens, which is
checked):

- copy: the model is asked to repeat a real document of a few thousand tokens
  (Python's own argparse documentation, as ``pydoc`` renders it), the case
  prompt lookup is made for;
- free: open-ended prompts, where drafts are rarely right and must not cost
  much.

Decode speed is the tokens after the first over the time after the first token
(the prefill is the same with and without speculation). Each configuration is
a fresh engine.
"""

from __future__ import annotations

import argparse
import json
import pydoc
import time

from ctxpar.bench.machine import describe_machine
from ctxpar.checks import positive_int

FREE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "List some ideas for a weekend trip in the mountains, with reasons.",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--pcp", type=positive_int, nargs="+", default=[1, 2], help="PCP sizes to measure")
    p.add_argument("--doc-tokens", type=positive_int, default=2000, help="length of the document to copy")
    p.add_argument("--copy-tokens", type=positive_int, default=256, help="tokens generated on the copy workload")
    p.add_argument("--free-tokens", type=positive_int, default=128, help="tokens generated per free prompt")
    p.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}',
        help="the speculation measured (JSON, as ctxpar generate takes it)",
    )


def _document(tokenizer, num_tokens: int) -> str:
    """Real English text (and some code): argparse's documentation, cut at a line to about num_tokens."""
    import argparse as documented

    lines, total = [], 0
    for line in pydoc.render_doc(documented, renderer=pydoc.plaintext).splitlines():
        total += len(tokenizer.encode(line + "\n", add_special_tokens=False))
        if total > num_tokens:
            break
        lines.append(line)
    return "\n".join(lines)


def _run(llm, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]], dict]:
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
    print(describe_machine(), flush=True)
    print(f"speculative_config: {spec}", flush=True)
    rows = []
    for pcp in args.pcp:
        results = {}
        for label, config in (("off", None), ("on", spec)):
            t0 = time.perf_counter()
            with LLM(args.model, pcp_size=pcp, speculative_config=config, enable_prefix_caching=False) as llm:
                chat = lambda text: llm.apply_chat_template([{"role": "user", "content": text}])[0]
                doc = _document(llm.get_tokenizer(), args.doc_tokens)
                copy = [chat(f"Repeat the following text exactly, word for word.\n\n{doc}")]
                free = [chat(p) for p in FREE_PROMPTS]
                llm.generate([chat("Hi")], use_tqdm=False)  # warm up
                results[label] = {
                    "copy": _run(llm, copy, args.copy_tokens),
                    "free": _run(llm, free, args.free_tokens),
                }
            print(f"measured P={pcp} speculation {label} ({time.perf_counter() - t0:.0f} s)", flush=True)
        for workload in ("copy", "free"):
            off, on = results["off"][workload], results["on"][workload]
            rows.append((pcp, workload, off[0], on[0], on[2], on[1] == off[1]))
    print("\n P | workload | off (tok/s) | on (tok/s) | speed-up | acceptance | mean accepted length | identical")
    for pcp, workload, off, on, d, same in rows:
        rate = f"{d['accepted'] / d['drafted']:.0%}" if d["drafted"] else "-"
        length = f"{1 + d['accepted'] / d['drafts']:.2f}" if d["drafts"] else "-"
        print(
            f"{pcp:>2} | {workload:>8} | {off:>11.1f} | {on:>10.1f} | {on / off:>7.2f}x | {rate:>10} | "
            f"{length:>20} | {'yes' if same else 'NO'}"
        )
