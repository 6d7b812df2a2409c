"""The grammar compiler's own process: a client's schema, regex or grammar is parsed and
compiled there, bounded in time and memory, and only the compiled grammar comes back.

xgrammar cannot interrupt a parse or a compile, and a schema of a few MB can take tens
of seconds and GBs (a deep ``allOf``), or end the process with ``std::bad_alloc``. In a
process of its own, with an address-space limit (RLIMIT_AS), such a spec costs what the
limit allows: past the compile timeout the process is killed, and past the memory it
dies or fails; either way the request gets an error and the next spec a fresh process.

    parent (GrammarWorker, on the backend's compile thread)      child (``main``)
      start: tokenizer info (xgrammar's JSON)        ──►  GrammarCompiler over it; "ready"
      compile(spec): the spec's fields as JSON       ──►  parse, compile
                     {"compiled": n}, then its n bytes
                     (xgrammar's JSON), or {"error"} ◄──
      past the timeout, or the child dead: kill it, start another at once

Messages are length-prefixed frames of JSON (no pickle: the child's answers are data).
"""

from __future__ import annotations

import json
import os
import re
import select
import struct
import subprocess
import sys
from typing import IO, Any

from ctxpar.errors import CtxparError
from ctxpar.structured_params import StructuredOutputsParams

_LENGTH = struct.Struct("<Q")
START_TIMEOUT_S = 120.0  # importing xgrammar on a loaded machine


class GrammarTimeout(CtxparError):
    """A spec's parse and compile took longer than the compile timeout (its process was killed)."""


def _message(e: BaseException) -> str:
    """xgrammar's error text without its '[time] /path/file.cc:line: ' prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip()).strip()


def _write(stream: IO[bytes], message: dict | bytes) -> None:
    """One frame: a JSON message, or bytes as they are (a compiled grammar's JSON: not escaped again)."""
    data = message if isinstance(message, bytes) else json.dumps(message).encode()
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    data = stream.read(n)
    if len(data) < n:
        raise EOFError
    return data


def _read_frame(stream: IO[bytes]) -> bytes:
    (n,) = _LENGTH.unpack(_read_exact(stream, _LENGTH.size))
    return _read_exact(stream, n)


def _read(stream: IO[bytes]) -> dict:
    return json.loads(_read_frame(stream))


class GrammarWorker:
    """The parent's end: one child at a time, used by one thread (the backend's compile thread).
    A child killed or dead is replaced at once, so that the next spec finds one started."""

    def __init__(self, tokenizer_info_json: str, memory_bytes: int) -> None:
        self.tokenizer_info_json = tokenizer_info_json
        self.memory_bytes = memory_bytes
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready = False  # the child has said so

    def compile(self, spec: StructuredOutputsParams, timeout: float) -> str:
        """The compiled grammar of ``spec`` as xgrammar's JSON; CtxparError if the spec is
        invalid or kills its process, GrammarTimeout if it needs more than ``timeout`` s."""
        proc = self.started()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            _write(proc.stdin, spec_message(spec))
            if not _wait(proc, timeout):
                self.replace()
                raise GrammarTimeout(
                    f"the grammar did not compile within {timeout:g} s (the server's --grammar-compile-timeout): "
                    "simplify the schema, regex or grammar"
                )
            status = _read(proc.stdout)
            compiled = _read_frame(proc.stdout) if "error" not in status else b""
        except (EOFError, OSError):
            self.replace()
            raise CtxparError(
                "the grammar compiler's process failed on this spec (past its memory limit of "
                f"{self.memory_bytes >> 20} MiB, the server's --grammar-memory-bytes, or a crash of xgrammar): "
                "simplify the schema, regex or grammar"
            ) from None
        if "error" in status:
            raise CtxparError(status["error"])
        return compiled.decode()

    def started(self) -> subprocess.Popen[bytes]:
        """The child, started (and its "ready" read) if it was not."""
        if self.proc is None or self.proc.poll() is not None:
            self.replace()
        assert self.proc is not None and self.proc.stdout is not None
        if not self.ready:
            try:
                if not _wait(self.proc, START_TIMEOUT_S) or _read(self.proc.stdout) != {"ready": True}:
                    raise EOFError
            except (EOFError, OSError):
                self.stop()
                raise CtxparError("the grammar compiler's process did not start (see the server's log)") from None
            self.ready = True
        return self.proc

    def replace(self) -> None:
        """Kill the child, if any, and start another (it gets ready while nothing waits on it)."""
        self.stop()
        cmd = [sys.executable, "-m", "ctxpar.engine.sample.grammar_worker", str(self.memory_bytes)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdin is not None
        _write(self.proc.stdin, {"tokenizer_info": self.tokenizer_info_json})

    def stop(self) -> None:
        """Kill the child (a compile running in it ends with it)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    stream.close()
        self.proc, self.ready = None, False


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether the child's answer (or its end) arrived within ``timeout`` s."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return bool(ready)


def spec_message(spec: StructuredOutputsParams) -> dict[str, Any]:
    """What the child is sent of a constraint: its kind, value and JSON options."""
    return {
        "kind": spec.kind,
        "value": getattr(spec, spec.kind),
        "any_whitespace": not spec.disable_any_whitespace,
        "closed": spec.disable_additional_properties,
    }


def build_grammar(xgr: Any, spec: dict[str, Any]) -> Any:
    """The xgrammar Grammar of a constraint sent by ``spec_message``."""
    kind, value = spec["kind"], spec["value"]
    if kind == "json":
        schema = json.loads(value)  # validate() made it a JSON string
        if spec["closed"]:
            schema = _closed(schema)
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=spec["any_whitespace"])
    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        return xgr.Grammar.from_regex(value)
    if kind == "choice":
        # JSON string literals are valid EBNF literals (same escapes).
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in value))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(value)
    return xgr.Grammar.from_structural_tag(_structural_tag(xgr, value))


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


def _structural_tag(xgr: Any, text: str) -> str:
    """vLLM's legacy {"structures": [{begin, schema, end}], "triggers": [...]} as
    xgrammar's current format; the current format ({"format": ...}) as it is."""
    tag = json.loads(text)
    if not isinstance(tag, dict) or "structures" not in tag:
        return json.dumps(tag)
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"]) for s in tag["structures"]]
    return xgr.StructuralTag.from_legacy_structural_tag(items, tag.get("triggers", [])).model_dump_json(indent=None)


def main() -> None:
    """The child: set the memory limit, then compile what the parent sends until it closes stdin."""
    import resource

    memory = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the answers
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(_read(stdin)["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write(stdout, {"ready": True})
    while True:
        try:
            spec = _read(stdin)
        except EOFError:
            return
        try:
            compiled = compiler.compile_grammar(build_grammar(xgr, spec)).serialize_json().encode()
        except MemoryError:
            os._exit(1)  # the parent reports the memory limit
        except Exception as e:  # xgrammar's RuntimeError / ValueError / its own error types
            _write(stdout, {"error": f"invalid structured_outputs.{spec['kind']}: {_message(e)}"})
            continue
        _write(stdout, {"compiled": len(compiled)})
        _write(stdout, compiled)


if __name__ == "__main__":
    main()
