"""AsyncLLM (issue 24): many concurrent generators on one event loop, each
surviving request exactly as LLM.generate gives it alone (the default model and
configuration: SmolLM2's GGUF, its blocks kept quantized; a request's bits do
not depend on what else runs), cancelled and aborted ones ended and freed, DELTA
outputs, and a fatal engine error (a rank killed) reaching every waiting
generator without a hang."""

from __future__ import annotations

import asyncio
import random

import pytest

from ctxpar import LLM, AsyncEngineArgs, AsyncLLM, SamplingParams
from ctxpar.engine.async_llm import EngineDeadError
from ctxpar.sampling_params import RequestOutputKind
from helpers.tiny_tokenizer import with_byte_tokenizer

SMALL = dict(max_model_len=128, kv_cache_bytes=1 << 22, num_threads=1)  # the tiny model's
DEFAULT = dict(max_model_len=128, num_kv_blocks=256, num_threads=1)  # the default model's
N = 32


@pytest.fixture(scope="module")
def text_dir(tiny_model_dirs, tmp_path_factory):
    return str(with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("async_llm") / "llama_bytes"))


def workload() -> list[tuple[str, SamplingParams]]:
    rng = random.Random(0)
    reqs = []
    for i in range(N):
        prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 60)))
        reqs.append((prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=True)))
    return reqs


@pytest.fixture(scope="module")
def reference():
    """Each request generated alone, offline."""
    with LLM(**DEFAULT) as llm:
        return [llm.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids for p, s in workload()]


def aborted(i: int) -> bool:
    return i % 7 == 3 and i % 5 != 0


async def drive(engine: AsyncLLM) -> dict[int, list[int] | str]:
    """N generators at once: every 5th cancelled after its first output, others
    (``aborted``) aborted after their first; the rest read to the end. Per
    request: its tokens, or "cancelled"."""
    results: dict[int, list[int] | str] = {}
    first_seen = {i: asyncio.Event() for i in range(N)}

    async def one(i: int, prompt: str, params: SamplingParams) -> None:
        tokens: list[int] = []
        async for out in engine.generate(prompt, params, request_id=f"r{i}"):
            tokens = out.outputs[0].token_ids
            first_seen[i].set()
            if aborted(i) and not out.finished:
                await engine.abort(f"r{i}")
        results[i] = tokens

    tasks = {i: asyncio.create_task(one(i, p, s)) for i, (p, s) in enumerate(workload())}
    for i in range(0, N, 5):
        await first_seen[i].wait()
        tasks[i].cancel()
    for i, t in tasks.items():
        try:
            await t
        except asyncio.CancelledError:
            results[i] = "cancelled"
    await settle(engine)
    return results


async def settle(engine: AsyncLLM) -> None:
    """Wait (a bounded time) for the engine thread to take the aborts posted by leaving generators."""
    for _ in range(500):
        if not engine.llm_engine.engine.groups:
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("pcp", [1, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_concurrent_generators_match_llm_generate_alone(reference, pcp):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(pcp_size=pcp, **DEFAULT))
    try:
        results = asyncio.run(asyncio.wait_for(drive(engine), timeout=300))
        assert engine.is_running and not engine.errored
        for i in range(N):
            if i % 5 == 0:
                assert results[i] == "cancelled" or results[i] == reference[i]  # it may have finished first
            elif aborted(i):
                got = results[i]
                assert isinstance(got, list) and got == reference[i][: len(got)]  # a prefix, then it ended
            else:
                assert results[i] == reference[i], i
        # Cancelled and aborted requests are gone from the engine, their blocks free.
        inner = engine.llm_engine.engine
        assert not inner.has_unfinished_requests() and not inner.groups
        assert inner.block_manager.num_free_blocks == inner.block_manager.num_blocks
    finally:
        engine.shutdown()
    assert not engine.is_running


def test_delta_generator_and_an_abandoned_one(reference):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**DEFAULT))
    prompt, params = workload()[1]

    async def main():
        delta = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True)
        delta.output_kind = RequestOutputKind.DELTA
        pieces = [out.outputs[0].token_ids async for out in engine.generate(prompt, delta, "d")]
        gen = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), "abandoned")
        await gen.__anext__()
        await gen.aclose()  # the caller stops reading: the request is aborted
        await settle(engine)
        return pieces

    try:
        pieces = asyncio.run(main())
        assert [t for p in pieces for t in p] == reference[1] and all(len(p) == 1 for p in pieces)
        assert not engine.llm_engine.engine.groups
        # Only the delta request finished: the abandoned one was aborted, not run to its 100 tokens.
        finished = [m for m in engine.llm_engine.get_metrics() if m.name == "vllm:request_success"]
        assert sum(m.value for m in finished) == 1, finished
    finally:
        engine.shutdown()


@pytest.mark.multiprocess
def test_a_lost_rank_fails_every_waiting_generator(text_dir):
    """With recovery off (tests/executor/test_rank_recovery.py has it on)."""
    args = AsyncEngineArgs(model=text_dir, pcp_size=2, max_rank_recoveries=0, **SMALL)
    engine = AsyncLLM.from_engine_args(args)

    async def main():
        async def one(i):
            params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
            async for out in engine.generate("abc" * (i + 1), params, request_id=f"x{i}"):
                if i == 0 and len(out.outputs[0].token_ids) == 2:
                    engine.llm_engine.engine.executor.procs[0].kill()  # rank 1 dies mid-generation

        return await asyncio.gather(*(one(i) for i in range(4)), return_exceptions=True)

    try:
        results = asyncio.run(asyncio.wait_for(main(), timeout=120))
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert engine.errored and not engine.is_running and "rank" in str(engine.dead_error)

        async def later():
            async for _ in engine.generate("a", SamplingParams(max_tokens=1), request_id="later"):
                pass

        with pytest.raises(EngineDeadError):
            asyncio.run(later())
    finally:
        engine.shutdown()
