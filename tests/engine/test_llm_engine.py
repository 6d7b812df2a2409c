"""vLLM's engine layer over ctxpar (issue 24): LLMEngine and EngineArgs, output
kinds, get_metrics, reset_prefix_cache, set_tokenizer, SamplingParams.from_optional.
The references are ctxpar's own LLM.generate (itself tested against
transformers) and counts derived here from what each test sends."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import subprocess
import sys
import textwrap
import weakref

import pytest

from ctxpar import LLM, EngineArgs, LLMEngine, SamplingParams, TokensPrompt
from ctxpar.engine.metrics import Counter, Gauge, Histogram
from ctxpar.errors import CtxparError
from ctxpar.sampling_params import RequestOutputKind
from helpers.tiny_tokenizer import with_byte_tokenizer

SMALL = dict(max_model_len=128, kv_cache_bytes=1 << 22)
PROMPTS = ["Hello, my name is", "The capital of France is", "ab", "To be or not to be, that is the question"]


@pytest.fixture(scope="module")
def text_dir(tiny_model_dirs, tmp_path_factory):
    return str(with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("llm_engine") / "llama_bytes"))


@pytest.fixture(scope="module")
def engine(text_dir):
    eng = LLMEngine.from_engine_args(EngineArgs(model=text_dir, **SMALL))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(text_dir):
    """LLM.generate's outputs of PROMPTS, greedy, 6 and 9 tokens, n = 1 and 2 (seeded)."""
    with LLM(text_dir, **SMALL) as llm:
        return {
            "greedy": llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False),
            "n2": llm.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=9), use_tqdm=False),
        }


def run(engine: LLMEngine, requests: list[tuple[str, object, SamplingParams]]) -> dict[str, list]:
    """vLLM's llm_engine_example loop: add, step until done; every output by request id."""
    outs: dict[str, list] = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


@pytest.mark.multiprocess
def test_vllm_llm_engine_example_runs_as_written(text_dir, tmp_path):
    """examples/offline_inference/llm_engine_example.py, only the imports changed."""
    script = tmp_path / "llm_engine_example.py"
    script.write_text(
        textwrap.dedent(
            """
            from ctxpar import EngineArgs, LLMEngine, RequestOutput, SamplingParams
            from ctxpar.utils import FlexibleArgumentParser


            def create_test_prompts() -> list[tuple[str, SamplingParams]]:
                return [
                    (
                        "A robot may not injure a human being",
                        SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1),
                    ),
                    ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
                    (
                        "What is the meaning of life?",
                        SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1),
                    ),
                ]


            def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]):
                request_id = 0
                print("-" * 50)
                while test_prompts or engine.has_unfinished_requests():
                    if test_prompts:
                        prompt, sampling_params = test_prompts.pop(0)
                        engine.add_request(str(request_id), prompt, sampling_params)
                        request_id += 1
                    request_outputs: list[RequestOutput] = engine.step()
                    for request_output in request_outputs:
                        if request_output.finished:
                            print(request_output)
                            print("-" * 50)


            def initialize_engine(args) -> LLMEngine:
                engine_args = EngineArgs.from_cli_args(args)
                return LLMEngine.from_engine_args(engine_args)


            def parse_args():
                parser = FlexibleArgumentParser(description="Demo on using the LLMEngine class directly")
                parser = EngineArgs.add_cli_args(parser)
                return parser.parse_args()


            def main(args):
                engine = initialize_engine(args)
                test_prompts = create_test_prompts()
                process_requests(engine, test_prompts)


            if __name__ == "__main__":
                args = parse_args()
                main(args)
            """
        )
    )
    cmd = [sys.executable, str(script), "--model", text_dir, "--max_model_len", "128", "--kv-cache-bytes", "4194304"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    finished = [line for line in done.stdout.splitlines() if line.startswith("RequestOutput(")]
    assert len(finished) == 3, done.stdout[-3000:]
    assert all("finished=True" in line for line in finished)


def test_cumulative_outputs_match_llm_generate(engine, reference):
    outs = run(engine, [(str(i), p, SamplingParams(temperature=0, max_tokens=6)) for i, p in enumerate(PROMPTS)])
    for i, ref in enumerate(reference["greedy"]):
        last = outs[str(i)][-1]
        assert last.finished and last.outputs[0].token_ids == ref.outputs[0].token_ids
        assert last.outputs[0].text == ref.outputs[0].text
        assert len(outs[str(i)]) == 6  # one cumulative output per token
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("n", [1, 2])
def test_delta_outputs_concatenate_to_the_cumulative_ones_and_final_only_is_one(engine, reference, n):
    def params(kind):
        return SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=9, logprobs=1, output_kind=kind)

    kinds = list(RequestOutputKind)
    outs = run(engine, [(f"{k.name}-{i}", p, params(k)) for k in kinds for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        cumulative = outs[f"CUMULATIVE-{i}"][-1]
        deltas = outs[f"DELTA-{i}"]
        final = outs[f"FINAL_ONLY-{i}"]
        assert len(final) == 1 and final[0].finished and not any(o.finished for o in deltas[:-1])
        assert deltas[-1].finished and len(deltas) == len(outs[f"CUMULATIVE-{i}"])
        for j, whole in enumerate(cumulative.outputs):
            parts = [c for d in deltas for c in d.outputs if c.index == j]
            assert "".join(c.text for c in parts) == whole.text == final[0].outputs[j].text
            assert [t for c in parts for t in c.token_ids] == whole.token_ids == final[0].outputs[j].token_ids
            assert [lp for c in parts for lp in c.logprobs] == whole.logprobs
            assert parts[-1].finish_reason == whole.finish_reason
        if n == 2:  # seeded sampling: the same tokens as LLM.generate
            assert [c.token_ids for c in cumulative.outputs] == [c.token_ids for c in reference["n2"][i].outputs]


def test_get_metrics_count_what_was_sent(text_dir):
    with LLM(text_dir, **SMALL) as llm:
        lens = [3, 5, 8]
        prompts = [TokensPrompt(prompt_token_ids=list(range(40, 40 + k))) for k in lens]
        max_tokens = [4, 6, 2]
        outs = llm.generate(
            prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens], use_tqdm=False
        )
        assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
        metrics = {(m.name, tuple(sorted(m.labels.items()))): m for m in llm.get_metrics()}

    def one(name, **labels):
        found = [m for (n, lab), m in metrics.items() if n == name and all((k, v) in lab for k, v in labels.items())]
        assert len(found) == 1, (name, labels, list(metrics))
        return found[0]

    assert isinstance(one("vllm:prompt_tokens"), Counter) and one("vllm:prompt_tokens").value == sum(lens)
    assert one("vllm:generation_tokens").value == sum(max_tokens)
    assert one("vllm:request_success", finished_reason="length").value == 3
    assert one("vllm:prefix_cache_queries").value == sum(lens)  # each prompt looked up once, no hit
    assert one("vllm:prefix_cache_hits").value == 0
    assert isinstance(one("vllm:num_requests_running"), Gauge) and one("vllm:num_requests_running").value == 0
    assert one("vllm:num_requests_waiting").value == 0
    ttft = one("vllm:time_to_first_token_seconds")
    assert isinstance(ttft, Histogram) and ttft.count == 3 and ttft.buckets["+Inf"] == 3 and ttft.sum > 0
    assert one("vllm:inter_token_latency_seconds").count == sum(m - 1 for m in max_tokens)
    assert one("vllm:e2e_request_latency_seconds").count == 3
    assert one("ctxpar:pcp_size").value == 1 and one("ctxpar:dcp_size").value == 1


def test_reset_prefix_cache(text_dir):
    with LLM(text_dir, **SMALL, block_size=4) as llm:
        llm.generate(["a prompt of many whole blocks"], SamplingParams(max_tokens=2), use_tqdm=False)
        bm = llm.engine.block_manager
        assert bm.num_cached_blocks > 0
        llm.llm_engine.add_request("busy", "a prompt of many whole blocks too", SamplingParams(max_tokens=50))
        llm.llm_engine.step()  # it holds blocks now: nothing is reset
        assert llm.reset_prefix_cache() is False and bm.num_cached_blocks > 0
        llm.llm_engine.abort_request("busy")
        assert llm.reset_prefix_cache() is True and bm.num_cached_blocks == 0
        bm.check_integrity()
        out = llm.generate(["a prompt of many whole blocks"], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert out.num_cached_tokens == 0  # computed again


def test_llm_engine_outlives_its_llm_and_closes(text_dir):
    engine = LLM(text_dir, **SMALL).llm_engine  # the LLM itself is collected at once
    gc.collect()
    out = run(engine, [("x", "Hello", SamplingParams(temperature=0, max_tokens=3))])["x"][-1]
    assert out.finished and len(out.outputs[0].token_ids) == 3
    engine.close()
    with pytest.raises(CtxparError, match="closed"):
        engine.add_request("y", "Hello")


SPEC = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}


@pytest.mark.parametrize("config", [{}, SPEC, pytest.param({"pcp_size": 2}, marks=pytest.mark.multiprocess)])
def test_a_closed_llm_gives_its_model_back_without_the_cycle_collector(text_dir, config):
    """LLMs made one after another in a process (a notebook, a sweep) must not pile up
    models: closing one frees its weights by reference counting alone, so nothing of
    the engine may refer back to it in a cycle."""
    gc.collect()
    gc.disable()
    try:
        llm = LLM(text_dir, **SMALL, **config)
        llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
        model = weakref.ref(llm.engine.loaded.model)
        llm.close()
        assert model() is None, "a closed engine's model is still alive: a reference cycle holds it"
    finally:
        gc.enable()


def test_set_tokenizer_and_get_model_config(engine, text_dir):
    tok = engine.get_tokenizer()
    engine.set_tokenizer(tok)
    assert engine.get_tokenizer() is tok
    cfg = engine.get_model_config()
    assert cfg.max_model_len == 128 and cfg.get_vocab_size() > 0 and cfg.dtype == "float32"


def test_engine_args_bad_values_and_vllm_names():
    with pytest.raises(CtxparError, match="max_num_seqs"):
        EngineArgs(max_num_seq=4)  # a typo: the valid names are listed
    args = EngineArgs(swap_space=4, pcp_size=2)
    assert args.vllm_args == {"swap_space": 4} and args.pcp_size == 2
    assert EngineArgs(enforce_eager=True).create_engine_config().enforce_eager  # a real switch here
    assert EngineArgs(**dataclasses.asdict(args)) == args
    with pytest.raises(CtxparError, match="tensor_parallel_size=2"):
        EngineArgs(tensor_parallel_size=2).create_engine_config()
    with pytest.raises(CtxparError, match="block_size"):
        EngineArgs(block_size=0).create_engine_config()


def test_engine_args_cli_round_trip():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--pcp", "2", "--num-threads", "1", "--no-prefix-caching"]))
    assert (args.pcp_size, args.num_threads, args.enable_prefix_caching) == (2, 1, False)
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()  # the flags' defaults are the engine's


def test_add_request_refusals(engine):
    with pytest.raises(CtxparError, match="priority"):
        engine.add_request("p", "x", SamplingParams(), priority=1)
    with pytest.raises(CtxparError, match="LoRA"):
        engine.add_request("p", "x", SamplingParams(), lora_request=object())
    with pytest.raises(CtxparError, match="request_id must be a string"):
        engine.add_request(3, "x", SamplingParams())
    engine.add_request("dup", "x", SamplingParams(max_tokens=1))
    with pytest.raises(CtxparError, match="already in use"):
        engine.add_request("dup", "x", SamplingParams(max_tokens=1))
    engine.abort_request(["dup"])
    assert not engine.has_unfinished_requests()


def test_sampling_params_from_optional():
    p = SamplingParams.from_optional(temperature=None, top_p=0.5, logit_bias={"3": 1.5}, max_tokens=None)
    assert p.temperature == SamplingParams().temperature and p.top_p == 0.5
    assert p.logit_bias == {3: 1.5} and p.max_tokens == SamplingParams().max_tokens
    with pytest.raises(CtxparError, match="output_kind"):
        SamplingParams(output_kind="delta")
