"""``ctxpar serve``: an OpenAI-compatible HTTP server over the engine.

app.py (routes), protocol.py (request bodies -> SamplingParams),
responses.py (outputs -> response bodies), engine_loop.py (the thread that
owns the engine), metrics.py (Prometheus), command.py (the CLI).
"""
