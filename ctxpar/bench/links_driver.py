"""One rank of `ctxpar bench links`: run as ``python -m ctxpar.bench.links_driver``,
alone (P = 1) or under torchrun (one process per "host").

Under torchrun every rank first times gloo all-gathers over the link itself (a
small message: the latency; one layer's KV of a prefill step: the bytes each
layer of PCP moves), then builds the engine; rank 0 drives it, the others serve
inside ``LLM()`` and leave when rank 0 closes it. Rank 0 prints one ``RESULT``
line of JSON per prompt length (and ``LINK`` for the link), progress as
``PROGRESS`` lines; the orchestrator (links.py) reads them.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from ctxpar.bench.llm_readings import vocab_size
from ctxpar.costmodel.link_calibration import measure_link

if TYPE_CHECKING:
    from ctxpar import LLM

SLACK = 16  # max_model_len = longest prompt + decode tokens + this


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ctxpar.bench.links_driver")
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", type=int, nargs="+", required=True)
    p.add_argument("--pcp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--chunk", type=int, required=True, help="max_num_batched_tokens")
    p.add_argument("--yarn-factor", type=float, default=1.0)
    return p.parse_args(argv)


def _emit(kind: str, payload: object) -> None:
    print(f"{kind} {json.dumps(payload)}", flush=True)


def kv_bytes_per_token(model: str) -> int:
    """K and V of one layer for one token, fp32 (what a PCP all-gather moves per token)."""
    with open(f"{model}/config.json") as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_key_value_heads"] * head_dim * 4


def prompt_ids(n: int, vocab: int) -> list[int]:
    """The prompt of n tokens every configuration is given (random: a random model's input)."""
    import numpy as np

    return np.random.default_rng(n).integers(0, vocab, n).tolist()


def _measure(llm: LLM, n: int, decode_tokens: int, vocab: int) -> dict[str, object]:
    """TTFT, decode ms/token and the collective time of one prompt of n random tokens."""
    from ctxpar import SamplingParams

    assert llm.engine is not None  # open: inside its with block
    # The PCP group itself, not LLM.get_metrics(): the prefill's all-gathers are counted apart
    # from the other data collectives, which the public metrics sum.
    group = getattr(llm.engine.executor, "group", None)
    prompt = prompt_ids(n, vocab)
    params = SamplingParams(temperature=0, max_tokens=1 + decode_tokens, ignore_eos=True)
    c0 = group.comm_seconds if group else 0.0
    g0 = group.num_collectives["all_gather"] if group else 0
    t0 = time.perf_counter()
    first = None
    for out in llm.stream_outputs({"prompt_token_ids": prompt}, params):
        if first is None:  # the prefill's collectives, apart from the decode's
            first = time.perf_counter() - t0
            comm = (group.comm_seconds - c0) if group else 0.0
            gathers = (group.num_collectives["all_gather"] - g0) if group else 0
    end = time.perf_counter() - t0
    assert first is not None and out.finished
    return {
        "length": n,
        "ttft_s": first,
        "decode_ms": 1e3 * (end - first) / decode_tokens,
        "prefill_comm_s": comm,
        "prefill_all_gathers": gathers,
        "tokens": list(out.outputs[0].token_ids),
    }


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    from ctxpar import LLM
    from ctxpar.parallel.comm import torchrun_env

    env = torchrun_env()
    rank = env.rank if env is not None else 0
    longest = max(args.lengths)
    if env is not None and env.world_size > 1:
        per_token = kv_bytes_per_token(args.model)
        # One layer's all-gather in a prefill step of min(n, chunk) tokens moves each rank's half.
        steps = [-(-min(n, args.chunk) // env.world_size) * per_token for n in args.lengths]
        link = measure_link(steps, env.world_size)
        if rank == 0:
            _emit("LINK", link)
    with open(f"{args.model}/config.json") as f:
        layers = json.load(f)["num_hidden_layers"]
    kv = 2 * layers * (longest + 1024) * kv_bytes_per_token(args.model)  # every layer's KV, twice over
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": args.yarn_factor}} if args.yarn_factor > 1 else None
    with LLM(
        args.model,
        hf_overrides=yarn,
        max_model_len=longest + args.decode_tokens + SLACK,
        pcp_size=args.pcp,
        dcp_size=args.dcp,
        num_threads=1,
        pcp_min_tokens=0,
        enable_prefix_caching=False,  # each prompt is prefilled, never found in the cache
        max_num_batched_tokens=args.chunk,
        kv_cache_bytes=kv,
    ) as llm:  # ranks other than 0 serve in here and exit when rank 0 closes it
        vocab = vocab_size(llm)
        _measure(llm, 256, 2, vocab)  # warm-up: kernels built, buffers allocated
        for n in sorted(args.lengths):
            _emit("PROGRESS", f"P={args.pcp} D={args.dcp}: prefilling {n} tokens")
            _emit("RESULT", _measure(llm, n, args.decode_tokens, vocab))


if __name__ == "__main__":
    main()
