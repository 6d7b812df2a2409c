"""The compiled-grammar cache stays within its byte bound however many distinct
grammars clients send (the attack of xgrammar's GHSA-389x-67px-mjg3: one new schema
per request until the server's memory is gone), keeps the recently used ones,
and a request whose grammar compiles for too long fails alone with the timeout."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import xgrammar as xgr

from ctxpar.engine.sample.grammar_cache import GrammarCache, key_bytes
from ctxpar.engine.sample.structured_output import StructuredOutputs
from ctxpar.sampling_params import StructuredOutputsParams
from helpers.tiny_tokenizer import byte_tokenizer

BOUND = 200_000  # bytes: some tens of these tiny grammars


@pytest.fixture(scope="module")
def compiler():
    # A 257-token vocabulary: a tiny schema compiles in a fraction of a millisecond.
    info = xgr.TokenizerInfo([chr(i) for i in range(256)] + ["</s>"], stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def schema(i: int) -> str:
    return json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]})


def test_10000_distinct_schemas_stay_within_the_bound(compiler):
    cache = GrammarCache(BOUND)
    pool = ThreadPoolExecutor(max_workers=1)
    peak_bytes = peak_len = 0
    try:
        for i in range(10_000):
            key = ("json", schema(i), False, False)
            grammar = xgr.Grammar.from_json_schema(schema(i))
            fut = cache.get_or_compile(key, lambda g=grammar: pool.submit(compiler.compile_grammar, g))
            fut.result()  # as a request does: it waits for its grammar
            peak_bytes, peak_len = max(peak_bytes, cache.nbytes), max(peak_len, len(cache))
    finally:
        pool.shutdown()
    size = key_bytes(key) + fut.result().memory_size_bytes  # an entry's real cost
    assert peak_bytes <= BOUND + size  # the newest entry is charged once its compile is done
    assert cache.nbytes <= BOUND
    assert len(cache) >= BOUND // size - 2  # filled to its bound, not emptied
    assert peak_len < 2 * BOUND // size  # entries vary a little in size, not the count's order
    assert key in list(cache)  # the newest is kept


def done(value: object) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def test_least_recently_used_goes_first():
    cache = GrammarCache(3 * 100)
    compiled = SimpleNamespace(memory_size_bytes=100 - key_bytes(("a",)))  # 100 bytes an entry, key and all
    for k in "abc":
        cache.get_or_compile((k,), lambda: done(compiled))
    assert cache.get(("a",)) is not None  # now the most recently used
    cache.get_or_compile(("d",), lambda: done(compiled))  # past the bound: b, the least recently used, goes
    cache.get_or_compile(("e",), lambda: done(compiled))  # then c
    assert list(cache) == [("a",), ("d",), ("e",)] and cache.nbytes <= 300


def test_failed_and_cancelled_compiles_are_not_kept():
    cache = GrammarCache(1000)
    failed: Future = Future()
    failed.set_exception(RuntimeError("no"))
    cache.get_or_compile(("bad",), lambda: failed)
    cancelled: Future = Future()
    cache.get_or_compile(("gone",), lambda: cancelled)
    cancelled.cancel()
    assert cache.get(("gone",)) is None  # a new request compiles it anew
    assert cache.nbytes == 0 and list(cache) == []
    fresh = done(SimpleNamespace(memory_size_bytes=1))
    assert cache.get_or_compile(("bad",), lambda: fresh) is fresh


def test_a_grammar_past_the_compile_timeout_fails_its_request_alone():
    """A spec whose compile runs past the timeout (thousands of patterned properties) fails
    its request with the timeout's message, its compiler process killed; the next one is
    served by a fresh process."""
    tok = byte_tokenizer()
    structured = StructuredOutputs(tok, len(tok), [0])
    structured.configure(cache_bytes=1 << 20, compile_timeout=0.2)
    properties = {f"p{i}": {"type": "string", "pattern": f"^x{i}[a-z]{{2,9}}$"} for i in range(3000)}
    slow_schema = {"type": "object", "properties": properties, "required": list(properties)}

    def group(spec: StructuredOutputsParams) -> SimpleNamespace:
        fut = structured.compile(spec)
        return SimpleNamespace(samples=[SimpleNamespace(grammar=SimpleNamespace(compiled=fut))])

    def wait_all() -> list:
        t0, results = time.monotonic(), []
        while structured.compiling and time.monotonic() - t0 < 60:
            results += structured.take_ready(block=True)
        return results

    try:
        structured.backend.worker.started()  # its start (importing xgrammar) is not the compile's time
        slow = group(StructuredOutputsParams(json=slow_schema))
        structured.compiling = [slow]
        [(failed, error)] = wait_all()
        assert failed is slow and "--grammar-compile-timeout" in str(error) and "0.2 s" in str(error)
        slow.samples[0].grammar.compiled.exception(timeout=10)  # the worker's own deadline: killed
        structured.backend.worker.started()  # killed and replaced: a fresh process
        fast = group(StructuredOutputsParams(choice=["fast"]))
        structured.compiling = [fast]
        assert wait_all() == [(fast, None)]
    finally:
        structured.close()
