"""Serve a model over an OpenAI-compatible HTTP API (like `vllm serve`).

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming with
"stream": true), /tokenize, /detokenize, /health and /metrics (Prometheus).
Many concurrent requests share each engine step: every running stream's next
token first, prompts in chunks in what is left of --max-num-batched-tokens,
512 here (2048 offline), so that a long prompt delays the streams' next tokens
by one short step, not by its whole prefill. Ctrl-C or SIGTERM stops
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
import gc
import os
import threading

from ctxpar.checks import int_arg
from ctxpar.engine.arg_utils import EngineArgs
from ctxpar.entrypoints.openai.access import Access, startup_warnings
from ctxpar.entrypoints.openai.server_limits import ServerLimits
from ctxpar.entrypoints.openai.tools import TOOL_PARSERS
from ctxpar.errors import CtxparError
from ctxpar.knobs import add_flags

# The token budget of a served engine's step (--max-num-batched-tokens), in place of the
# offline 2048: a step's decodes go first and prefill chunks fill the rest, so the budget
# bounds how long every stream's next token waits behind other users' prompts (a
# stall-free budget, as Sarathi-Serve's and vLLM's), and a new prompt's first chunk is
# scheduled without waiting for a long one ahead of it to finish. Offline throughput
# loses little to the extra steps (docs/benchmarks.md, "Serving token budget").
SERVE_MAX_NUM_BATCHED_TOKENS = 512


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
    add_flags(p.add_argument_group("client limits"), ServerLimits)
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
    EngineArgs.add_cli_args(p, defaults={"max_num_batched_tokens": SERVE_MAX_NUM_BATCHED_TOKENS})


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
    from ctxpar.entrypoints.openai.connections import bounded_h11, reserve_descriptors
    from ctxpar.entrypoints.openai.shutdown import UVICORN_MARGIN_S, Shutdown, say

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CtxparError("--enable-auto-tool-choice needs --tool-call-parser (e.g. --tool-call-parser hermes)")
    limits, access = _limits(args), _access(args)  # refused here, before the model loads, if inconsistent
    reserve_descriptors(limits.max_connections)
    for warning in startup_warnings(args.host, access, args.api_key == os.environ.get("CTXPAR_API_KEY")):
        say(warning)
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
        # The load and the app made objects that live as long as the process. Frozen (after
        # a last collection, so no garbage is kept), the collector's full passes skip them:
        # over them a pass held the GIL, and so every stream, for tens of milliseconds, a
        # few times a minute under load.
        gc.collect()
        gc.freeze()

        def http() -> None:
            try:
                server.run()  # not the main thread: uvicorn installs no signal handlers of its own
            finally:
                state.engine_client.shutdown()  # however uvicorn ended (signal, bind error), the engine loop ends too

        thread = threading.Thread(target=http, name="ctxpar-http")
        thread.start()
        say(f"serving {name} on http://{args.host}:{args.port}/v1")
        state.engine_client.run_engine_loop()  # on the main thread, until the HTTP server has stopped
        thread.join()
    shutdown.finish()  # the ranks are stopped: the watchdog has nothing left to do
    if not server.started:
        raise CtxparError(f"the HTTP server could not start on {args.host}:{args.port} (see the message above)")
