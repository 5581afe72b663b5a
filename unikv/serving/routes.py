"""vLLM's extra routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /version``,
``GET|POST /ping``.

Shapes are vLLM's:

- ``/tokenize`` takes a completion body (``prompt``, ``add_special_tokens``
  default true) or a chat body (``messages``, ``add_generation_prompt``,
  ``continue_final_message``, ``chat_template``, ``chat_template_kwargs``,
  ``tools``, ``add_special_tokens`` default false), both with an optional
  ``model`` and ``return_token_strs``; it answers ``{"count", "max_model_len",
  "tokens", "token_strs"}``.
- ``/detokenize`` takes ``{"model"?, "tokens": [int]}`` and answers ``{"prompt"}``.
- ``/version`` answers ``{"version"}``.

The handlers are sync (FastAPI runs them on its thread pool): tokenization never
blocks the event loop.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from unikv.serving.protocol import (
    STRICT,
    BadRequest,
    ChatMessage,
    ChatTemplateFields,
    parse_body,
)


def unikv_version() -> str:
    try:
        return version("unikv")
    except PackageNotFoundError:
        return "0.1.0"


class TokenizeCompletion(ChatTemplateFields):
    model_config = STRICT

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(ChatTemplateFields):
    model_config = STRICT

    model: str | None = None
    messages: list[dict] = Field(min_length=1)
    add_special_tokens: bool = False
    return_token_strs: bool = False


class Detokenize(BaseModel):
    model_config = STRICT

    model: str | None = None
    tokens: list[int]


def register(app: FastAPI, server) -> None:
    """Mount the routes on ``app`` (``server``: app.py's Server)."""
    llm = server.llm
    # the server's own tokenizer copy and lock (app._own_prompts): a huge body being
    # tokenized here does not hold the engine thread's lock
    own = server.prompts

    def tokenizer():
        tok = own.tokenizer
        if tok is None:
            raise BadRequest("this checkpoint has no tokenizer", None)
        return tok

    def check(model) -> None:
        if model is not None:
            server.check_model(model)

    def do_tokenize(raw: bytes) -> dict:
        chat = _has_messages(raw)
        body = parse_body(raw, TokenizeChat if chat else TokenizeCompletion)
        check(body.model)
        tok = tokenizer()
        if chat:
            msgs = [ChatMessage.model_validate(m).as_dict() for m in body.messages]
            text = chat_text(server.prompts, msgs, body)
        else:
            text = body.prompt
        with own.tokenizer_lock:
            ids = tok.encode(text, add_special_tokens=body.add_special_tokens)
            strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids,
                "token_strs": strs}  # fmt: skip

    def do_detokenize(raw: bytes) -> dict:
        body = parse_body(raw, Detokenize)
        check(body.model)
        tok = tokenizer()
        vocab = llm.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"tokens: ids must be in [0, {vocab}), got {bad[:8]}", "tokens")
        with own.tokenizer_lock:
            return {"prompt": tok.decode(body.tokens)}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():  # vLLM's (SageMaker's) liveness route: /health's answer
        if server.engine.healthy:
            return Response(status_code=200)
        return Response(status_code=503)

    @app.get("/version")
    async def get_version():
        return {"version": unikv_version()}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await server.off_loop(do_tokenize, await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await server.off_loop(do_detokenize, await request.body())


def _has_messages(raw: bytes) -> bool:
    """Whether the body is a JSON object with "messages" (vLLM's chat form)."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return False  # the strict parse names the error
    return isinstance(obj, dict) and "messages" in obj


def chat_text(prompts, messages: list[dict], body) -> str:
    """The chat template's text of ``messages`` with ``body``'s template fields
    (``prompts``: a PromptMaker)."""
    try:
        text, _ = prompts.chat(messages, **body.template_kwargs(), check=False)
    except BadRequest:
        raise
    except Exception as err:  # the template's own errors
        raise BadRequest(f"messages: {err}", "messages") from err
    return text
