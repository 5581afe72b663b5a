"""`unikv serve --model DIR [--host 127.0.0.1] [--port 8000] ...` (dispatched by
``unikv/cli.py``): the OpenAI-compatible server on uvicorn, with the engine
options of ``unikv generate``."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    from unikv.engine.cli import add_engine_args

    p = argparse.ArgumentParser(
        prog="unikv serve",
        description="Serve a local Hugging Face checkpoint over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).",
    )
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="the name(s) clients pass as 'model' (default: the --model argument)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests waiting for admission at most; more get HTTP 503 (default 256)",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    return p


def serve_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    import uvicorn

    from unikv.engine.cli import llm_from_args
    from unikv.serving.app import create_app

    try:
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port must be in [0, 65536), got {args.port}")
        llm = llm_from_args(args)
        names = args.served_model_name or [args.model]
        app = create_app(llm, served_model_names=names, max_waiting=args.max_waiting)
    except (ValueError, TypeError) as err:
        print(f"unikv serve: error: {err}", file=sys.stderr)
        return 2
    print(
        f"unikv serve: {names[0]} on http://{args.host}:{args.port}/v1 "
        f"(pool {llm.pool.total_bytes} bytes, {llm.device})",
        flush=True,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0
