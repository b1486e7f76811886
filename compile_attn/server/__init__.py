"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) on the AsyncLLM engine: ``compile-attn serve MODEL``.

``create_app`` lives in ``compile_attn.server.app``; this package does not import it, so the command line (which
declares ``serve`` beside commands that need no web stack) runs where FastAPI is not installed."""
