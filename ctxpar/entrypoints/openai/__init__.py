"""``ctxpar serve``: an OpenAI-compatible HTTP server over the engine.

app.py (routes, over an AsyncLLM: ctxpar/engine/async_llm.py), protocol.py
(request bodies -> SamplingParams), responses.py (outputs -> response
bodies), metrics.py (Prometheus); the command is ctxpar/entrypoints/cli/serve.py.
"""
