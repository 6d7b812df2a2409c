"""Speculative decoding end to end on the tiny models: with n-gram drafts, greedy
requests produce exactly the tokens they produce without speculation, in mixed
batches, under chunked prefill, preemption, stop conditions, n > 1 and logprobs,
on one rank, P = 2 and 3 ranks (verify rows split or replicated), under DCP, and
with MLA; the reference is the same engine without speculation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from ctxpar import LLM, SamplingParams
from ctxpar.errors import CtxparError
from helpers.deepseek_configs import tiny_deepseek_configs
from helpers.models import save_tiny_model
from helpers.workloads import SMALL

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MP = pytest.mark.multiprocess


def spec_workload(n: int = 8, seed: int = 0) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts that repeat a phrase (drafts often right) and random ones (often wrong),
    greedy with different lengths, some with logprobs, some with a frequency penalty."""
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(n):
        if i % 2 == 0:
            phrase = rng.integers(0, 256, int(rng.integers(3, 12))).tolist()
            prompt = (phrase * 40)[: int(rng.integers(10, 90))]
        else:
            prompt = rng.integers(0, 256, int(rng.integers(1, 90))).tolist()
        prompts.append({"prompt_token_ids": prompt})
        params.append(
            SamplingParams(
                temperature=0,
                max_tokens=int(rng.integers(8, 40)),
                ignore_eos=True,
                logprobs=2 if i % 3 == 1 else None,
                # Logits processing that depends on the output so far (the kept drafts count).
                frequency_penalty=0.3 if i % 4 == 2 else 0.0,
            )
        )
    return prompts, params


def run(model: str, prompts, params, **kwargs) -> list:
    with LLM(model, **kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        bm = llm.engine.block_manager
        bm.check_integrity()
        assert bm.num_free_blocks == llm.engine.num_blocks  # every block back, rejected drafts' included
        return outs


def accepted_and_rejected(outs) -> bool:
    """Whether speculation really happened: some drafts kept, some rejected."""
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    return 0 < accepted < sum(o.metrics.num_draft_tokens for o in outs)


def assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        for go, wo in zip(g.outputs, w.outputs, strict=True):
            assert go.token_ids == wo.token_ids
            assert go.finish_reason == wo.finish_reason and go.stop_reason == wo.stop_reason
            if wo.logprobs is not None:
                assert go.logprobs is not None and len(go.logprobs) == len(wo.logprobs)
                for a, b in zip(go.logprobs, wo.logprobs):
                    assert list(a) == list(b)  # same tokens in the same order (sampled first, then top-2)
                    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


def truncated(model_dir: Path, out: Path, layers: int) -> Path:
    """A draft model: the target's first ``layers`` layers, embeddings and head (same
    vocabulary, agrees with the target often but not always)."""
    out.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    state = {}
    for f in model_dir.glob("*.safetensors"):
        state.update(load_file(f))
    keep = {k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def models(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec_decode")
    return {
        "llama": str(tiny_model_dirs["llama"]),  # GQA
        "deepseek_v3": str(save_tiny_model(tiny_deepseek_configs()["v3"], root / "v3")),  # MLA
        "llama_draft": str(truncated(tiny_model_dirs["llama"], root / "llama_draft", 1)),
        "v3_draft": str(truncated(Path(root / "v3"), root / "v3_draft", 1)),
    }


def draft_of(models: dict[str, str], model: str) -> dict:
    draft = models["llama_draft" if model == "llama" else "v3_draft"]
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def reference(models) -> dict[str, list]:
    prompts, params = spec_workload()
    return {name: run(models[name], prompts, params, **SMALL) for name in ("llama", "deepseek_v3")}


@pytest.mark.parametrize(
    "model,kwargs",
    [
        ("llama", {}),
        ("deepseek_v3", {}),  # MLA
        ("llama", dict(max_num_batched_tokens=16, max_num_seqs=3)),  # chunked prefill, drafts cut to the budget
        ("llama", dict(block_size=4, num_kv_blocks=40, max_model_len=130)),  # preemption (checked below)
        ("llama", dict(enable_prefix_caching=False)),
    ],
)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_identical(models, reference, method, model, kwargs):
    prompts, params = spec_workload()
    kw = {**SMALL, **kwargs} if "num_kv_blocks" not in kwargs else kwargs
    spec = NGRAM if method == "ngram" else draft_of(models, model)
    with LLM(models[model], speculative_config=spec, **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if "num_kv_blocks" in kwargs:
            assert llm.engine.scheduler.num_preemptions > 0
        llm.engine.block_manager.check_integrity()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    assert_same(outs, reference[model])
    assert accepted_and_rejected(outs)
    rates = [o.metrics.acceptance_rate for o in outs if o.metrics.num_drafts]
    assert rates and all(0 <= r <= 1 for r in rates)


def with_changes(params: list[SamplingParams], **changes) -> list[SamplingParams]:
    """Copies of ``params`` with some fields changed (and validated again)."""
    out = []
    for p in params:
        q = p.clone()
        for name, value in changes.items():
            setattr(q, name, value(p) if callable(value) else value)
        q.validate()
        out.append(q)
    return out


def test_stop_token_inside_an_accepted_run(models, reference):
    """A stop token accepted among the drafts ends the output there: later drafts are dropped."""
    prompts, params = spec_workload()
    stop_at = {id(p): o.outputs[0].token_ids[-3] for p, o in zip(params, reference["llama"])}
    stops = with_changes(params, stop_token_ids=lambda p: [stop_at[id(p)]])
    want = run(models["llama"], prompts, stops, **SMALL)
    assert all(o.outputs[0].finish_reason == "stop" for o in want)
    outs = run(models["llama"], prompts, stops, speculative_config=NGRAM, **SMALL)
    assert_same(outs, want)
    assert accepted_and_rejected(outs)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_n_samples_and_seeded_sampling(models, reference, method):
    """n = 2 samples through the rejection sampler (a draft model's drafts drawn from its
    own distribution): with top_k=1 (point masses) every sample is exactly the greedy
    output; seeded samples are reproducible."""
    prompts, params = spec_workload()
    top1 = with_changes(params, n=2, temperature=0.8, top_k=1, seed=3)
    sampled = with_changes(params, n=2, temperature=0.8, top_k=20, seed=7, logprobs=None, frequency_penalty=0.0)
    spec = NGRAM if method == "ngram" else draft_of(models, "llama")
    with LLM(models["llama"], speculative_config=spec, **SMALL) as llm:
        outs = llm.generate(prompts, top1, use_tqdm=False)
        first = llm.generate(prompts, sampled, use_tqdm=False)
        again = llm.generate(prompts, sampled, use_tqdm=False)
    for o, want in zip(outs, reference["llama"], strict=True):
        assert len(o.outputs) == 2
        for sample in o.outputs:
            assert sample.token_ids == want.outputs[0].token_ids
    assert accepted_and_rejected(outs)
    assert_same(first, again)


@pytest.mark.parametrize(
    "method,model,kwargs",
    [
        pytest.param("ngram", "llama", dict(pcp_size=2, pcp_min_tokens=0), marks=MP, id="ngram-P2-split"),
        pytest.param("ngram", "llama", dict(pcp_size=3, pcp_min_tokens=4), marks=MP, id="ngram-P3-mixed"),
        pytest.param("ngram", "llama", dict(pcp_size=2, dcp_size=2, pcp_min_tokens=0), marks=MP, id="ngram-P2-DCP"),
        pytest.param(
            "ngram", "deepseek_v3", dict(pcp_size=2, dcp_size=2, pcp_min_tokens=4), marks=MP, id="ngram-P2-DCP-MLA"
        ),
        pytest.param("draft_model", "llama", dict(pcp_size=3, pcp_min_tokens=0), marks=MP, id="draft-P3-split"),
        pytest.param(
            "draft_model",
            "deepseek_v3",
            dict(pcp_size=2, dcp_size=2, pcp_min_tokens=4),
            marks=MP,
            id="draft-P2-DCP-MLA",
        ),
    ],
)
def test_greedy_identical_across_ranks(models, reference, method, model, kwargs):
    """Verify rows (and a draft model's steps) split across the ranks (pcp_min_tokens=0),
    replicated when short, and attending sharded KV under DCP: still exactly the one-rank
    tokens without speculation."""
    prompts, params = spec_workload()
    spec = NGRAM if method == "ngram" else draft_of(models, model)
    outs = run(models[model], prompts, params, speculative_config=spec, max_num_batched_tokens=64, **SMALL, **kwargs)
    assert_same(outs, reference[model])
    assert accepted_and_rejected(outs)


def test_bad_speculative_config(models, tmp_path):
    from transformers import LlamaConfig

    from helpers.models import TINY_COMMON

    other_vocab = save_tiny_model(LlamaConfig(**{**TINY_COMMON, "vocab_size": 128}), tmp_path / "vocab128")
    for bad, words in [
        ({"method": "draft_model", "model": str(other_vocab), "num_speculative_tokens": 2}, "vocabulary"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
        ({"method": "ngram", "model": str(other_vocab), "num_speculative_tokens": 2}, "only for method='draft_model'"),
        ({"method": "mtp", "num_speculative_tokens": 1}, "next-token-prediction"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "unknown"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "lookup"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
        ("{not json", "JSON"),
    ]:
        with pytest.raises(CtxparError, match=words):
            LLM(models["llama"], speculative_config=bad)


def test_metrics_count_what_the_outputs_say(models):
    """get_metrics() (vLLM's names) and the server's registry report the drafts and
    acceptances the requests' own metrics add up to."""
    from ctxpar.engine.metrics import EngineSnapshot
    from ctxpar.entrypoints.openai.server_metrics import ServerMetrics

    prompts, params = spec_workload()
    with LLM(models["llama"], speculative_config=NGRAM, **SMALL) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = {(m.name, m.labels.get("position")): m.value for m in llm.get_metrics() if "spec_decode" in m.name}
        server = ServerMetrics("tiny")
        server.observe(EngineSnapshot.of(llm.engine))
        text = server.render(private=True).decode()
    want = {
        "num_drafts": sum(o.metrics.num_drafts for o in outs),
        "num_draft_tokens": sum(o.metrics.num_draft_tokens for o in outs),
        "num_accepted_tokens": sum(o.metrics.num_accepted_tokens for o in outs),
    }
    for name, value in want.items():
        assert got[(f"vllm:spec_decode_{name}", None)] == value
        assert f'ctxpar:spec_decode_{name}_total{{model_name="tiny"}} {float(value)}' in text
    per_pos = [got[("vllm:spec_decode_num_accepted_tokens_per_pos", str(i))] for i in range(4)]
    assert sum(per_pos) == want["num_accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)


def test_streaming_deltas_and_stop_strings(tiny_model_dirs, tmp_path):
    """DELTA outputs (several tokens per chunk) add up to the output without speculation,
    stop strings included (one may end the text inside an accepted run)."""
    import asyncio

    from ctxpar import AsyncEngineArgs, AsyncLLM
    from ctxpar.sampling_params import RequestOutputKind
    from helpers.tiny_tokenizer import with_byte_tokenizer

    text_dir = str(with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path / "bytes"))
    prompts = ["abcabcabcabc", "hello hello hello", "xyz"]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(text_dir, **SMALL) as llm:
        plain = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
        stops = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[t[12:14]]) for t in plain]
        want = [o.outputs[0] for o in llm.generate(prompts, stops, use_tqdm=False)]

    async def stream() -> list[tuple[str, list[int], str | None, int]]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=text_dir, speculative_config=NGRAM, **SMALL))
        try:
            results = []
            for i, (prompt, params) in enumerate(zip(prompts, stops)):
                params = params.clone()
                params.output_kind = RequestOutputKind.DELTA
                text, ids, reason, chunks = "", [], None, 0
                async for out in engine.generate(prompt, params, request_id=f"s{i}"):
                    text += out.outputs[0].text
                    ids += out.outputs[0].token_ids
                    reason, chunks = out.outputs[0].finish_reason, chunks + 1
                results.append((text, ids, reason, chunks))
            return results
        finally:
            engine.shutdown()

    results = asyncio.run(stream())
    for (text, ids, reason, _), w in zip(results, want, strict=True):
        assert (text, ids, reason) == (w.text, w.token_ids, w.finish_reason)
    assert any(w.finish_reason == "stop" for w in want)
    assert any(chunks < len(ids) for _, ids, _, chunks in results)  # some chunk held several tokens


def test_min_acceptance_rate_pauses_drafting(models, reference):
    """A request whose drafts are rarely accepted stops drafting for a while: fewer drafts,
    the same tokens."""
    prompts, params = spec_workload()
    counts = []
    for rate in (0.0, 0.95):
        outs = run(models["llama"], prompts, params, speculative_config={**NGRAM, "min_acceptance_rate": rate}, **SMALL)
        assert_same(outs, reference["llama"])
        counts.append(sum(o.metrics.num_draft_tokens for o in outs))
    assert 0 < counts[1] < counts[0]


def test_draft_model_drafts_are_its_greedy_continuation(models, reference):
    """Every draft the draft model proposes, under rejections and preemptions, is exactly
    what the draft model alone generates greedily from the request's known tokens: so its
    KV cache (catch-up, rollback to the verified tokens, restart after preemption) is right."""
    prompts, params = spec_workload()
    spec = draft_of(models, "llama")
    seen: list[tuple[list[int], list[int]]] = []  # (known tokens, drafts) of every proposal
    with LLM(models["llama"], speculative_config=spec, block_size=4, num_kv_blocks=40, max_model_len=130) as llm:
        proposer = llm.engine.spec.draft_model
        propose = proposer.propose

        def recording(requests, running):
            propose(requests, running)
            # Penalties count the request's own outputs: only plain greedy requests compare to a fresh run.
            plain = [r for r in requests if not r.params.processes_logits]
            seen.extend((r.prompt_token_ids + r.output_token_ids, list(r.spec_token_ids)) for r in plain)

        proposer.propose = recording
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    assert_same(outs, reference["llama"])
    assert accepted_and_rejected(outs)
    seen = [(known, drafts) for known, drafts in seen if drafts]
    with LLM(spec["model"], **SMALL) as draft:
        alone = draft.generate(
            [{"prompt_token_ids": known} for known, _ in seen],
            [SamplingParams(temperature=0, max_tokens=len(d), ignore_eos=True) for _, d in seen],
            use_tqdm=False,
        )
    assert [o.outputs[0].token_ids for o in alone] == [d for _, d in seen]


def test_speculative_config_flag_of_generate_and_serve():
    """--speculative-config JSON reaches the engine's config on both commands."""
    import argparse

    from ctxpar.engine.arg_utils import EngineArgs
    from ctxpar.entrypoints.cli import generate, serve
    from ctxpar.speculative_config import SpeculativeConfig

    for command in (generate, serve):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
        config = EngineArgs.from_cli_args(args).create_engine_config()
        assert config.speculative_config == SpeculativeConfig(**NGRAM)
