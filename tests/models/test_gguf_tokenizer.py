"""A GGUF's tokenizer read without transformers (models/gguf_tokenizer.py) against
transformers' own GGUF tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``)
on the same file: the real SmolLM2 GGUF (byte-level BPE, pre-tokenizer ``smollm``),
copies of it relabelled with other pre-tokenizers (each its own split regex in
transformers' converter) or with a BOS to add, and a SentencePiece file written by
llama.cpp's converter (helpers/llama_cpp.py). Ids, texts and special tokens must be
transformers' exactly; what the class does not answer itself is transformers'."""

from __future__ import annotations

import functools
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ctxpar.models import gguf, gguf_tokenizer
from ctxpar.models.gguf_file import GGUFFile
from ctxpar.models.loader import default_model_path

TEXTS = [
    "The capital of France is",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\t\ttabs, newlines\n\n\nand a CRLF\r\n end",
    "digits 1234567890 and 3.14159, 1,000,000 and 007",
    "don't I'll we've they're she'd IT'S",
    "unicode: café naïve Ünïcödé, 中文字符, 日本語のテキスト, 한국어, Ελληνικά, русский",
    "emoji 🤖🚀👍🏽 and combining e\u0301 and zero-width\u200bjoiner",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after an end<|endoftext|><|endoftext|>",
    "def f(x):\n    return x ** 2  # code, with    runs of spaces\n",
    "",
    " ",
    "a" * 300,
]
# Pre-tokenizers whose split regex transformers' converter sets (SmolLM2's own it leaves at GPT-2's).
PRES = ["llama-bpe", "qwen2"]


def relabelled(src: Path, out: Path, fields: dict[str, object]) -> Path:
    """``src`` with the string or bool metadata ``fields`` replaced (each must be in the file,
    of the same type), its tensors as they are: a file of the same vocabulary that states
    another tokenizer setting."""
    raw = src.read_bytes()
    align = int(GGUFFile(src).metadata.get("general.alignment", 32))
    data_start = -(-_header_length(raw) // align) * align  # the tensors' data, offsets relative to it
    head = raw[: _header_length(raw)]
    for key, value in fields.items():
        name = key.encode()
        at = head.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
        kind = struct.unpack_from("<I", head, at)[0]
        at += 4
        if isinstance(value, bool):
            assert kind == 7, key
            head = head[:at] + struct.pack("<?", value) + head[at + 1 :]
        else:
            assert kind == 8 and isinstance(value, str), key
            old = struct.unpack_from("<Q", head, at)[0]
            new = value.encode()
            head = head[:at] + struct.pack("<Q", len(new)) + new + head[at + 8 + old :]
    out.write_bytes(head + b"\0" * (-len(head) % align) + raw[data_start:])
    return out


def _header_length(raw: bytes) -> int:
    """Where the tensor infos of the GGUF ``raw`` end (gguf.md's layout; models/gguf_file.py)."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(p: int) -> int:
        return p + 8 + struct.unpack_from("<Q", raw, p)[0]

    def value(p: int, kind: int) -> int:
        if kind == 8:
            return string(p)
        if kind == 9:
            inner, count = struct.unpack_from("<IQ", raw, p)
            p += 12
            for _ in range(count):
                p = value(p, inner)
            return p
        return p + sizes[kind]

    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    pos = 24
    for _ in range(n_kv):
        pos = string(pos)
        pos = value(pos + 4, struct.unpack_from("<I", raw, pos)[0])
    for _ in range(n_tensors):
        pos = string(pos)
        pos += 4 + 8 * struct.unpack_from("<I", raw, pos)[0] + 4 + 8
    return pos


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """{label: GGUF file}: SmolLM2's, its relabelled copies, a SentencePiece one."""
    from transformers import LlamaConfig

    from helpers.llama_cpp import gguf_of
    from helpers.models import save_tiny_model

    root = tmp_path_factory.mktemp("gguf_tokenizer")
    smollm2 = default_model_path()
    out = {"smollm": smollm2}
    for pre in PRES:
        out[pre] = relabelled(smollm2, root / f"smollm2-{pre}.gguf", {"tokenizer.ggml.pre": pre})
    out["smollm+bos"] = relabelled(smollm2, root / "smollm2-bos.gguf", {"tokenizer.ggml.add_bos_token": True})
    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
    )
    out["sentencepiece"] = gguf_of(save_tiny_model(config, root / "spm"), root, ("f32",))["f32"]
    return out


@functools.cache
def reference(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def ours(path: Path, tmp: Path) -> gguf_tokenizer.GGUFTokenizer:
    """``path`` converted as the loader's cache holds it (into ``tmp``), its tokenizer loaded."""
    d = tmp / path.stem
    d.mkdir()
    gguf.convert_gguf(path, d)
    tok = gguf_tokenizer.load(d)
    assert tok is not None, f"{path.name}: no snapshot in {d}"
    return tok


@pytest.mark.parametrize("label", ["smollm", *PRES, "smollm+bos", "sentencepiece"])
def test_ids_texts_and_special_tokens_are_transformers(files, label: str, tmp_path: Path) -> None:
    path = files[label]
    ref, tok = reference(path), ours(path, tmp_path)
    if label in PRES:  # the relabelling reached transformers' converter
        default = reference(files["smollm"]).backend_tokenizer.pre_tokenizer
        assert ref.backend_tokenizer.pre_tokenizer.__getstate__() != default.__getstate__()
    for text in TEXTS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (label, text, special)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    vocab = len(ref)
    assert len(tok) == vocab
    mixed = [0, 1, 2, 3, vocab - 1, *range(100, 140), 1, 2, 0]  # special ids among ordinary ones
    for skip in (True, False):
        assert tok.decode(mixed, skip_special_tokens=skip) == ref.decode(mixed, skip_special_tokens=skip)
        assert tok.decode(mixed[4], skip_special_tokens=skip) == ref.decode(mixed[4], skip_special_tokens=skip)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template", "special_tokens_map"):
        assert getattr(tok, name) == getattr(ref, name), name


def test_what_it_does_not_answer_is_transformers(files, tmp_path: Path) -> None:
    path = files["smollm"]
    ref, tok = reference(path), ours(path, tmp_path)
    messages = [{"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tok("a batch", "of two")["input_ids"] == ref("a batch", "of two")["input_ids"]
    assert tok.convert_ids_to_tokens([1, 2, 300]) == ref.convert_ids_to_tokens([1, 2, 300])
    assert tok.decode([[5, 6], [7]]) == ref.decode([[5, 6], [7]])
    with pytest.raises(AttributeError):
        tok._no_such_private_name  # noqa: B018  (never built through transformers)
    copied = pickle.loads(pickle.dumps(tok))
    assert copied.encode(TEXTS[7]) == ref.encode(TEXTS[7]) and copied.eos_token_id == ref.eos_token_id


def test_a_start_from_the_cache_imports_no_transformers() -> None:
    """The loader's path for a converted GGUF, in a fresh process: a token generated and its
    text decoded with no transformers module loaded."""
    path = default_model_path()
    gguf.gguf_to_hf_dir(path)  # converted beforehand (the cache's), as a restart finds it
    script = (
        "import sys\n"
        "from ctxpar import LLM, SamplingParams\n"
        f"llm = LLM(model={str(path)!r}, max_model_len=128)\n"
        "out = llm.generate(['The capital of France is'], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "assert out[0].outputs[0].text, out\n"
        "print(type(llm.get_tokenizer()).__name__, 'transformers' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["GGUFTokenizer", "False"]
