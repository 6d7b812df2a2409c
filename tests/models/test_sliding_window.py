"""Sliding-window models (Mistral v0.1, Qwen's use_sliding_window) against transformers, with
prompts several windows long (100 tokens, a window of 24, KV blocks of 16) and decodes past
several more: the prompt's logprobs at any chunking (the same bits), the generated tokens'
through the engine (its decode kernel, its compiled decode loop), P = 2 the bits of one rank,
P = D = 2 its tokens (DCP's shards cut to the window by position), and the same-bits guarantee
in a mix (tests/engine/test_same_bits.py's check). A Mistral v0.1 GGUF is a llama file without
a window, as llama.cpp's converter writes it and llama.cpp runs it. Phi-3's window:
tests/models/test_gguf_phi3.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ctxpar import LLM, SamplingParams
from ctxpar.models.loader import load_model
from helpers.reference import SingleSequence
from tests.engine.test_same_bits import alone, in_a_mix
from tests.models.test_gguf_families import COMMON, DCP_TOL, TIE, TOL, peaked

WINDOW = 24
IDS = torch.randint(3, 320, (100,), generator=torch.Generator().manual_seed(0))
DECODES = 60  # generated tokens: with the prompt, 160 positions, past six windows


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> dict[str, Path]:
    """{name: checkpoint}: Mistral v0.1 (every layer windowed), Qwen2 windowed from layer 1 on."""
    from transformers import MistralConfig, Qwen2Config

    from helpers.models import save_tiny_model

    root = tmp_path_factory.mktemp("sliding_window")
    configs = {
        "mistral-v0.1": MistralConfig(**COMMON, sliding_window=WINDOW),
        "qwen2": Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    }
    return {name: peaked(save_tiny_model(config, root / name)) for name, config in configs.items()}


@torch.no_grad()
def transformers_logprobs(hf: Path, ids: torch.Tensor, window: bool = True) -> torch.Tensor:
    """(n, vocab) logprobs of ``ids`` by transformers (without the window where ``window`` is False)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf)
    if not window:
        config.sliding_window, config.use_sliding_window = None, False
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    ref = AutoModelForCausalLM.from_pretrained(hf, config=config, dtype=torch.float32, attn_implementation="eager")
    return torch.log_softmax(ref.eval()(ids[None]).logits[0].float(), -1)


def assert_close_at_the_top(got: torch.Tensor, want: torch.Tensor) -> None:
    """Argmax equal where the reference's top two stand more than TIE apart; the reference's
    top token's logprob within TOL."""
    top2 = want.topk(2, -1)
    clear = top2.values[:, 0] - top2.values[:, 1] > TIE
    assert clear.sum() >= len(want) // 2
    assert torch.equal(got.argmax(-1)[clear], top2.indices[clear, 0])
    top = top2.indices[:, :1]
    assert (got.gather(1, top) - want.gather(1, top)).abs().max() < TOL


@pytest.mark.parametrize("name", ["mistral-v0.1", "qwen2"])
def test_prompt_logprobs_match_transformers_at_any_chunking(windowed, name: str) -> None:
    hf = windowed[name]
    model = load_model(str(hf), torch.float32, torch.device("cpu")).model
    assert {layer.self_attn.attn.spec.window for layer in model.decoder_layers[1:]} == {WINDOW}
    outs = []
    for chunks in ([100], [37, 1, 62], [16] * 6 + [4]):
        seq = SingleSequence(model, 128)
        logits = torch.cat([seq.step(part) for part in IDS.split(chunks)])
        outs.append(torch.log_softmax(logits, -1))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    want = transformers_logprobs(hf, IDS)
    assert_close_at_the_top(outs[0], want)
    # The window matters: without it the same weights give other logprobs.
    assert (transformers_logprobs(hf, IDS, window=False) - want).abs().max() > 100 * TOL


def generate(path: Path, **layout) -> object:
    params = SamplingParams(temperature=0, max_tokens=DECODES, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    kwargs = dict(quantization="none", block_size=16, max_model_len=256, kv_cache_bytes=1 << 23, pcp_min_tokens=0)
    with LLM(str(path), **kwargs, **layout) as llm:
        return llm.generate([{"prompt_token_ids": IDS.tolist()}], params, use_tqdm=False)[0]


@pytest.mark.multiprocess
def test_decodes_past_several_windows_match_transformers_and_ranks_keep_the_bits(windowed) -> None:
    """Greedy decodes of Mistral v0.1 against transformers over the whole sequence; P = 2 gives
    one rank's bits, P = D = 2 its tokens and logprobs within DCP's bound."""
    hf = windowed["mistral-v0.1"]
    one = generate(hf)
    tokens = one.outputs[0].token_ids
    want = transformers_logprobs(hf, torch.tensor([*IDS.tolist(), *tokens]))[len(IDS) - 1 : -1]  # (DECODES, vocab)
    got = torch.tensor([lp[t].logprob for lp, t in zip(one.outputs[0].logprobs, tokens)])
    top2 = want.topk(2, -1)
    clear = top2.values[:, 0] - top2.values[:, 1] > TIE
    assert clear.sum() >= DECODES // 2 and torch.equal(torch.tensor(tokens)[clear], top2.indices[clear, 0])
    assert (got - want.gather(1, torch.tensor(tokens)[:, None])[:, 0]).abs().max() < TOL

    two, dcp = generate(hf, pcp_size=2), generate(hf, pcp_size=2, dcp_size=2)
    assert two.outputs[0].token_ids == tokens == dcp.outputs[0].token_ids
    assert two.outputs[0].logprobs == one.outputs[0].logprobs and two.prompt_logprobs == one.prompt_logprobs
    pairs = [*zip(dcp.outputs[0].logprobs, one.outputs[0].logprobs), *zip(dcp.prompt_logprobs, one.prompt_logprobs)]
    worst = max(abs(a[t].logprob - b[t].logprob) for a, b in pairs if a and b for t in a.keys() & b.keys())
    assert worst < DCP_TOL, worst


@pytest.mark.multiprocess
def test_a_windowed_model_keeps_its_bits_in_any_mix(windowed, tmp_path: Path) -> None:
    """test_same_bits' targets (prompts of ~10 windows) alone and in a mix, chunked by a small
    token budget, after a prefix-cache hit: ==, at P = 1, 2 and D = 2."""
    from helpers.tiny_tokenizer import with_byte_tokenizer

    model = str(with_byte_tokenizer(windowed["mistral-v0.1"], tmp_path / "mistral-bytes"))
    for base, mixes in (({}, [{}, {"pcp_size": 2, "pcp_min_tokens": 8}]), ({"pcp_size": 2, "dcp_size": 2}, [{}])):
        want = alone(model=model, quantization="none", **base)
        for seed, extra in enumerate(mixes):
            assert in_a_mix(seed, model=model, quantization="none", **base, **extra) == want, (base, extra)


def test_a_mistral_v0_1_gguf_is_a_llama_file_without_the_window(windowed, tmp_path: Path) -> None:
    """llama.cpp's converter writes Mistral v0.1 as a llama file and no sliding window (llama.cpp
    attends every key): ctxpar reads it so, and the file's logprobs are the checkpoint's without
    the window."""
    from ctxpar.models.gguf import config_from_gguf, open_gguf
    from helpers.llama_cpp import gguf_of

    path = gguf_of(windowed["mistral-v0.1"], tmp_path, ("f32",))["f32"]
    reader = open_gguf(path)
    assert (
        reader.metadata["general.architecture"] == "llama" and "llama.attention.sliding_window" not in reader.metadata
    )
    assert config_from_gguf(reader, path).sliding_window is None
    model = load_model(str(path), torch.float32, torch.device("cpu")).model
    got = torch.log_softmax(SingleSequence(model, 128).step(IDS), -1)
    assert_close_at_the_top(got, transformers_logprobs(windowed["mistral-v0.1"], IDS, window=False))


@pytest.mark.multiprocess
def test_dcp_keeps_its_bits_however_a_long_prompt_is_chunked(windowed) -> None:
    """P = D = 2 over 400 tokens, each shard's keys past several runs of KEY_BLOCK_ALIGN (the
    spans read from the run that holds their first window, dcp_metadata.py): in one step or
    chunked by a small token budget, the same bits."""
    ids = torch.randint(3, 320, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    layout = dict(pcp_size=2, dcp_size=2, pcp_min_tokens=0, block_size=16, max_model_len=512, kv_cache_bytes=1 << 24)
    outs = []
    for budget in (512, 40):
        with LLM(str(windowed["mistral-v0.1"]), quantization="none", max_num_batched_tokens=budget, **layout) as llm:
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        outs.append((out.outputs[0].token_ids, out.outputs[0].logprobs, out.prompt_logprobs))
    assert outs[1] == outs[0]


@pytest.mark.parametrize("kv_cache_dtype", ["model", "int8"])
def test_the_compiled_decode_loop_carries_each_layers_window(windowed, monkeypatch, kv_cache_dtype: str) -> None:
    """Decode steps in the compiled loop (kernels/decode_loop.cpp, each layer's window in its
    record) give the bits of the model's forward, past two windows (tests/models/test_compiled_decode.py)."""
    from tests.models.test_compiled_decode import PARAMS, run

    kw = dict(dtype="float32", quantization="none", kv_cache_dtype=kv_cache_dtype)
    for name in ("mistral-v0.1", "qwen2"):
        eager, eager_calls, _ = run(windowed[name], monkeypatch, enforce_eager=True, **kw)
        compiled, compiled_calls, built = run(windowed[name], monkeypatch, **kw)
        assert eager_calls == 0 and built and compiled_calls >= PARAMS.max_tokens - 1
        assert compiled == eager, name
