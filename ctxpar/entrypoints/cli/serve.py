"""Serve a model over an OpenAI-compatible HTTP API (like `vllm serve`).

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming with
"stream": true), /tokenize, /detokenize, /health and /metrics (Prometheus).
Many concurrent requests share each engine step. Ctrl-C or SIGTERM stops
accepting, lets requests in flight finish for a few seconds, then stops the
PCP ranks.

examples:
  ctxpar serve
  ctxpar serve --model ./my-llama --pcp 2 --port 8000 --api-key secret
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}'
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading

from ctxpar.checks import int_arg
from ctxpar.engine.arg_utils import EngineArgs
from ctxpar.entrypoints.openai.tools import TOOL_PARSERS
from ctxpar.errors import CtxparError

# After SIGINT/SIGTERM, requests in flight get this long to finish before they are cut.
GRACEFUL_SHUTDOWN_S = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int_arg(0, 65535), default=8000, help="port to bind (default: 8000; 0 = any free)")
    s.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("CTXPAR_API_KEY"),
        help="require 'Authorization: Bearer KEY' on the API (default: $CTXPAR_API_KEY; none = open)",
    )
    s.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send (default: --model as given, or the default model's name)",
    )
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


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from ctxpar import LLM
    from ctxpar.entrypoints.openai.app import ServerState, build_app

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CtxparError("--enable-auto-tool-choice needs --tool-call-parser (e.g. --tool-call-parser hermes)")
    with LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args))) as llm:  # closing it stops the ranks
        name = args.served_model_name or args.model or llm.engine.loaded.name
        parser = args.tool_call_parser if args.enable_auto_tool_choice else None
        state = ServerState(llm, name, args.api_key or None, parser)
        config = uvicorn.Config(
            build_app(state),
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = uvicorn.Server(config)

        def http() -> None:
            try:
                server.run()  # not the main thread: uvicorn installs no signal handlers of its own
            finally:
                state.engine_client.shutdown()  # however uvicorn ended (signal, bind error), the engine loop ends too

        def shut_down(signum: int, frame: object) -> None:
            # Stop accepting; uvicorn lets requests in flight finish (the engine
            # loop keeps stepping them) for GRACEFUL_SHUTDOWN_S, then cuts them.
            server.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, shut_down)
        thread = threading.Thread(target=http, name="ctxpar-http")
        thread.start()
        print(f"ctxpar: serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        state.engine_client.run_engine_loop()  # on the main thread, until the HTTP server has stopped
        thread.join()
    if not server.started:
        raise CtxparError(f"the HTTP server could not start on {args.host}:{args.port} (see the message above)")
