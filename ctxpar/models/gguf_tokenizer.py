"""A GGUF file's tokenizer, loaded without importing transformers.

Importing transformers and building its tokenizer class is ~0.6 s of Python on
every start, most of a cold start's time after torch's import (docs/benchmarks.md,
`ctxpar bench cold`). A GGUF's tokenizer is converted once, by transformers, into
its cache directory (models/gguf.py); what transformers' class for it
(``TokenizersBackend``) encodes and decodes with is a ``tokenizers.Tokenizer``,
which ``snapshot`` saves there as that class holds it once loaded (its special
tokens added, its post-processor set), with the few facts the engine reads of the
class. ``GGUFTokenizer`` loads that snapshot with the ``tokenizers`` library alone
and answers what the engine asks before and while it generates (encode, decode,
the special tokens' ids, the chat template's text and the special tokens it is
given, which entrypoints/chat_template.py renders without transformers) as
``TokenizersBackend`` does: the same library object in the same state. Everything
else a caller may ask of a Hugging Face tokenizer (``apply_chat_template``,
``__call__``, what xgrammar reads) is the ``TokenizersBackend`` itself, built on
first use (``hf``).

Where the class transformers picks is another one, or its decode would clean up
spaces in Python (``clean_up_tokenization_spaces`` on a non-BPE model), no snapshot
is written and the loader builds transformers' tokenizer as before.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

SNAPSHOT = "ctxpar_tokenizer.json"  # the tokenizers object, as its own save writes it
FACTS = "ctxpar_tokenizer_facts.json"
# What the engine and its callers read of a tokenizer as plain values.
_FACTS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template")


def snapshot(out_dir: Path) -> None:
    """Save ``out_dir``'s tokenizer (as transformers saved it there) for ``GGUFTokenizer``:
    the ``tokenizers`` object of the loaded ``TokenizersBackend`` and its facts. Writes
    nothing for another class, or one whose decode cleans up spaces (see the module's
    docstring): ``load`` then returns None."""
    from transformers import TokenizersBackend

    if json.loads((out_dir / "tokenizer_config.json").read_text()).get("tokenizer_class") != "TokenizersBackend":
        return
    tok = TokenizersBackend.from_pretrained(str(out_dir))
    if _cleans_up(tok):
        return
    facts = {name: getattr(tok, name) for name in _FACTS}
    facts["split_special_tokens"] = bool(tok.split_special_tokens)
    facts["special_tokens_map"] = dict(tok.special_tokens_map)  # bos_token, eos_token, ... as the template sees them
    tok.backend_tokenizer.save(str(out_dir / SNAPSHOT))  # read back by from_file: no JSON round trip in Python
    (out_dir / FACTS).write_text(json.dumps(facts))


def _cleans_up(tok: Any) -> bool:
    """Whether ``tok.decode`` rewrites the spaces of the text (TokenizersBackend._decode:
    only where asked, and never for a BPE unless forced)."""
    if not tok.clean_up_tokenization_spaces:
        return False
    is_bpe = type(tok.backend_tokenizer.model).__name__ == "BPE"
    return not is_bpe or bool(tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output)


def load(d: Path) -> GGUFTokenizer | None:
    """The snapshot in ``d`` as a ``GGUFTokenizer``; None where ``d`` holds none."""
    if not (d / SNAPSHOT).is_file() or not (d / FACTS).is_file():
        return None
    from tokenizers import Tokenizer

    facts = json.loads((d / FACTS).read_text())
    backend = Tokenizer.from_file(str(d / SNAPSHOT))
    backend.encode_special_tokens = facts["split_special_tokens"]
    return GGUFTokenizer(d, backend, facts)


class GGUFTokenizer:
    """transformers' ``TokenizersBackend`` of a converted GGUF directory, its encode and
    decode run by the same ``tokenizers`` object without transformers (see the module's
    docstring); any other attribute is that of ``hf``, built on first use."""

    def __init__(self, d: Path, backend: Any, facts: dict[str, Any]) -> None:
        self._dir = d
        self.backend_tokenizer = backend
        self.bos_token_id: int | None = facts["bos_token_id"]
        self.eos_token_id: int | None = facts["eos_token_id"]
        self.pad_token_id: int | None = facts["pad_token_id"]
        self.unk_token_id: int | None = facts["unk_token_id"]
        self.chat_template: str | None = facts["chat_template"]
        # {"bos_token": "<s>", ...}: the named special tokens, as transformers gives them to a chat template.
        self.special_tokens_map: dict[str, str] = facts["special_tokens_map"]
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of ``text`` (with the BOS and what else the post-processor adds, unless
        ``add_special_tokens`` is False); transformers' encode for any other argument."""
        if kwargs or not isinstance(text, str):
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        """The text of ``token_ids`` (an id or a list of ids; transformers' decode for a batch,
        a tensor or another argument). ``spaces_between_special_tokens`` changes nothing, as in
        TokenizersBackend; nor does ``clean_up_tokenization_spaces``, which ``snapshot`` saw off."""
        kwargs.pop("spaces_between_special_tokens", None)
        kwargs.pop("clean_up_tokenization_spaces", None)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if kwargs or not isinstance(token_ids, (list, tuple)) or not all(isinstance(t, int) for t in token_ids):
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf(*args, **kwargs)

    @property
    def hf(self) -> Any:
        """transformers' tokenizer of the same directory (imports transformers on first use)."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import TokenizersBackend

                self._hf = TokenizersBackend.from_pretrained(str(self._dir))
            return self._hf

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (a copy, another process) without its lock or transformers' tokenizer, rebuilt there on use.
        return {k: v for k, v in self.__dict__.items() if k not in ("_hf", "_hf_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _hf=None, _hf_lock=threading.Lock())

    def __getattr__(self, name: str) -> Any:
        # Only names this class lacks reach here; private ones (pickle's, copy's probes) stay
        # missing rather than building transformers' tokenizer.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)
