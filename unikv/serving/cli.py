"""`unikv serve --model DIR [--host 127.0.0.1] [--port 8000] ...` (dispatched by
``unikv/cli.py``): the OpenAI-compatible server on uvicorn, with the engine
options of ``unikv generate``.

If the engine loop dies, the process exits with status 1 within seconds (after
the failed requests got their errors), so that a supervisor restarts it.
Test-only fault injection: the environment variable ``UNIKV_TEST_ENGINE_FAULT``
(``online.FAULT_ENV``), read once at start-up; ``die-after-steps:N`` makes the
engine loop die at its N-th step.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

EXIT_ENGINE_DEATH = 1
DEATH_FLUSH_S = 0.5  # the failed requests' answers go out before uvicorn stops
DEATH_HARD_EXIT_S = 10.0  # if the graceful stop hangs, the process ends anyway


def _max_waiting(text: str) -> int | None:
    """--max-waiting: an int >= 0; 0 = no bound."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0 (0 = no bound), got {value}")
    return value or None


def _fault_steps(environ) -> int | None:
    """The step at which the injected fault kills the engine loop, or None."""
    from unikv.engine.online import FAULT_ENV

    spec = environ.get(FAULT_ENV, "")
    if not spec:
        return None
    kind, _, num = spec.partition(":")
    if kind != "die-after-steps" or not num.isdigit() or int(num) < 1:
        raise ValueError(f"{FAULT_ENV} must be 'die-after-steps:N' (N >= 1), got {spec!r}")
    return int(num)


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
        type=_max_waiting,
        default=256,
        help="requests waiting for admission at most; a request arriving while that many "
        "wait gets HTTP 503 with Retry-After (one request's prompts are admitted "
        "together, however many); 0 = no bound (default 256)",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    return p


def serve_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    import uvicorn

    from unikv.engine.cli import llm_from_args
    from unikv.serving.app import create_app

    died: list[BaseException] = []
    holder: dict = {}

    def on_engine_death(err: BaseException) -> None:  # on the event loop
        died.append(err)
        print(f"unikv serve: the engine loop died ({type(err).__name__}: {err}); "
              f"exiting with status {EXIT_ENGINE_DEATH}", file=sys.stderr, flush=True)  # fmt: skip
        threading.Timer(
            DEATH_FLUSH_S, lambda: setattr(holder["server"], "should_exit", True)
        ).start()
        hard = threading.Timer(DEATH_HARD_EXIT_S, os._exit, args=(EXIT_ENGINE_DEATH,))
        hard.daemon = True
        hard.start()

    try:
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port must be in [0, 65536), got {args.port}")
        fault = _fault_steps(os.environ)
        llm = llm_from_args(args)
        llm.engine.die_after_steps = fault
        names = args.served_model_name or [args.model]
        app = create_app(
            llm,
            served_model_names=names,
            max_waiting=args.max_waiting,
            on_engine_death=on_engine_death,
        )
    except (ValueError, TypeError) as err:
        print(f"unikv serve: error: {err}", file=sys.stderr)
        return 2
    print(
        f"unikv serve: {names[0]} on http://{args.host}:{args.port}/v1 "
        f"(pool {llm.pool.total_bytes} bytes, {llm.device})",
        flush=True,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    server = holder["server"] = uvicorn.Server(config)
    server.run()
    if died:
        return EXIT_ENGINE_DEATH
    return 0 if server.started else 3
