"""Serve a model over an OpenAI-compatible HTTP API (like `vllm serve`).

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming with
"stream": true), /tokenize, /detokenize, /health and /metrics (Prometheus).
Many concurrent requests share each engine step. Ctrl-C or SIGTERM stops
accepting, lets requests in flight finish for --timeout-graceful-shutdown
seconds (10), ends the rest with an error, then stops the PCP ranks: the
process is gone within that time + 5 s in every case (a second signal: at
once). Client limits (concurrency, queue, body sizes, prompts and sequences
per request, grammars, slow clients) are flags below; /health says healthy,
degraded (at those limits) or dead (503).

With an API key (CTXPAR_API_KEY in the environment: a command line, and so
--api-key, is readable by every user of the machine in /proc), every path
but /health needs it, /metrics too unless --public-metrics; a request without
it is refused before its body is read, and gets /health's status alone and
/metrics without the prefix cache's counts. /docs, /redoc and /openapi.json
are off unless --enable-docs. Without a key (warned about), only requests
addressed to an IP address, localhost or --host are served. Every POST body
must be JSON (Content-Type: application/json).

examples:
  ctxpar serve
  CTXPAR_API_KEY=$(cat ~/.ctxpar-key) ctxpar serve --model ./my-llama --pcp 2 --host 0.0.0.0
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}'
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading

from ctxpar.checks import int_arg, positive_int
from ctxpar.engine.arg_utils import EngineArgs
from ctxpar.entrypoints.openai.access import Access, startup_warnings
from ctxpar.entrypoints.openai.limits import ServerLimits
from ctxpar.entrypoints.openai.tools import TOOL_PARSERS
from ctxpar.errors import CtxparError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    s = p.add_argument_group("server")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: 127.0.0.1, this machine only; any other without an API key is warned about)",
    )
    s.add_argument("--port", type=int_arg(0, 65535), default=8000, help="port to bind (default: 8000; 0 = any free)")
    s.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("CTXPAR_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every path but /health (default: $CTXPAR_API_KEY, the "
        "better way to give it: a command line is visible to every local user in /proc; none = open)",
    )
    s.add_argument(
        "--enable-docs",
        action="store_true",
        help="serve the API's description (/docs, /redoc, /openapi.json), without the key (default: off, 404)",
    )
    s.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve /metrics without the API key, for a Prometheus scraper (default: with a key, /metrics needs it)",
    )
    s.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send (default: --model as given, or the default model's name)",
    )
    _add_limits(p.add_argument_group("client limits"))
    t = p.add_argument_group("tool calling")
    t.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    t.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        help='how tool calls are found in the model\'s text with tool_choice "auto" '
        "(hermes: <tool_call>{...}</tool_call>, as Qwen and SmolLM templates write them)",
    )
    EngineArgs.add_cli_args(p)


def _add_limits(g: argparse._ArgumentGroup) -> None:
    d = ServerLimits()
    g.add_argument(
        "--limit-concurrency",
        type=positive_int,
        default=d.limit_concurrency,
        metavar="N",
        help=f"generation requests in the engine at once (default: {d.limit_concurrency}); more wait in the queue",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int_arg(0),
        default=d.max_queued_requests,
        metavar="N",
        help=f"generation requests waiting for a slot (default: {d.max_queued_requests}); beyond, 503 with Retry-After",
    )
    g.add_argument(
        "--max-body-size",
        type=positive_int,
        default=d.max_body_size,
        metavar="BYTES",
        help=f"largest request body (default: {d.max_body_size}, 16 MiB); larger: 413",
    )
    g.add_argument(
        "--timeout-client",
        type=positive_int,
        default=d.timeout_client,
        metavar="S",
        help=f"seconds a client has to send its whole body (else 408), and a response waits for a client "
        f"that reads none of it before the request is dropped (default: {d.timeout_client})",
    )
    g.add_argument(
        "--timeout-graceful-shutdown",
        type=int_arg(0),
        default=d.timeout_graceful_shutdown,
        metavar="S",
        help=f"after SIGINT/SIGTERM, seconds requests in flight get to finish (default: {d.timeout_graceful_shutdown})",
    )
    g.add_argument(
        "--max-body-bytes-in-flight",
        type=positive_int,
        default=d.max_body_bytes_in_flight,
        metavar="BYTES",
        help=f"bytes of all request bodies being received or served at once (default: {d.max_body_bytes_in_flight}, "
        f"{d.max_body_bytes_in_flight >> 20} MiB; at least --max-body-size); beyond, 503 with Retry-After",
    )
    g.add_argument(
        "--max-prompts-per-request",
        type=positive_int,
        default=d.max_prompts_per_request,
        metavar="N",
        help=f"prompts in one /v1/completions request (default: {d.max_prompts_per_request}); more: 400",
    )
    g.add_argument(
        "--max-sequences-per-request",
        type=positive_int,
        default=d.max_sequences_per_request,
        metavar="N",
        help=f"prompts x max(n, best_of) of one request (default: {d.max_sequences_per_request}); more: 400. One "
        "request holds one --limit-concurrency slot however many sequences it asks for",
    )
    g.add_argument(
        "--grammar-cache-bytes",
        type=positive_int,
        default=d.grammar_cache_bytes,
        metavar="BYTES",
        help=f"compiled grammars of structured outputs kept for reuse, by xgrammar's size of each plus its schema "
        f"(default: {d.grammar_cache_bytes}, {d.grammar_cache_bytes >> 20} MiB); the least recently used go first",
    )
    g.add_argument(
        "--grammar-compile-timeout",
        type=_seconds,
        default=d.grammar_compile_timeout,
        metavar="S",
        help=f"seconds a schema, regex or grammar may take to compile (default: {d.grammar_compile_timeout:g}); "
        "longer: 408, and the compiler's process is killed",
    )
    g.add_argument(
        "--max-grammar-bytes",
        type=positive_int,
        default=d.max_grammar_bytes,
        metavar="N",
        help=f"characters of one schema, regex, grammar or choice list (default: {d.max_grammar_bytes}); more: 400",
    )
    g.add_argument(
        "--grammar-memory-bytes",
        type=positive_int,
        default=d.grammar_memory_bytes,
        metavar="BYTES",
        help=f"address space of the process that compiles grammars (default: {d.grammar_memory_bytes >> 30} GiB); "
        "a spec that needs more: 400",
    )
    g.add_argument(
        "--timeout-header",
        type=_seconds,
        default=d.timeout_header,
        metavar="S",
        help=f"seconds a connection has to send a request's line and headers (default: {d.timeout_header:g}); "
        "later: 408 and the connection is closed",
    )
    g.add_argument(
        "--max-connections",
        type=positive_int,
        default=d.max_connections,
        metavar="N",
        help=f"connections open at once (default: {d.max_connections}); more are closed as they come",
    )
    g.add_argument(
        "--max-logprob-entries",
        type=positive_int,
        default=d.max_logprob_entries,
        metavar="N",
        help=f"logprobs one answer may carry: prompt tokens x (prompt_logprobs + 1) + sequences x max_tokens x "
        f"(logprobs + 1) (default: {d.max_logprob_entries}); more: 400",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _limits(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})


def _access(args: argparse.Namespace) -> Access:
    return Access(
        args.api_key or None, enable_docs=args.enable_docs, public_metrics=args.public_metrics, host=args.host
    )


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from ctxpar import LLM
    from ctxpar.entrypoints.openai.app import ServerState, build_app
    from ctxpar.entrypoints.openai.connections import bounded_h11
    from ctxpar.entrypoints.openai.shutdown import UVICORN_MARGIN_S, Shutdown

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CtxparError("--enable-auto-tool-choice needs --tool-call-parser (e.g. --tool-call-parser hermes)")
    limits, access = _limits(args), _access(args)  # refused here, before the model loads, if inconsistent
    for warning in startup_warnings(args.host, access, args.api_key == os.environ.get("CTXPAR_API_KEY")):
        print(f"ctxpar: {warning}", file=sys.stderr, flush=True)
    with LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args))) as llm:  # closing it stops the ranks
        assert llm.engine is not None  # open: inside its with block
        name = args.served_model_name or args.model or llm.engine.loaded.name
        parser = args.tool_call_parser if args.enable_auto_tool_choice else None
        state = ServerState(llm, name, access, parser, limits)
        config = uvicorn.Config(
            build_app(state),
            host=args.host,
            port=args.port,
            log_level="warning",
            http=bounded_h11(limits.timeout_header, limits.max_connections),
            # Past our own deadline, at which the engine ends what is left with an error (shutdown.py).
            timeout_graceful_shutdown=limits.timeout_graceful_shutdown + UVICORN_MARGIN_S,
        )
        server = uvicorn.Server(config)
        shutdown = Shutdown(server, state.engine_client, limits.timeout_graceful_shutdown)
        shutdown.start()

        def http() -> None:
            try:
                server.run()  # not the main thread: uvicorn installs no signal handlers of its own
            finally:
                state.engine_client.shutdown()  # however uvicorn ended (signal, bind error), the engine loop ends too

        thread = threading.Thread(target=http, name="ctxpar-http")
        thread.start()
        print(f"ctxpar: serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        state.engine_client.run_engine_loop()  # on the main thread, until the HTTP server has stopped
        thread.join()
    shutdown.finish()  # the ranks are stopped: the watchdog has nothing left to do
    if not server.started:
        raise CtxparError(f"the HTTP server could not start on {args.host}:{args.port} (see the message above)")
