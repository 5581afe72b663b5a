"""``POST /admin/resize_kv_cache`` (issue 44 item 3), mounted only with
``--enable-admin-routes`` and, like every route but ``/health`` and ``/metrics``,
behind the API key.

Body: ``{"bytes": N}`` (and ``"model"`` when several models are served); a JSON
content type, as ``/reset_prefix_cache`` (a cross-site page cannot send one
without a preflight). The pool of that model (an elastic one:
``--kv-cache-max``) is resized between two engine steps, within the shared
budget when several models share one. Answers ``{"model", "bytes"}`` with the
new size; 400 for a size the pool or the budget cannot take (not an elastic
pool, above its reservation, below one worst-case request, past the budget's
free bytes); 409 when the running requests hold more than ``N`` bytes would keep
(nothing changed: finish or preempt requests first).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request

from unikv.serving.ops import HTTPError, read_body
from unikv.serving.protocol import BadRequest

BUSY = "running requests need"  # Room.resize's refusal below what is held


def parse(raw: bytes, names: list[str]) -> tuple[int, str | None]:
    """(bytes, model or None) of a resize body, or BadRequest naming the field."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError as err:
        raise BadRequest(f"body: not JSON ({err})", None) from None
    if not isinstance(body, dict):
        raise BadRequest('body: expected a JSON object {"bytes": N}', None)
    extra = set(body) - {"bytes", "model"}
    if extra:
        raise BadRequest(f'{min(extra)}: unknown field; send {{"bytes": N}}', None)
    size = body.get("bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise BadRequest(f"bytes: expected a positive int (the pool's new size), got {size!r}",
                         "bytes")  # fmt: skip
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model: expected a string, got {model!r}", "model")
    if model is None and len(names) > 1:
        raise BadRequest(f"model: several models are served ({names}); name one", "model")
    return size, model


def register(app: FastAPI, pick, names: list[str], options) -> None:
    """Mount the route; ``pick(model or None)`` is the app's Server of that model."""

    @app.post("/admin/resize_kv_cache")
    async def resize_kv_cache(request: Request):
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise HTTPError(415, 'send Content-Type: application/json ({"bytes": N})')
        size, model = parse(await read_body(request, options), names)
        server = pick(model)
        try:
            got = await asyncio.to_thread(server.engine.resize_kv_cache, size)
        except ValueError as err:
            raise HTTPError(409 if BUSY in str(err) else 400, str(err), param="bytes") from err
        return {"model": model or server.names[0], "bytes": got}
