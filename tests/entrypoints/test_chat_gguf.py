"""Chats of the shipped SmolLM2 GGUF rendered without transformers: ctxpar's prompt and
tokens (entrypoints/chat.py over models/gguf_tokenizer.py and entrypoints/chat_template.py)
against transformers' own GGUF tokenizer's ``apply_chat_template``; ``LLM.chat`` in a fresh
process never imports transformers; a model whose template is not valid Jinja gets a 400
from the server naming the problem, while its completions are served."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Any

import httpx
import pytest

from ctxpar.entrypoints.chat import render_chat
from ctxpar.models import gguf, gguf_tokenizer
from ctxpar.models.loader import default_model_path
from helpers.server_harness import STOPPED, Server
from helpers.tiny_tokenizer import with_byte_tokenizer

CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "What is 2+2?"}], {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü 中文 <|im_end|>"}], {}),
    (
        [
            {"role": "user", "content": "A?"},
            {"role": "assistant", "content": "B."},
            {"role": "user", "content": "C?"},
        ],
        {},
    ),
    ([{"role": "user", "content": "A?"}, {"role": "assistant", "content": "B."}], {"add_generation_prompt": False}),
    (
        [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "The answer is "}],
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
]


@functools.cache
def reference() -> Any:
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm2_chats_are_transformers() -> None:
    d, temporary = gguf.gguf_to_hf_dir(default_model_path())
    tok = gguf_tokenizer.load(d)
    assert tok is not None and not temporary
    ref = reference()
    assert tok.special_tokens_map == ref.special_tokens_map
    for messages, options in CONVERSATIONS:
        text = ref.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **options})
        got = render_chat(tok, messages, **options)
        assert got["prompt"] == text, (messages, options)
        assert got["prompt_token_ids"] == ref.encode(text, add_special_tokens=False)
    assert tok._hf is None  # all of it without building transformers' tokenizer


@pytest.mark.multiprocess
def test_a_chat_in_a_fresh_process_imports_no_transformers() -> None:
    """The loader's path for a converted GGUF (the cache, as a restart finds it), then
    LLM.chat: the prompt is transformers' (computed here), and transformers never loaded there."""
    path = default_model_path()
    gguf.gguf_to_hf_dir(path)
    messages = CONVERSATIONS[1][0]
    script = (
        "import json, sys\n"
        "from ctxpar import LLM, SamplingParams\n"
        f"llm = LLM(model={str(path)!r}, max_model_len=128)\n"
        f"[out] = llm.chat({messages!r}, SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "print(json.dumps([out.prompt, out.prompt_token_ids, 'transformers' in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    prompt, ids, imported = json.loads(done.stdout.splitlines()[-1])
    text = reference().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (prompt, ids, imported) == (text, reference().encode(text, add_special_tokens=False), False)


@pytest.mark.multiprocess
def test_a_template_that_is_not_jinja_answers_400(tiny_model_dirs, tmp_path_factory) -> None:
    out = with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("bad_template") / "llama")
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }"  # no endfor, an unclosed }}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    log = tmp_path_factory.mktemp("bad_template_log") / "server.log"
    s = Server(["--model", str(out), "--threads", "1", "--kv-cache-blocks", "64"], log=log)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "the chat template is not valid Jinja (line 1:" in message and "Traceback" not in r.text, message
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "The", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        assert s.stop() in STOPPED, s.log()
