"""A byte-level tokenizer for the tiny test models (vocab 256: one token per byte).

The tiny checkpoints of helpers/models.py have no tokenizer. Tests of text (stop
strings, detokenization, chat, the CLI) copy a tiny model and add this one,
built offline with the `tokenizers` library. Random models emit arbitrary
bytes, so it also exercises incomplete UTF-8 sequences in the detokenizer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def with_byte_tokenizer(model_dir: Path, out_dir: Path) -> Path:
    """Copy a tiny model directory and save the byte tokenizer into the copy."""
    if not out_dir.exists():
        shutil.copytree(model_dir, out_dir)
        byte_tokenizer().save_pretrained(out_dir)
    return out_dir
