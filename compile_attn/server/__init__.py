"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) on the AsyncLLM engine: ``compile-attn serve MODEL``."""

from compile_attn.server.app import create_app

__all__ = ["create_app"]
