"""`ctxpar serve` with the default model (SmolLM2-135M-Instruct): greedy
completions and chat, streamed or not, sync or async, equal LLM.generate and
LLM.chat token for token."""

from __future__ import annotations

import asyncio

import pytest

from ctxpar import LLM, SamplingParams
from helpers.server_harness import STOPPED, Server

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes or a server

NAME = "SmolLM2-135M-Instruct"  # the default model's served name
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a color."}],
]
N = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(["--threads", "1", "--quantization", "none"], log=tmp_path_factory.mktemp("serve_smollm") / "server.log")
    yield s
    assert s.stop() in STOPPED, s.log()


@pytest.fixture(scope="module")
def reference():
    greedy = SamplingParams(max_tokens=N, temperature=0)
    with LLM(num_threads=1, quantization="none") as llm:
        completions = [o.outputs[0] for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        chats = [llm.chat(c, greedy, use_tqdm=False)[0].outputs[0] for c in CHATS]
    return completions, chats


def test_served_name(server):
    assert [m.id for m in server.openai().models.list().data] == [NAME]


def test_completions_sync_and_streaming(server, reference):
    client = server.openai()
    r = client.completions.create(
        model=NAME, prompt=PROMPTS, max_tokens=N, temperature=0, extra_body={"return_token_ids": True}
    )
    for c, ref in zip(r.choices, reference[0]):
        assert c.token_ids == ref.token_ids and c.text == ref.text and c.finish_reason == ref.finish_reason
    for p, ref in zip(PROMPTS, reference[0]):
        chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=N, temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == ref.text


def test_chat_async_streaming_and_not(server, reference):
    async def run():
        client = server.async_openai()
        whole = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=NAME, messages=c, max_tokens=N, temperature=0, extra_body={"return_token_ids": True}
                )
                for c in CHATS
            )
        )
        streamed = []
        for c in CHATS:
            stream = await client.chat.completions.create(
                model=NAME, messages=c, max_tokens=N, temperature=0, stream=True
            )
            streamed.append("".join([ch.choices[0].delta.content or "" async for ch in stream]))
        return whole, streamed

    whole, streamed = asyncio.run(run())
    for r, text, ref in zip(whole, streamed, reference[1]):
        assert r.choices[0].token_ids == ref.token_ids and r.choices[0].message.content == ref.text == text
        assert r.choices[0].finish_reason == ref.finish_reason
