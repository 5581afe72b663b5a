"""`unikv serve --model DIR [--host 127.0.0.1] [--port 8000] ...` (dispatched by
``unikv/cli.py``): the OpenAI-compatible server on uvicorn, with the engine
options of ``unikv generate``.

The engine (scheduler and forward) runs in its own process by default
(``engine_core``, fed over ZeroMQ by ``engine_client.ProcEngine``); this
process does HTTP, tokenization, chat templates and detokenization.
``--in-process-engine`` keeps the engine loop in a thread of this process.
Several models (``--model A --model B``, one ``--kv-cache`` budget) share ONE
engine process holding a ``MultiLLM`` (``engine_client.ProcMulti``: a socket
pair per model, requests routed by their ``model``).

``--api-server-count N`` (default 1) runs N API processes sharing the port,
all in front of the one engine process (``api_procs``: how the port is shared,
how each request's outputs find their process, how they fail and drain).

If the engine loop or its process dies, this process exits with status 1
within seconds (after the failed requests got their errors), so that a
supervisor restarts it. On
SIGTERM (or Ctrl-C) the server stops accepting, lets in-flight requests run for
``--shutdown-timeout`` seconds, then ends each with finish_reason "abort" (a
stream: a final chunk and ``[DONE]``) and exits 0.
Test-only fault injection: the environment variable ``UNIKV_TEST_ENGINE_FAULT``
(``env.FAULT_ENV``), read once at start-up; ``die-after-steps:N`` makes the
engine loop die at its N-th step; ``poison-token:ID`` (process mode) makes the
forward raise for a step that feeds token ID; ``step-delay-ms:MS`` (process
mode) makes every engine step sleep; several are comma-separated.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

from unikv.env import FAULT_ENV, serve_environ

EXIT_ENGINE_DEATH = 1
DEATH_FLUSH_S = 0.5  # the failed requests' answers go out before uvicorn stops
DEATH_HARD_EXIT_S = 10.0  # if the graceful stop hangs, the process ends anyway
DRAIN_GRACE_S = 5.0  # after --shutdown-timeout, the ended streams' last writes

SWITCH_INTERVAL_MS = 0.5  # the serving processes' GIL switch interval (--switch-interval-ms)


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, whose SIGTERM/SIGINT also starts the app's drain (``Server.begin_drain``)
        and, in the first of several API processes, the others' (``children``)."""

        def __init__(self, config, app_server, children=None) -> None:
            super().__init__(config)
            self.app_server, self.children = app_server, children

        def handle_exit(self, sig, frame) -> None:
            if self.children is not None:
                self.children.terminate()
            app, loop = self.app_server, self.app_server.engine.event_loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(app.begin_drain, app.options.shutdown_timeout_s)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # drained: exit 0, not by re-raising the signal

    return DrainingServer


def _draining_server(config, app_server, children=None):
    return _draining_server_class()(config, app_server, children)


def _max_waiting(text: str) -> int | None:
    """--max-waiting: an int >= 0; 0 = no bound."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0 (0 = no bound), got {value}")
    return value or None


def _origins(text: str) -> list[str]:
    """--allowed-origins / --allowed-hosts: a JSON list (vLLM's form) or comma-separated."""
    import json

    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"not a JSON list: {err}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse


def _fault_steps(spec: str | None) -> int | None:
    """The step at which the injected fault kills the engine loop, or None."""
    if not spec:
        return None
    kind, _, num = spec.partition(":")
    if kind != "die-after-steps" or not num.isdigit() or int(num) < 1:
        raise ValueError(f"{FAULT_ENV} must be 'die-after-steps:N' (N >= 1), got {spec!r}")
    return int(num)


def _parser() -> argparse.ArgumentParser:
    from unikv.engine.cli import add_engine_args
    from unikv.serving.parsers import REASONING_PARSERS, TOOL_PARSERS

    p = argparse.ArgumentParser(
        prog="unikv serve",
        description="Serve a local Hugging Face checkpoint over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics; "
        "POST /reset_prefix_cache with --enable-admin-routes). Requests may carry vLLM's "
        "cache_salt: requests of different salts share no prefix-cache page. /metrics uses "
        "vLLM's metric names (vllm:*, with model_name) and unikv:* for the pool; a Grafana "
        "dashboard is in docs/grafana-unikv.json.",
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
    p.add_argument(
        "--api-server-count",
        type=_positive(int),
        default=1,
        help="API server processes (HTTP, tokenization, detokenization, streaming; each with "
        "its own event loop) sharing the port in front of the one engine process, as vLLM's "
        "flag; needs the engine process (not --in-process-engine); default 1",
    )
    p.add_argument(
        "--in-process-engine",
        action="store_true",
        help="run the engine (scheduler and forward) in a thread of the API server's process, "
        "as before; default: its own process (vLLM's engine core), fed over ZeroMQ, so HTTP, "
        "tokenization and detokenization do not share a GIL with the engine loop",
    )
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=SWITCH_INTERVAL_MS,
        help="Python's thread switch interval in both server processes (sys.setswitchinterval): "
        "each has two busy threads (the engine loop beside its input reader; the event loop "
        "beside the engine output reader), and a thread waiting for the GIL waits up to this "
        f"long; default {SWITCH_INTERVAL_MS} (Python's own is 5)",
    )
    a = p.add_argument_group("access and operations")
    a.add_argument(
        "--api-key",
        default=serve_environ().api_key,
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(default: $UNIKV_API_KEY; unset: no key)",
    )
    a.add_argument(
        "--allowed-origins",
        type=_origins,
        default=[],
        help='CORS origins, a JSON list or comma-separated (e.g. \'["https://a.b"]\' or "*"); '
        "default: none (no CORS headers)",
    )
    a.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    a.add_argument(
        "--allowed-hosts",
        type=_origins,
        default=[],
        help="Host headers served (names or *.domain; against DNS rebinding); default: any",
    )
    a.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log one line per request (id, route, status, time) to stderr",
    )
    a.add_argument(
        "--enable-admin-routes",
        action="store_true",
        help="mount POST /reset_prefix_cache (needs Content-Type: application/json, and the "
        "API key when one is set)",
    )
    a.add_argument(
        "--max-body-bytes", type=_positive(int), default=16 << 20,
        help="request bodies above this get 413 (default 16 MiB)",
    )  # fmt: skip
    a.add_argument(
        "--max-header-bytes", type=_positive(int), default=32 << 10,
        help="requests with more header bytes get 431 (default 32 KiB)",
    )  # fmt: skip
    a.add_argument(
        "--body-timeout", type=_positive(float), default=30.0,
        help="a body not received within this many seconds gets 408 (default 30)",
    )  # fmt: skip
    a.add_argument(
        "--max-prompts-per-request", type=_positive(int), default=1024,
        help="prompts in one completions request at most (default 1024)",
    )  # fmt: skip
    a.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="on SIGTERM, seconds in-flight requests may run before they are ended "
        "(finish_reason 'abort'; default 30)",
    )  # fmt: skip
    k = p.add_argument_group("elastic KV memory (issue 44)")
    k.add_argument(
        "--kv-idle-shrink-floor", default=None,
        help="after --kv-idle-seconds with no requests, shrink the pool to this many bytes "
        "(it grows back on demand); needs --kv-cache-max-bytes or --kv-cache",
    )  # fmt: skip
    k.add_argument(
        "--kv-idle-seconds", type=_positive(float), default=60.0,
        help="idle time before the idle shrink (default 60)",
    )  # fmt: skip
    t = p.add_argument_group("tool calls and reasoning (vLLM's flags)")
    t.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: tool_choice 'auto' is always served (a "
        "request's tools are parsed when a tool-call format applies)",
    )
    t.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="the tool-call format of the output: hermes (<tool_call>{json}</tool_call>, "
        "Qwen's too), openai (gpt-oss harmony); default: read off the chat template",
    )
    t.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="the reasoning format: qwen3 / deepseek_r1 (<think>...</think>), openai_gptoss "
        "(harmony's analysis channel); default: read off the chat template",
    )
    return p


def _options(args, index: int = 0, metrics_dir: str | None = None):
    from unikv.serving.ops import ServeOptions

    return ServeOptions(
        api_server=index,
        api_servers=args.api_server_count,
        metrics_dir=metrics_dir,
        api_key=args.api_key,
        allowed_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allowed_hosts=args.allowed_hosts,
        max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes,
        body_timeout_s=args.body_timeout,
        max_prompts=args.max_prompts_per_request,
        log_requests=args.enable_log_requests,
        enable_admin_routes=args.enable_admin_routes,
        shutdown_timeout_s=args.shutdown_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )


def split_models(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` with only its first ``--model`` (the engine options take one), and
    every ``--model`` value in order (``unikv serve --model A --model B``)."""
    out, models, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--model" and i + 1 < len(argv):
            models.append(argv[i + 1])
            if len(models) == 1:
                out += argv[i : i + 2]
            i += 2
            continue
        if arg.startswith("--model="):
            models.append(arg.split("=", 1)[1])
            if len(models) > 1:
                i += 1
                continue
        out.append(arg)
        i += 1
    return out, models


def engine_config(args):
    """The ``EngineConfig`` of the options; an idle shrink makes the pool elastic up
    to the size it starts at unless ``--kv-cache-max-bytes`` gives more."""
    from unikv.engine.config import EngineConfig

    config = EngineConfig.from_cli(args)
    if args.kv_idle_shrink_floor and config.kv_cache_max_bytes is None:
        if config.kv_cache_bytes is None:
            raise ValueError("--kv-idle-shrink-floor needs --kv-cache-max-bytes or --kv-cache")
        config = config.replace(kv_cache_max_bytes=config.kv_cache_bytes)
    return config


def kv_idle(args) -> list | None:
    """[seconds, floor bytes] of the idle shrink, or None."""
    from unikv.inspect import parse_bytes

    if not args.kv_idle_shrink_floor:
        return None
    return [args.kv_idle_seconds, parse_bytes(args.kv_idle_shrink_floor)]


def multi_spec(args, models: list[str]) -> tuple[list[str], int, dict]:
    """(served names, the shared KV budget, the ``MultiLLM`` keyword arguments every
    model takes) of ``--model A --model B ...`` (ValueError for bad options)."""
    names = args.served_model_name or models
    if len(names) != len(models) or len(set(names)) != len(names):
        raise ValueError(
            f"--served-model-name: give one distinct name per --model ({len(models)} models), "
            f"got {names}"
        )
    import dataclasses

    config = engine_config(args)
    total = config.kv_cache_bytes
    if total is None:
        raise ValueError("several models share one budget: give it with --kv-cache (e.g. 8GiB)")
    skip = ("model", "kv_cache_bytes", "kv_cache_max_bytes", "kv_cache_margin_bytes",
            "tensor_parallel_size")  # fmt: skip
    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    kwargs = {k: v for k, v in kwargs.items() if k not in skip}
    idle = kv_idle(args)
    kwargs.update(idle_seconds=idle[0] if idle else None, idle_floor=idle[1] if idle else None)
    return list(names), total, kwargs


def multi_llm(args, models: list[str]):
    """The ``MultiLLM`` of ``--model A --model B ...`` in this process
    (``--in-process-engine``): one KV budget (``--kv-cache``, required), each
    request routed by name."""
    from unikv.engine.multi import MultiLLM

    names, total, kwargs = multi_spec(args, models)
    return MultiLLM(dict(zip(names, models, strict=True)), total_kv_bytes=total, **kwargs), names


def _spawn_multi(args, models: list[str], plan=None, channels=None, proc=None):
    """The engine process of several models (``engine_client.ProcMulti``: one
    process holds the ``MultiLLM`` and its one budget), started without waiting;
    None for bad options (reported by ``multi_spec`` below). ``plan``: the other
    API processes' channels (``api_procs.ApiPlan``); ``channels`` and ``proc``:
    one of those processes' view of it (started elsewhere)."""
    from unikv.serving.engine_client import ProcMulti

    try:
        names, total, kwargs = multi_spec(args, models)
        config = engine_config(args)
    except (ValueError, TypeError):
        return None
    configs = {n: config.replace(model=m) for n, m in zip(names, models, strict=True)}
    return ProcMulti(configs, total_kv_bytes=total, kwargs=kwargs, max_waiting=args.max_waiting,
                     fault=serve_environ().engine_fault, wait=False,
                     switch_interval=sys.getswitchinterval(),
                     peers=plan.peers(names) if plan is not None else None,
                     channels=channels, proc=proc)  # fmt: skip


def _spawn_engine(args, models: list[str], plan=None):
    """The engine process, started before this process's own imports (they load in
    parallel); None with --in-process-engine or a bad port. ``plan``: the other
    API processes' channels (``--api-server-count``)."""
    if args.in_process_engine or not 0 <= args.port < 65536:
        return None
    if len(models) > 1:
        return _spawn_multi(args, models, plan)
    from unikv.serving.engine_client import ProcEngine

    try:
        config, idle = engine_config(args), kv_idle(args)
    except (ValueError, TypeError):
        return None  # reported below, by the in-process path's check
    return ProcEngine(config, max_waiting=args.max_waiting, kv_idle=idle,
                      fault=serve_environ().engine_fault, wait=False,
                      switch_interval=sys.getswitchinterval(),
                      peers=plan.peers([None]) if plan is not None else None)  # fmt: skip


def _api_plan(args):
    """(listening sockets, ``ApiPlan``) of ``--api-server-count`` > 1, else (None,
    None); ValueError for options it cannot serve."""
    if args.api_server_count == 1:
        return None, None
    if args.in_process_engine:
        raise ValueError(
            f"--api-server-count {args.api_server_count} needs the engine in its own process: "
            "drop --in-process-engine (or give --api-server-count 1)"
        )
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65536), got {args.port}")
    from unikv.serving.api_procs import ApiPlan, bind_sockets

    return bind_sockets(args.host, args.port, args.api_server_count), ApiPlan(args.api_server_count)


def switch_interval_s(ms: float) -> float:
    """``--switch-interval-ms`` in seconds, for ``sys.setswitchinterval``; a clear
    error for a value that is not a positive number of milliseconds."""
    if not ms > 0 or ms > 1000:
        raise ValueError(f"--switch-interval-ms must be in (0, 1000], got {ms}")
    return ms / 1000


def serve_main(argv: list[str]) -> int:
    full_argv = list(argv)
    argv, models = split_models(argv)
    args = _parser().parse_args(argv)
    try:  # before the engine process starts: it takes the same interval
        sys.setswitchinterval(switch_interval_s(args.switch_interval_ms))
        socks, plan = _api_plan(args)  # the port is bound (N sockets) before anything starts
    except ValueError as err:
        print(f"unikv serve: {err}", file=sys.stderr)
        return 2
    from unikv.serving.engine_client import EngineStartError, ProcEngine, ProcMulti

    llm = _spawn_engine(args, models, plan)  # several models: one engine process, one budget
    children = None
    if plan is not None and llm is not None:  # the other API processes start with the engine
        from unikv.serving.api_procs import ApiProcs

        engine = llm if isinstance(llm, ProcEngine) else llm[llm.names[0]]
        children = ApiProcs(full_argv, socks[1:], plan, engine.proc.pid)
    import uvicorn  # noqa: F401  (loaded while the engine process loads the model)

    from unikv.engine.budget_broker import idle_budget
    from unikv.engine.llm import LLM

    try:
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port must be in [0, 65536), got {args.port}")
        if llm is None and not args.in_process_engine:
            engine_config(args)  # raises: the options are bad
            if len(models) > 1:
                multi_spec(args, models)
        names = args.served_model_name or [args.model]
        if len(models) > 1 and args.in_process_engine:
            llm, names = multi_llm(args, models)
            where = f"{len(models)} models, one {llm.budget.total_bytes}-byte KV budget"
        elif len(models) > 1:  # one engine process holds every model (ProcMulti)
            llm.wait_ready()
            names, pid = llm.names, llm[llm.names[0]].info["pid"]
            where = f"{len(models)} models, one KV budget, engine process {pid}"
        elif args.in_process_engine:
            fault = _fault_steps(serve_environ().engine_fault)
            llm = LLM(engine_config(args))
            llm.engine.die_after_steps = fault
            idle = kv_idle(args)
            if idle:
                idle_budget(llm, idle[0], idle[1])  # its watcher starts with the app
            where = f"pool {llm.pool.total_bytes} bytes, {llm.device}, engine in this process"
        else:  # the engine process (its fault spec is checked there)
            info = llm.wait_ready().info
            where = (f"pool {info['pool_bytes']} bytes, {info['device']}, engine process "
                     f"{info['pid']}")  # fmt: skip
    except (ValueError, TypeError, EngineStartError) as err:
        if children is not None:
            children.kill()
        if isinstance(llm, (ProcEngine, ProcMulti)):
            llm.close()
        if plan is not None:
            plan.close()
        print(f"unikv serve: error: {err}", file=sys.stderr)
        return 2
    if children is not None:
        where += f", {args.api_server_count} API processes (pids {os.getpid()}, "
        where += ", ".join(map(str, children.pids)) + ")"
    try:
        return _run(args, llm, names, where, socks[0] if socks else None, children,
                    plan.dir if plan else None)  # fmt: skip
    finally:
        if plan is not None:
            plan.close()


def serve_child(setup: dict) -> int:
    """API process k of ``--api-server-count N`` (``api_procs.main``): the same
    options (``setup["argv"]``), its own channels to the engine process started
    by the first, its listening socket ``setup["fd"]``."""
    import socket

    argv, models = split_models(setup["argv"])
    args = _parser().parse_args(argv)
    sys.setswitchinterval(switch_interval_s(args.switch_interval_ms))
    from unikv.serving.engine_client import EngineStartError, ForeignProc, ProcEngine

    index = setup["index"]
    try:
        proc = ForeignProc(setup["engine_pid"])
    except ProcessLookupError:
        print(f"unikv serve: API process {index}: the engine process is gone", file=sys.stderr)
        return 1
    channels = {name: (addr_in, addr_out) for name, addr_in, addr_out in setup["channels"]}
    try:
        if len(models) > 1:
            llm = _spawn_multi(args, models, channels=channels, proc=proc).wait_ready()
            names = llm.names
        else:
            llm = ProcEngine(engine_config(args), max_waiting=args.max_waiting, wait=False,
                             channel=channels[None], proc=proc).wait_ready()  # fmt: skip
            names = args.served_model_name or [args.model]
    except (ValueError, TypeError, EngineStartError) as err:
        print(f"unikv serve: API process {index}: error: {err}", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=setup["fd"])
    return _run(args, llm, names, None, sock, None, setup["metrics_dir"], index)


def _run(args, llm, names, where, sock=None, children=None, metrics_dir=None, index=0) -> int:
    """Serve ``llm`` on uvicorn until SIGTERM (0) or the engine's death (1); ``sock``:
    this API process's listening socket (``--api-server-count``; None: uvicorn
    binds), ``children``: the other API processes (in the first), ``where``: the
    start-up line's detail (None: no line)."""
    import uvicorn

    from unikv.serving.app import create_app
    from unikv.serving.engine_client import ProcEngine, ProcMulti

    died: list[BaseException] = []
    holder: dict = {}

    def fail(err: BaseException, what: str = "the engine loop died") -> None:  # any thread
        if died:
            return
        died.append(err)
        print(f"unikv serve: {what} ({type(err).__name__}: {err}); "
              f"exiting with status {EXIT_ENGINE_DEATH}", file=sys.stderr, flush=True)  # fmt: skip
        threading.Timer(
            DEATH_FLUSH_S, lambda: setattr(holder["server"], "should_exit", True)
        ).start()
        hard = threading.Timer(DEATH_HARD_EXIT_S, os._exit, args=(EXIT_ENGINE_DEATH,))
        hard.daemon = True
        hard.start()

    options = _options(args, index, metrics_dir)
    try:
        app = create_app(
            llm,
            served_model_names=names,
            max_waiting=args.max_waiting,
            on_engine_death=fail,
            options=options,
        )
    except (ValueError, TypeError) as err:
        if children is not None:
            children.kill()
        if isinstance(llm, (ProcEngine, ProcMulti)):
            llm.close()
        print(f"unikv serve: error: {err}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1] if sock is not None else args.port
    if where is not None:
        print(f"unikv serve: {', '.join(names)} on http://{args.host}:{port}/v1 ({where})",
              flush=True)  # fmt: skip
    if options.log_requests:
        import logging

        handler = logging.StreamHandler()
        tag = f" [API process {index}]" if args.api_server_count > 1 else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(name)s{tag}: %(message)s"))
        log = logging.getLogger("unikv.serving")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=options.shutdown_timeout_s + DRAIN_GRACE_S,
        h11_max_incomplete_event_size=options.max_header_bytes,
    )
    server = holder["server"] = _draining_server(config, app.state.server, children)
    statuses: list = []
    if children is not None:
        from unikv.serving.api_procs import STOP_GRACE_S

        def child_ended(message: str) -> None:  # the server ends: the others go at once
            children.kill()
            fail(RuntimeError(message), "an API process ended")

        children.watch(child_ended)
        engines = [llm] if isinstance(llm, ProcEngine) else list(llm.engines.values())

        def others_first() -> None:  # the engine stops once every API process drained
            if not statuses:
                statuses.extend(children.wait(options.shutdown_timeout_s + DRAIN_GRACE_S
                                              + STOP_GRACE_S))  # fmt: skip

        for engine in engines:
            engine.before_stop = others_first
    import gc

    gc.collect()  # what start-up made (imports, the tokenizer, the app) is kept for good:
    gc.freeze()  # out of the collector's full passes, which serving would otherwise repeat
    try:
        server.run(sockets=None if sock is None else [sock])
    finally:
        if children is not None:
            others_first()  # (the lifespan did, unless it never ran)
        llm.close()  # tensor-parallel workers stop with the server
    if died:
        return EXIT_ENGINE_DEATH
    if any(statuses):
        print(f"unikv serve: the other API processes exited with {statuses}", file=sys.stderr)
        return EXIT_ENGINE_DEATH
    return 0 if server.started else 3
