"""The ``compile-attn serve MODEL`` subcommand: build an LLM from a few engine options, wrap it in an AsyncLLM and
serve the OpenAI-compatible app with uvicorn until interrupted."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

from compile_attn.cli_options import add_engine_options, check_engine_options, engine_config
from compile_attn.server.frontend import FRONTENDS

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction, formatter_class: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser("serve", formatter_class=formatter_class, help="an OpenAI-compatible HTTP server",
                       description="Serve a local HF model over HTTP: /v1/completions, /v1/chat/completions "
                                   "(streamed or not), /v1/models, /health, /metrics.")
    p.add_argument("model", help="a local HF model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as model (default: MODEL)")
    add_engine_options(p, device_help="cuda or cpu (default: cuda if there is one)", max_batch_size=32,
                       max_num_tokens=2048)
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file or the template itself) for a tokenizer without one")
    p.add_argument("--frontend", choices=FRONTENDS, default="process",
                   help="where the HTTP front end runs: a process of its own (parsing, detokenising and streaming "
                        "never hold up the engine's steps), or a thread of the engine's process")
    p.add_argument("--max-pending", type=int, default=256,
                   help="unfinished requests at most; past it new ones get 503 with Retry-After")
    p.set_defaults(func=cmd_serve, prepare=prepare, subparser=p)


def prepare(args: argparse.Namespace) -> None:
    """Refuse bad options before the model loads (ValueError naming the value)."""
    check_engine_options(args)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_pending < 1:
        raise ValueError(f"--max-pending must be >= 1, got {args.max_pending}")
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"serve needs FastAPI, uvicorn and prometheus_client ({exc}); pip install 'compile-attn[serve]'") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from compile_attn.engine import LLM
    from compile_attn.engine.serving.async_engine import AsyncLLM
    from compile_attn.server.frontend import serving

    llm = LLM(args.model, config=engine_config(args))
    if args.chat_template is not None and llm.tokenizer is not None:
        path = Path(args.chat_template)
        llm.tokenizer.chat_template = path.read_text() if path.is_file() else args.chat_template
    engine = AsyncLLM(llm, max_pending=args.max_pending)
    # SIGTERM (a process manager's stop) unwinds like Ctrl-C: the front end stops, requests are aborted
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with serving(engine, args.served_model_name or args.model, args.frontend, host=args.host, port=args.port,
                     log_level="info" if args.verbose else "warning") as url:
            logger.info("serving %s on %s (front end: %s)", args.model, url, args.frontend)
            print(f"compile-attn serve: {url}/v1 (Ctrl-C stops)", flush=True)
            while engine.alive:
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0
