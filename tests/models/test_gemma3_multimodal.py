"""Gemma 3 4B-27B as published (``Gemma3ForConditionalGeneration``): a config whose text_config is a
Gemma 3 text model's, beside a vision tower and its projector. ctxpar runs the text model: its config
from text_config, its weights under the hub's names (language_model.model.*) or transformers 5's
in-memory ones (model.language_model.*), the vision tensors never read. A tiny random checkpoint of
that class (tests/models/test_gguf_gemma.py's Gemma 3 text config, in llama.cpp's layer pattern, and
a one-layer SigLIP tower) against transformers' own text-only forward of the whole model (fp32 prompt
logprobs, tests/models/test_gguf_families.py's comparison); its text GGUF, which llama.cpp's converter
writes as a gemma3 file (the vision part goes to a separate mmproj file), too. Chat renders by the
tokenizer's template as for a text model; an image part is refused naming it. P = 2 gives one
rank's bits, P = D = 2 its tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ctxpar import LLM, SamplingParams
from ctxpar.errors import CtxparError
from ctxpar.model_args import ModelArgs
from ctxpar.models.loader import _read_config
from helpers.llama_cpp import gguf_of
from helpers.tiny_tokenizer import with_byte_tokenizer
from tests.models.test_gguf_families import (
    IDS,
    TIE,
    TOL,
    assert_close_at_the_top,
    assert_ranks_give_the_bits_of_one,
    ctxpar_logprobs,
)
from tests.models.test_gguf_gemma import configs

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
# Ids of the image markers past IDS's (3..319) and the vocabulary's (as Gemma 3's image token is).
IMAGE_TOKENS = dict(image_token_index=400, boi_token_index=401, eoi_token_index=402, mm_tokens_per_image=4)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """(checkpoint, {"f32": its text GGUF})."""
    from transformers import Gemma3Config, SiglipVisionConfig

    from helpers.models import save_tiny_model

    text = configs()["gemma3"].to_dict()
    config = Gemma3Config(
        text_config=text,
        vision_config=SiglipVisionConfig(**VISION, patch_size=14).to_dict(),
        **IMAGE_TOKENS,
        eos_token_id=[2, 106],  # the outer config's stop ids, as Gemma 3's (106: <end_of_turn>)
        architectures=["Gemma3ForConditionalGeneration"],
    )
    root = tmp_path_factory.mktemp("gemma3_multimodal")
    hf = save_tiny_model(config, root / "gemma3-mm")
    return hf, gguf_of(hf, root, ("f32",))


@torch.no_grad()
def transformers_text_logprobs(hf_dir: Path) -> torch.Tensor:
    """(n, vocab) logprobs of IDS by transformers' Gemma3ForConditionalGeneration, text only."""
    from transformers import Gemma3ForConditionalGeneration

    ref = Gemma3ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return torch.log_softmax(ref.eval()(input_ids=IDS[None]).logits[0].float(), -1)


def test_the_description_is_the_text_models(multimodal) -> None:
    hf, _ = multimodal
    ours, text = _read_config(hf, hf), ModelArgs.of(configs()["gemma3"])
    assert ours.architectures == ("Gemma3ForConditionalGeneration",) and ours.model_type == "gemma3_text"
    assert ours.eos_token_id == (2, 106) and ours.tie_word_embeddings
    fields = ("hidden_size", "num_hidden_layers", "head_dim", "layer_types", "rope", "sliding_rope", "qk_norm")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(text, f) for f in fields}
    assert _read_config(hf, hf, {"sliding_window": 8}).sliding_window == 8  # hf_overrides: the text model's


def test_the_text_model_matches_transformers_and_reads_no_vision_tensor(multimodal, monkeypatch) -> None:
    import safetensors

    hf, _ = multimodal
    read: list[str] = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs) -> None:
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name: str):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    got = ctxpar_logprobs(hf)
    monkeypatch.undo()
    with real(str(hf / "model.safetensors"), framework="pt") as f:
        assert any(name.startswith("vision_tower.") for name in f.keys())
    assert read and all(name.startswith("language_model.") for name in read), read
    assert_close_at_the_top(got, transformers_text_logprobs(hf), TOL, TIE)


def test_transformers_5_in_memory_names_load_too(multimodal, tmp_path) -> None:
    """The same weights saved under model.language_model.* / model.vision_tower.* names: the same bits."""
    from safetensors.torch import load_file, save_file

    hf, _ = multimodal
    renamed = tmp_path / "renamed"
    shutil.copytree(hf, renamed)
    weights = load_file(hf / "model.safetensors")
    save_file(
        {"model." + k.replace("language_model.model.", "language_model."): v for k, v in weights.items()},
        renamed / "model.safetensors",
        metadata={"format": "pt"},
    )
    assert torch.equal(ctxpar_logprobs(renamed), ctxpar_logprobs(hf))


def test_its_text_gguf_matches_transformers(multimodal) -> None:
    from ctxpar.models.gguf_file import GGUFFile

    hf, files = multimodal
    gguf_file = files["f32"]
    assert GGUFFile(gguf_file).metadata["general.architecture"] == "gemma3"
    assert_close_at_the_top(ctxpar_logprobs(gguf_file), transformers_text_logprobs(hf), TOL, TIE)


def test_an_mmproj_file_is_refused_naming_it(tmp_path) -> None:
    """The image encoder llama.cpp's converter writes apart (--mmproj: architecture 'clip'), passed
    instead of the model's text GGUF."""
    import numpy as np

    from ctxpar.models.loader import load_model
    from tests.models.test_gguf_families import write_gguf

    path = write_gguf(tmp_path / "mmproj-gemma3.gguf", "clip", np.zeros((4, 8), np.float32))
    with pytest.raises(CtxparError, match="multimodal projector.*pass the model's own GGUF file"):
        load_model(str(path), torch.float32, torch.device("cpu"))


def test_chat_renders_by_the_template_and_refuses_images(multimodal, tmp_path) -> None:
    hf = with_byte_tokenizer(multimodal[0], tmp_path / "with-tokenizer")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(str(hf), max_model_len=64, kv_cache_bytes=1 << 22) as llm:
        [out] = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
        assert out.prompt_token_ids == list(b"<user>hi\n<assistant>") and len(out.outputs[0].token_ids) == 3
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        with pytest.raises(CtxparError, match="content part 'image_url' is not supported: ctxpar runs text models"):
            llm.chat([{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}], params)


@pytest.mark.multiprocess
def test_two_ranks_give_the_bits_of_one_and_dcp_its_tokens(multimodal) -> None:
    assert_ranks_give_the_bits_of_one(str(multimodal[0]))
