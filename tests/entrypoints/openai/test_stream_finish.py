"""A stream that ends on a token adding no text still ends with its finish_reason.

A stop token (``stop_token_ids``) or EOS ends generation without adding its
text, so the last output brings no new text: only the end. The streams, the
server's SSE ones (completions and chat, through the official openai client)
and the offline ``LLM.stream_outputs``, must still deliver that end: exactly
one finish_reason "stop", on the last chunk, with the text equal to the
non-streamed completion's.

The stop token is taken from a non-streamed greedy run (it is then where the
completion must stop); EOS likewise, from a greedy run before the model copy
that declares it is made. Both are chosen where all the text before them is
complete (no partial UTF-8 character, which the end would flush), so the last
chunk really carries no text: the case under test, checked too.
"""

from __future__ import annotations

import json
import shutil

import pytest

from ctxpar import LLM, SamplingParams
from helpers.server_harness import STOPPED, Server
from helpers.tiny_tokenizer import with_byte_tokenizer

NAME = "tiny"
N = 16
PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "hi"}]


def clean_ends(tokenizer, ids: list[int]) -> list[int]:
    """Positions k at which generation can be made to stop (ids[k] appears first
    there) leaving some text, all of it complete: the k-th token would add none."""
    return [
        k
        for k in range(1, len(ids))
        if ids[k] not in ids[:k] and (t := tokenizer.decode(ids[:k])) and "\ufffd" not in t
    ]


def first_hit(ids: list[int], tokens: set[int]) -> int | None:
    return next((k for k, t in enumerate(ids) if t in tokens), None)


@pytest.fixture(scope="module")
def plan(tiny_model_dirs, tmp_path_factory):
    """A copy of the tiny model whose EOS tokens end the greedy completion of
    PROMPT and of MESSAGES at a clean position: (model dir, EOS ids)."""
    root = tmp_path_factory.mktemp("stream_finish")
    base = with_byte_tokenizer(tiny_model_dirs["llama"], root / "base")  # no EOS (TINY_COMMON of helpers/models.py)
    greedy = SamplingParams(max_tokens=N, temperature=0)
    with LLM(str(base), num_threads=1) as llm:
        tok = llm.get_tokenizer()
        cmpl = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
        chat = llm.chat(MESSAGES, greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert len(cmpl) == len(chat) == N  # nothing ends them yet
        # One EOS id for each; each must also not end the other one early (at an unclean place).
        ok_cmpl, ok_chat = clean_ends(tok, cmpl), clean_ends(tok, chat)
        eos = next(
            (
                {cmpl[a], chat[c]}
                for a in reversed(ok_cmpl)
                for c in reversed(ok_chat)
                if first_hit(cmpl, {cmpl[a], chat[c]}) in ok_cmpl and first_hit(chat, {cmpl[a], chat[c]}) in ok_chat
            ),
            None,
        )
    assert eos is not None, f"no clean EOS for the greedy completions {cmpl} and {chat}"
    d = root / "eos"
    shutil.copytree(base, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = sorted(eos)
    (d / "config.json").write_text(json.dumps(cfg))
    return d, eos


@pytest.fixture(scope="module")
def llm(plan):
    with LLM(str(plan[0]), num_threads=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(plan, tmp_path_factory):
    args = ["--model", str(plan[0]), "--served-model-name", NAME, "--threads", "1", "--kv-cache-blocks", "256"]
    s = Server(args, log=tmp_path_factory.mktemp("stream_finish_log") / "server.log")
    yield s
    assert s.stop() in STOPPED, s.log()
    assert "Traceback" not in s.log()


def expected_end(tokenizer, full: list[int], k: int, text: str) -> None:
    """The non-streamed completion stopped at full[k], without that token's text."""
    assert text == tokenizer.decode(full[:k]) and "\ufffd" not in text and text
    assert tokenizer.decode(full[: k + 1]) != text  # the token has text of its own: left out


# -- the server ---------------------------------------------------------------


def create(client, endpoint: str, **kw):
    if endpoint == "completions":
        return client.completions.create(model=NAME, prompt=PROMPT, **kw)
    return client.chat.completions.create(model=NAME, messages=MESSAGES, **kw)


def whole(r, endpoint: str) -> tuple[str, list[int], str, object]:
    """(text, token ids, finish_reason, stop_reason) of a non-streamed response's only choice."""
    [c] = r.choices
    text = c.text if endpoint == "completions" else c.message.content
    return text, c.token_ids, c.finish_reason, c.model_extra.get("stop_reason")


@pytest.mark.multiprocess
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("ending", ["stop_token_ids", "eos"])
def test_server_stream_ends_with_finish_reason(server, llm, plan, endpoint, ending):
    client = server.openai()
    tok = llm.get_tokenizer()
    eos = plan[1]
    base = dict(max_tokens=N, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    full = whole(create(client, endpoint, **base), endpoint)[1]  # the greedy tokens, nothing stopping them
    assert len(full) == N
    if ending == "stop_token_ids":
        k = max(clean_ends(tok, full))  # the latest, so that text chunks come before the end
        stop = full[k]
        extra = {"return_token_ids": True, "ignore_eos": True, "stop_token_ids": [stop]}
    else:
        k = first_hit(full, eos)
        assert k is not None and k in clean_ends(tok, full)
        stop = None  # EOS has no stop_reason, as in vLLM
        extra = {"return_token_ids": True}
    ref_text, ref_ids, ref_finish, ref_stop = whole(
        create(client, endpoint, max_tokens=N, temperature=0, extra_body=extra), endpoint
    )
    assert ref_ids == full[: k + 1] and ref_finish == "stop" and ref_stop == stop
    expected_end(tok, full, k, ref_text)

    chunks = list(create(client, endpoint, max_tokens=N, temperature=0, stream=True, extra_body=extra))
    choices = [c for ch in chunks for c in ch.choices]
    assert all(c.index == 0 for c in choices)
    if endpoint == "completions":
        texts = [c.text for c in choices]
    else:
        assert choices[0].delta.role == "assistant"
        texts = [c.delta.content or "" for c in choices]
    reasons = [c.finish_reason for c in choices]
    assert [r for r in reasons if r is not None] == ["stop"]  # exactly once
    assert reasons[-1] == "stop"  # on the last chunk
    assert texts[-1] == ""  # the case under test: the end brings no text
    assert sum(1 for t in texts if t) >= 1  # the text came before it
    assert "".join(texts) == ref_text
    assert [t for c in choices for t in (c.model_extra.get("token_ids") or [])] == ref_ids
    assert choices[-1].model_extra.get("stop_reason") == stop


# -- offline ------------------------------------------------------------------


@pytest.mark.parametrize("ending", ["stop_token_ids", "eos"])
def test_llm_stream_outputs_end_finished(llm, plan, ending):
    tok = llm.get_tokenizer()
    [full] = llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True), use_tqdm=False)
    full = full.outputs[0].token_ids
    if ending == "stop_token_ids":
        k = max(clean_ends(tok, full))
        params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, stop_token_ids=[full[k]])
        stop = full[k]
    else:
        k = first_hit(full, plan[1])
        assert k is not None and k in clean_ends(tok, full)
        params = SamplingParams(max_tokens=N, temperature=0)
        stop = None
    [ref] = llm.generate([PROMPT], params, use_tqdm=False)
    ref = ref.outputs[0]
    assert ref.token_ids == full[: k + 1] and ref.finish_reason == "stop" and ref.stop_reason == stop
    expected_end(tok, full, k, ref.text)

    outs = list(llm.stream_outputs(PROMPT, params))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    last = outs[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert [o.outputs[0].finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)
    assert last.text == ref.text and last.token_ids == ref.token_ids
    assert len(outs) >= 2 and outs[-2].outputs[0].text == ref.text  # the end brings no text
    assert "".join(llm.stream(PROMPT, params)) == ref.text
