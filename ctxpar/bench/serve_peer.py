"""`ctxpar bench serve --peer-python PY`: `ctxpar serve` against vLLM's OpenAI server
under the same load, in one run.

Both servers run at once on loopback (vLLM's from ``--peer-python``, its CPU build,
with ``--peer-dtype``; ctxpar's with ``--quantization``, ctxpar's default when not
given; ``--threads N``: each on N cores), neither with a prefix cache. Each level of
the sweep runs on ctxpar, then on the peer, so the ratios compare runs made under
the same load: C client threads send streamed /v1/completions with ``ignore_eos`` and
the servers' default sampling (the seeded prompts of random token ids in turn), each
a new request as soon as its last one ends, for ``--seconds``. A level is measured
as guidellm measures one: over the requests that end after the first ``--warmup``
seconds and before the last ``--cooldown`` (the steady state of C streams, not the
ramp up or down), requests/s as their number over that window, TTFT p50 / p90 and
ITL p50 over them. Printed per level and server with the 1-minute load average;
then ctxpar / peer.

With ``--guidellm-venv`` guidellm runs the same level after each of them (its
synthetic text prompts of the same lengths, C streams, the same seconds, warm-up and
cool-down): its own figures are printed beneath ours, then guidellm / ours and the
CPU each client used (the clients share the CPU with the servers: a client that
takes more of it leaves a server less).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ctxpar.bench.compare import PEER_ENV, model_dir
from ctxpar.bench.server_process import (
    Timing,
    free_port,
    percentile,
    start_server,
    stream_completion,
    sweep_level,
    wait_healthy,
)

NAME = "ctxpar"  # the model name both servers answer to


@dataclass(frozen=True)
class LevelFigures:
    """One server at one concurrency."""

    requests: int
    req_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float

    def row(self, label: str, load: float | None) -> str:
        tail = f" {load:5.1f}" if load is not None else ""
        return (
            f"{label:<18} {self.requests:4d} {self.req_s:6.2f} "
            f"{self.ttft_p50_ms:8.0f}/{self.ttft_p90_ms:<8.0f} {self.itl_p50_ms:7.1f}{tail}"
        )


def summarize(timings: list[Timing], start: float, end: float) -> LevelFigures | None:
    """The requests whose last token arrived in [start, end]: their number over the window,
    their TTFT p50 / p90 and ITL p50, a request's ITL its mean gap between tokens,
    (last - first) / (tokens - 1), as guidellm defines both. None if none did (a request
    outlasts the level: on a slow CPU, many streams), so that the other levels still count."""
    done = [t for t in timings if t.arrivals and start <= t.arrivals[-1] <= end]
    if not done:
        return None
    itl = [(t.arrivals[-1] - t.arrivals[0]) / (len(t.arrivals) - 1) for t in done if len(t.arrivals) > 1]
    ttft = [t.ttft for t in done]
    return LevelFigures(
        len(done), len(done) / (end - start), percentile(ttft, 50) * 1e3, percentile(ttft, 90) * 1e3,
        percentile(itl, 50) * 1e3,
    )  # fmt: skip


def guidellm_figures(report: dict) -> LevelFigures:
    """The same figures from guidellm's JSON report of one benchmark: its requests/s (the
    successful requests that ended in its measured window, over the window), its TTFT and
    ITL distributions' p50 / p90."""
    [bench] = report["benchmarks"]
    m = bench["metrics"]
    req_s = m["requests_per_second"]["successful"]["mean"]
    ttft = m["time_to_first_token_ms"]["successful"]["percentiles"]
    itl = m["inter_token_latency_ms"]["successful"]["percentiles"]
    return LevelFigures(round(req_s * bench["duration"]), req_s, ttft["p50"], ttft["p90"], itl["p50"])


def ratio_line(ours: LevelFigures, peer: LevelFigures) -> str:
    return (
        f"req/s {ours.req_s / peer.req_s:.2f}x, TTFT p50 {ours.ttft_p50_ms / peer.ttft_p50_ms:.2f}x, "
        f"p90 {ours.ttft_p90_ms / peer.ttft_p90_ms:.2f}x, ITL p50 {ours.itl_p50_ms / peer.itl_p50_ms:.2f}x"
    )


def start_vllm(python: str, hf_dir: str, port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    """vLLM's OpenAI server on loopback, as ``bench compare`` runs its CPU build here; its
    output goes to ``log`` (a pipe nobody reads would fill and stall it)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model", hf_dir, "--served-model-name", NAME, "--dtype", args.peer_dtype]
    cmd += ["--max-model-len", str(args.max_prompt_len + args.output_len + 16), "--no-enable-prefix-caching"]
    env = {**os.environ, **PEER_ENV}
    if args.threads:  # as many cores as ctxpar's threads
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return wait_healthy(proc, port, f"vLLM's server (its log: {log})", timeout=600)


def run_guidellm(venv: str, url: str, tokenizer: Path, streams: int, args: argparse.Namespace, out: Path) -> dict:
    """guidellm at ``streams`` concurrent streams, streamed /v1/completions; its JSON report."""
    from ctxpar.bench.clients import run_client

    backend = f"kind=openai_http,target={url},model={NAME},request_format=/v1/completions"
    data = f"kind=synthetic_text,prompt_tokens={args.max_prompt_len},output_tokens={args.output_len}"
    cmd = [str(Path(venv) / "bin" / "guidellm"), "run", "--backend", backend, "--data", data]
    cmd += ["--profile", f"kind=concurrent,streams={streams},warmup={args.warmup},cooldown={args.cooldown}"]
    cmd += ["--constraint", f"kind=max_duration,seconds={args.seconds}"]
    cmd += ["--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--output", f"kind=json,path={out}"]
    cmd += ["--disable-console-interactive"]
    run_client(cmd, out.with_suffix(".log"), timeout=args.timeout)
    return json.loads(out.read_text())


def children_cpu() -> float:
    """CPU seconds of this process's ended children and theirs (a guidellm run, its workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from ctxpar.bench.machine_line import describe_machine
    from ctxpar.bench.throughput import make_prompts

    print(describe_machine())
    hf_dir, vocab = model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompts = make_prompts(tokenizer, vocab, args.num_prompts, args.min_prompt_len, args.max_prompt_len, args.seed)
    work = Path(tempfile.mkdtemp(prefix="ctxpar_bench_serve_"))
    tokenizer.save_pretrained(work / "tokenizer")  # guidellm sizes its prompts with it
    # No temperature: each server's default sampling, as guidellm's requests have it.
    body = {"model": NAME, "max_tokens": args.output_len, "ignore_eos": True, "stream": True}
    bodies = [{**body, "prompt": p, "return_token_ids": True} for p in prompts]
    quant = args.quantization or "ctxpar's default"
    print(
        f"{args.seconds} s a level (measured: {args.warmup} s in to {args.cooldown} s before the end) of "
        f"{len(prompts)} prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens x {args.output_len}; "
        f"ctxpar: quantization {quant}; vLLM: {args.peer_dtype}"
    )
    ports = {"ctxpar": free_port(), "vLLM": free_port()}
    extra = ("--no-prefix-caching", "--served-model-name", NAME)
    procs = [start_server(args, ports["ctxpar"], extra, quantization=args.quantization)]
    try:
        procs.append(start_vllm(args.peer_python, hf_dir, ports["vLLM"], args, work / "vllm.log"))
        for port in ports.values():
            stream_completion("127.0.0.1", port, {**bodies[0], "max_tokens": 2}, timeout=300)  # warm-up
        print(f"{'C  server':<18} reqs  req/s  TTFT p50/p90 ms    ITL p50  load")
        deadline = time.monotonic() + args.timeout
        for c in args.concurrency:
            figures = {}
            for name, port in ports.items():
                cpu = time.process_time()  # this process runs nothing but the client threads meanwhile
                timings, t0 = sweep_level("127.0.0.1", port, bodies, c, deadline, seconds=args.seconds)
                ours_cpu = (time.process_time() - cpu) / (time.perf_counter() - t0)
                level = summarize(timings, t0 + args.warmup, t0 + args.seconds - args.cooldown)
                if level is None:
                    print(f"{c:<2d} {name:<15} no request ended inside the measured window: lengthen --seconds")
                    continue
                figures[name] = level
                print(level.row(f"{c:<2d} {name}", os.getloadavg()[0]), flush=True)
                if args.guidellm_venv:
                    url = f"http://127.0.0.1:{port}"
                    cpu, start = children_cpu(), time.perf_counter()
                    report = run_guidellm(
                        args.guidellm_venv, url, work / "tokenizer", c, args, work / f"{name}_{c}.json"
                    )
                    their_cpu = (children_cpu() - cpu) / (time.perf_counter() - start)
                    theirs = guidellm_figures(report)
                    print(theirs.row(f"{c:<2d}   guidellm", os.getloadavg()[0]), flush=True)
                    print(
                        f"{c:<2d}   guidellm/ours: {ratio_line(theirs, figures[name])} "
                        f"(the clients' CPU: guidellm {their_cpu:.2f} cores, ours {ours_cpu:.2f})",
                        flush=True,
                    )
            if len(figures) == len(ports):
                print(f"{c:<2d} ctxpar/vLLM: {ratio_line(figures['ctxpar'], figures['vLLM'])}", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
