"""Access and operations of ``unikv serve``: one pure-ASGI middleware (``Gate``),
the body reader with its limits, and the options of both (``ServeOptions``).

For each HTTP request, in this order (CORS, when ``allowed_origins`` is set, runs
outside it, so a preflight is answered and a refusal carries CORS headers):

1. ``X-Request-Id``: taken from the request when it is 1-128 visible ASCII
   characters, else made (uuid4 hex); echoed on the response and used in the
   response's ``id`` (``cmpl-<id>``, as vLLM does);
2. header bytes above ``max_header_bytes``: 431;
3. a ``Host`` outside ``allowed_hosts`` (DNS rebinding): 400;
4. a draining server (SIGTERM received): 503 for every new request;
5. with an API key: every route but ``/health`` and ``/metrics`` (and CORS
   preflights) needs ``Authorization: Bearer <key>``, else 401;
6. with ``log_requests``: one log line per request when its response ends
   (id, method, path, status, milliseconds) on the ``unikv.serving`` logger.

Every refusal is an OpenAI-shaped JSON error. The body (``read_body``): a
``Content-Length`` or a body above ``max_body_bytes`` is a 413; a body not in
within ``body_timeout_s`` of the handler's first read is a 408 (the connection
is closed after both).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

logger = logging.getLogger("unikv.serving")
OPEN_PATHS = ("/health", "/metrics")  # no API key needed (as vLLM)
MAX_REQUEST_ID = 128


@dataclass
class ServeOptions:
    """The server's access and limit options (``unikv serve``'s flags).

    api_key: the Bearer key every route but /health and /metrics needs (None: open).
    allowed_origins: CORS origins (empty: no CORS headers, browsers refuse
    cross-origin reads); allowed_hosts: Host header patterns ("a.b", "*.b"; empty:
    any). max_body_bytes, max_header_bytes, body_timeout_s: request limits;
    max_prompts: prompts in one completions request; log_requests: per-request
    logs; enable_admin_routes: mount POST /reset_prefix_cache; shutdown_timeout_s:
    how long in-flight requests may run after SIGTERM before they are ended.
    api_server, api_servers, metrics_dir: this process's index among the server's
    API processes, their number, and the directory of their shared metric rows
    (``--api-server-count``; None with one process).
    tool_call_parser, reasoning_parser: vLLM's flags (``parsers.TOOL_PARSERS``,
    ``parsers.REASONING_PARSERS``); None: chosen from the chat template in use."""

    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    allow_credentials: bool = False
    allowed_hosts: list[str] = field(default_factory=list)
    max_body_bytes: int = 16 << 20
    max_header_bytes: int = 32 << 10
    body_timeout_s: float = 30.0
    max_prompts: int = 1024
    log_requests: bool = False
    enable_admin_routes: bool = False
    shutdown_timeout_s: float = 30.0
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    api_server: int = 0
    api_servers: int = 1
    metrics_dir: str | None = None

    def __post_init__(self) -> None:
        from unikv.serving.parsers import REASONING_PARSERS, TOOL_PARSERS

        for name, known in (("tool_call_parser", TOOL_PARSERS),
                            ("reasoning_parser", REASONING_PARSERS)):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value not in known:
                raise ValueError(f"{name} must be one of {sorted(known)}, got {value!r}")
        for name in ("max_body_bytes", "max_header_bytes", "max_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("body_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None: no key)")


class HTTPError(Exception):
    """A refusal with an OpenAI-shaped body (``app``'s handler answers it)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers or {}


def error_bytes(message: str, kind: str, status: int, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    ).encode()


def host_allowed(host: str, patterns: list[str]) -> bool:
    """Whether a Host header (port stripped) matches one of ``patterns``: "*" (any),
    a name, or "*.domain" (any subdomain), as starlette's TrustedHostMiddleware."""
    if not patterns or "*" in patterns:
        return True
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.lower()
    for pattern in patterns:
        pattern = pattern.lower()
        if name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


def _request_id(given: bytes | None) -> str:
    if given and len(given) <= MAX_REQUEST_ID and all(33 <= b < 127 for b in given):
        return given.decode("ascii")
    return uuid.uuid4().hex


RAW_SEND = "unikv.send"  # scope key: the send the Gate was given (before its wrapper)


class Gate:
    """The access middleware (module docstring); ``state.draining``: refuse new
    requests (set by the SIGTERM handler). It puts the ``send`` it was given in the
    scope (``RAW_SEND``): its own wrapper and starlette's inner ones only look at a
    response's start message, so a stream sends its body chunks there directly."""

    def __init__(self, app, options: ServeOptions, state) -> None:
        self.app, self.options, self.state = app, options, state
        self.key = options.api_key.encode() if options.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        opts, headers = self.options, scope["headers"]
        rid = _request_id(next((v for k, v in headers if k == b"x-request-id"), None))
        scope.setdefault("state", {})["request_id"] = rid
        scope[RAW_SEND] = send  # a stream's body chunks skip the wrappers below (sse.py)
        start, status = time.perf_counter(), [0]

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                out = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = dict(message, headers=out + [(b"x-request-id", rid.encode())])
            await send(message)

        try:
            refusal = self._refusal(scope, headers)
            if refusal is not None:
                await _send_error(send_with_id, *refusal)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            if opts.log_requests:
                ms = (time.perf_counter() - start) * 1e3
                logger.info("request %s %s %s -> %d in %.1f ms", rid, scope["method"],
                            scope["path"], status[0], ms)  # fmt: skip

    def _refusal(self, scope, headers) -> tuple | None:
        """(status, message, kind, extra headers) of a refused request, or None."""
        opts = self.options
        if sum(len(k) + len(v) for k, v in headers) > opts.max_header_bytes:
            return 431, f"the request's headers exceed {opts.max_header_bytes} bytes", \
                "invalid_request_error", {}  # fmt: skip
        host = next((v for k, v in headers if k == b"host"), b"").decode("latin-1")
        if opts.allowed_hosts and not host_allowed(host, opts.allowed_hosts):
            return 400, f"host {host!r:.80} is not allowed (--allowed-hosts)", \
                "invalid_request_error", {}  # fmt: skip
        if self.state.draining:
            return 503, "the server is shutting down", "ServiceUnavailable", \
                {"connection": "close"}  # fmt: skip
        path, method = scope["path"], scope["method"]
        if self.key is None or method == "OPTIONS" or path in OPEN_PATHS:
            return None
        given = next((v for k, v in headers if k == b"authorization"), b"")
        if not hmac.compare_digest(given, b"Bearer " + self.key):
            return 401, "invalid or missing API key (send 'Authorization: Bearer <key>')", \
                "authentication_error", {"www-authenticate": "Bearer"}  # fmt: skip
        return None


async def _send_error(send, status: int, message: str, kind: str, extra: dict) -> None:
    body = error_bytes(message, kind, status)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(request, options: ServeOptions) -> bytes:
    """The request body within ``max_body_bytes`` (413) and ``body_timeout_s`` (408)."""
    limit = options.max_body_bytes
    length = request.headers.get("content-length")
    close = {"connection": "close"}
    if length is not None and length.isdigit() and int(length) > limit:
        raise HTTPError(413, f"the body of {int(length)} bytes exceeds {limit} bytes "
                        "(--max-body-bytes)", headers=close)  # fmt: skip
    chunks, size = [], 0
    try:
        async with asyncio.timeout(options.body_timeout_s or None):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HTTPError(413, f"the body exceeds {limit} bytes (--max-body-bytes)",
                                    headers=close)  # fmt: skip
                chunks.append(chunk)
    except TimeoutError:
        raise HTTPError(408, f"the body did not arrive within {options.body_timeout_s} s",
                        headers=close) from None  # fmt: skip
    return b"".join(chunks)
