"""``ctxpar serve``: an OpenAI-compatible HTTP server over the engine.

app.py (build_app: the FastAPI app, its guard and error handlers), state.py
(ServerState, what the routes share, over an AsyncLLM: ctxpar/engine/async_llm.py),
the routes by job (info.py: /health, /metrics, /v1/models; completions.py;
chat_completions.py; tokens.py: /tokenize, /detokenize), streaming.py (answers
whole or as server-sent events), protocol.py (strict request bodies, their
sampling fields -> SamplingParams) and the bodies of each route (protocol_completions.py,
protocol_chat.py, protocol_tokens.py), responses.py (outputs -> response bodies), server_metrics.py (Prometheus); the
command is ctxpar/entrypoints/cli/serve.py.
"""
