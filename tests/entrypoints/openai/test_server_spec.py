"""`ctxpar serve --speculative-config` with the real SmolLM2, through the official openai
client: streamed and whole answers of a copy-heavy prompt (drafts mostly right) and a
free one are the greedy answers of the offline engine without speculation, several
tokens arrive in one chunk, and /metrics counts the drafts."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from helpers.server_harness import STOPPED, Server

pytestmark = pytest.mark.multiprocess  # starts a server

NAME = "SmolLM2-135M-Instruct"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
PASSAGE = (
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
    "the ninety steps, trimmed the wick and wound the clockwork that turned the great lens."
)
MESSAGES = [
    [{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}],
    [{"role": "user", "content": "Name three colours."}],
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_spec") / "server.log"
    s = Server(["--threads", "1", "--quantization", "none", "--speculative-config", json.dumps(NGRAM)], log=log)
    yield s
    assert s.stop() in STOPPED, s.log()


@pytest.fixture(scope="module")
def want() -> list[str]:
    from ctxpar import LLM, SamplingParams

    with LLM(None, num_threads=1, quantization="none") as llm:
        prompts = [llm.apply_chat_template(m)[0] for m in MESSAGES]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_answers_are_those_without_speculation(server, want):
    client = server.openai()
    chunked = []
    for messages, text in zip(MESSAGES, want, strict=True):
        kw = dict(model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.message.content == text
        deltas = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
            if c.choices
        ]
        assert "".join(deltas) == text
        chunked.append(len([d for d in deltas if d]))
    metrics = httpx.get(server.url + "/metrics").text
    found = dict(re.findall(r'^(ctxpar:spec_decode_\w+_total)\{model_name="[^"]+"\} ([0-9.e+]+)$', metrics, re.M))
    drafted, accepted = (
        float(found[f"ctxpar:spec_decode_{n}_total"]) for n in ("num_draft_tokens", "num_accepted_tokens")
    )
    assert 0 < accepted <= drafted
    # The copy: accepted drafts arrive with the token after them, several tokens per chunk.
    assert chunked[0] < MAX_TOKENS - 5
