"""The ``compile-attn serve MODEL`` subcommand: build an LLM from a few engine options, wrap it in an AsyncLLM and
serve the OpenAI-compatible app with uvicorn until interrupted."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from compile_attn import env
from compile_attn.cli_options import add_engine_options, check_engine_options, engine_config
from compile_attn.server.frontend import DEFAULT_SHUTDOWN_TIMEOUT_S, FRONTENDS
from compile_attn.server.options import DEFAULT_MAX_REQUEST_BYTES, ServerOptions, parse_origins

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction, formatter_class: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser("serve", formatter_class=formatter_class, help="an OpenAI-compatible HTTP server",
                       description="Serve a local HF model over HTTP: /v1/completions, /v1/chat/completions "
                                   "(streamed or not), /v1/models, /tokenize, /detokenize, /version, /health, "
                                   "/metrics; /docs describes them.")
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
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM or Ctrl-C: seconds the open requests may run on (no new connections are "
                        "taken) before each is ended: a stream with a last chunk (finish_reason \"abort\") and "
                        "[DONE], a whole request with a 503; a second signal ends them at once")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="longest request body in bytes; longer ones get 413 unread (a prompt filling a "
                        "131,072-token context is under 1 MiB as text or as token ids; the default is 8 MiB)")
    p.add_argument("--allowed-origins", default=None,
                   help="origins whose web pages may call the API (CORS), a JSON list or comma-separated, '*' for "
                        "any (default: none, CORS off)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (401 otherwise; "
                        f"/health, /metrics, /version and /docs stay open); default: ${env.API_KEY_ENV}, else "
                        f"${env.VLLM_API_KEY_ENV}, if set, else no key")
    p.set_defaults(func=cmd_serve, prepare=prepare, subparser=p)


def prepare(args: argparse.Namespace) -> None:
    """Refuse bad options before the model loads (ValueError naming the value)."""
    check_engine_options(args)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_pending < 1:
        raise ValueError(f"--max-pending must be >= 1, got {args.max_pending}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    args.allowed_origins = parse_origins(args.allowed_origins or "") if not isinstance(args.allowed_origins, tuple) \
        else args.allowed_origins
    if args.api_key is None:
        args.api_key = env.api_key()
    server_options(args)  # its own checks, before the model loads
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"serve needs FastAPI, uvicorn and prometheus_client ({exc}); pip install 'compile-attn[serve]'") from None


def server_options(args: argparse.Namespace) -> ServerOptions:
    """The HTTP app's options from the parsed ``serve`` flags."""
    return ServerOptions(max_request_bytes=args.max_request_bytes, allowed_origins=args.allowed_origins,
                         api_key=args.api_key)


def cmd_serve(args: argparse.Namespace) -> int:
    from compile_attn.engine import LLM
    from compile_attn.engine.serving.async_engine import AsyncLLM
    from compile_attn.server.frontend import serving

    llm = LLM(args.model, config=engine_config(args))
    if args.chat_template is not None and llm.tokenizer is not None:
        path = Path(args.chat_template)
        llm.tokenizer.chat_template = path.read_text() if path.is_file() else args.chat_template
    engine = AsyncLLM(llm, max_pending=args.max_pending)
    # SIGTERM (a process manager's stop) and Ctrl-C drain the server: no new connections, the open requests run on
    # for --shutdown-timeout seconds, then are ended; a second signal ends them at once
    stopping = threading.Event()
    code = 0
    try:
        with serving(engine, args.served_model_name or args.model, args.frontend, server_options(args),
                     host=args.host, port=args.port,
                     log_level="info" if args.verbose else "warning",
                     shutdown_timeout=args.shutdown_timeout) as front:

            def on_signal(signum: int, _frame: object) -> None:
                logger.warning("%s: shutting down (open requests may run for %.0f s; again to end them now)",
                               signal.Signals(signum).name, args.shutdown_timeout)
                stopping.set()
                front.request_stop()

            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
            logger.info("serving %s on %s (front end: %s)", args.model, front.url, args.frontend)
            print(f"compile-attn serve: {front.url}/v1 (Ctrl-C stops)", flush=True)
            while not stopping.wait(0.5):
                if not engine.alive:
                    logger.error("the engine's step loop has stopped; shutting down")
                    code = 1
                    break
                if not front.alive():
                    logger.error("the HTTP front end exited (exit code %s); shutting down", front.exitcode)
                    code = 1
                    break
    finally:
        engine.shutdown()
        llm.shutdown()  # tensor parallelism: stop the workers (nothing to do in one process)
    return code
