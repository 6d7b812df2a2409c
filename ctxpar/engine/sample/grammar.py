"""Constrained decoding on xgrammar: grammars compiled once, one matcher per request, a bitmask per step.

    add_request ──► GrammarBackend.grammar(spec)   parse now: a bad schema fails the request alone
                └─► GrammarBackend.compile(spec)   a Future, on a worker thread, cached by spec.key()
                                                   in a bounded LRU (grammar_cache.py)
    Engine.step: a request joins the scheduler once its grammar is compiled, or
                 fails alone once the compile has taken longer than ``compile_timeout``
      logits (S, V) ──► apply_bitmasks: each constrained row's matcher fills its row
                        of an (S, ceil(V/32)) int32 bitmask; one in-place masking of
                        all those rows sets disallowed logits to -inf
      sampler (logprobs, penalties, sampling all see the masked logits, as in vLLM)
      after the step commits: matcher.accept_token(token)

A step that fails advances no matcher (tokens are accepted only after the
commit), and preemption keeps a request's output tokens, so its matcher stays
valid: nothing has to be rolled back. xgrammar is imported only when the first
constrained request arrives.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ctxpar.engine.sample.grammar_cache import DEFAULT_CACHE_BYTES, DEFAULT_COMPILE_TIMEOUT_S, GrammarCache
from ctxpar.errors import CtxparError
from ctxpar.structured_params import StructuredOutputsParams


def _message(e: Exception) -> str:
    """xgrammar's error text without its '[time] /path/file.cc:line: ' prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip()).strip()


class GrammarBackend:
    """xgrammar over the engine's tokenizer: parses, compiles (cached) and hands out matchers."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        if tokenizer is None:
            raise CtxparError("structured outputs need a tokenizer: this model has none")
        if not stop_token_ids:
            raise CtxparError(
                "structured outputs need an end-of-sequence token to end a complete structure, and this model "
                "defines none (eos_token_id in its config.json)"
            )
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.cache = GrammarCache(cache_bytes)
        self.compile_timeout = compile_timeout
        # One thread: compiles run beside the step loop (xgrammar releases the GIL), in order.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxpar-grammar")

    def grammar(self, spec: StructuredOutputsParams) -> Any:
        """The xgrammar Grammar of a constraint; CtxparError naming the problem if it is invalid."""
        xgr = self.xgr
        try:
            if spec.json is not None:
                schema = json.loads(cast(str, spec.json))  # validate() made it a JSON string
                if spec.disable_additional_properties:
                    schema = _closed(schema)
                return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=not spec.disable_any_whitespace)
            if spec.json_object:
                return xgr.Grammar.builtin_json_grammar()
            if spec.regex is not None:
                return xgr.Grammar.from_regex(spec.regex)
            if spec.choice is not None:
                # JSON string literals are valid EBNF literals (same escapes).
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            if spec.grammar is not None:
                return xgr.Grammar.from_ebnf(spec.grammar)
            return xgr.Grammar.from_structural_tag(_structural_tag(xgr, spec.structural_tag))
        except CtxparError:
            raise
        except Exception as e:  # xgrammar's RuntimeError / ValueError / its own error types
            raise CtxparError(f"invalid structured_outputs.{spec.kind}: {_message(e)}") from None

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``spec``, as a Future; the first request of a
        spec compiles it on the worker thread, the others share the result."""
        key = spec.key()
        fut = self.cache.get(key)
        if fut is None:
            grammar = self.grammar(spec)  # outside the cache's lock: a large schema takes a while
            fut = self.cache.get_or_compile(key, lambda: self.pool.submit(self.compiler.compile_grammar, grammar))
        return fut

    def timeout_error(self) -> CtxparError:
        """What a request whose grammar took longer than ``compile_timeout`` is told."""
        return CtxparError(
            f"the grammar did not compile within {self.compile_timeout:g} s (the server's --grammar-compile-timeout): "
            "simplify the schema, regex or grammar"
        )

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class RequestGrammar:
    """One request's (one sample's) place in its grammar."""

    compiled: Future
    matcher: Any = field(default=None)

    def ready(self, backend: GrammarBackend) -> bool:
        """True once compiled (the matcher is made then); raises the compile error if it failed."""
        if self.matcher is None:
            if not self.compiled.done():
                return False
            self.matcher = backend.matcher(self.compiled.result())
        return True

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise AssertionError(f"the grammar refused token {token} its own mask allowed")

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return bool(self.matcher.is_terminated())


def apply_bitmasks(backend: GrammarBackend, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> None:
    """Set to -inf, in place, every logit of logits (S, V) that row i's grammar
    does not allow next; rows whose grammar is None are left alone."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    xgr = backend.xgr
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], backend.vocab_size)  # (S, ceil(V/32)) int32
    for i in rows:
        grammars[i].matcher.fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=backend.vocab_size, indices=rows)


def _closed(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object schema in it."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions", "patternProperties") and isinstance(v, dict):
            out[k] = {name: _closed(s) for name, s in v.items()}  # names -> schemas
        elif k in ("const", "enum", "default", "examples"):
            out[k] = v  # values, not schemas
        else:
            out[k] = _closed(v)
    if out.get("type") == "object" or "properties" in out:
        out["additionalProperties"] = False
    return out


def _structural_tag(xgr: Any, text: str | dict | None) -> str:
    """vLLM's legacy {"structures": [{begin, schema, end}], "triggers": [...]} as
    xgrammar's current format; the current format ({"format": ...}) as it is."""
    tag = json.loads(text) if isinstance(text, str) else text
    if not isinstance(tag, dict) or "structures" not in tag:
        return json.dumps(tag)
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"]) for s in tag["structures"]]
    return xgr.StructuralTag.from_legacy_structural_tag(items, tag.get("triggers", [])).model_dump_json(indent=None)
