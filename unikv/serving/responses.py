"""OpenAI response bodies built from the engine's deltas.

Choice index of completion j of prompt i is ``i * n + j`` (OpenAI's order for
a list of prompts). Logprobs: completions use the legacy form (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``), chat the ``content``
list; both from the model's raw distribution, the sampled token first.
"""

from __future__ import annotations

import time
import uuid

from unikv.engine.tracks import Delta


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, kind: str, param: str | None, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Choices:
    """Accumulates the deltas of every choice of one request."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.text: dict[int, list[str]] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}
        self.finish: dict[int, tuple[str | None, object]] = {}
        self.cached: dict[int, int] = {}  # prompt tokens served from the prefix cache

    def index(self, prompt: int, delta: Delta) -> int:
        return prompt * self.n + delta.index

    def add(self, prompt: int, delta: Delta) -> int:
        i = self.index(prompt, delta)
        self.text.setdefault(i, []).append(delta.text)
        self.token_ids.setdefault(i, []).extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs.setdefault(i, []).extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish[i] = (delta.finish_reason, delta.stop_reason)
        if delta.cached_tokens is not None:
            self.cached[i] = delta.cached_tokens
        return i

    def usage(self, prompt_tokens: int) -> dict:
        done = sum(len(t) for t in self.token_ids.values())
        return usage_body(prompt_tokens, done, cached_prompt_tokens(self.cached, self.n))


def cached_prompt_tokens(cached: dict[int, int], n: int) -> int:
    """Prompt tokens served from the prefix cache: each prompt's first choice's
    (choice ``i * n``; the prompt counts once in ``prompt_tokens``, as here)."""
    return sum(v for i, v in cached.items() if i % n == 0)


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's ``usage``, with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _name(token: int, text: str | None, as_ids: bool) -> str:
    """A token as the client sees it: its text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``; texts of distinct tokens may coincide)."""
    return f"token_id:{token}" if as_ids else (text or "")


def completion_logprobs(entries: list, as_ids: bool = False, offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object of (id, logprob, rank, top, text)
    entries. Each ``top_logprobs`` dict holds the sampled token as well as the top
    k (OpenAI's and vLLM's: the chosen token always appears); ``text_offset``
    starts at ``offset`` (a stream's characters already sent)."""
    tokens, values, tops, offsets = [], [], [], []
    for token, lp, _, top, text in entries:
        name = _name(token, text, as_ids)
        tokens.append(name)
        values.append(lp)
        tops.append({_name(i, s, as_ids): v for i, v, s in top} | {name: lp})
        offsets.append(offset)
        offset += len(text or "")
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list, as_ids: bool = False) -> dict:
    """The chat ``logprobs`` object ({"content": [...]}) of delta entries."""
    content = []
    for token, lp, _, top, text in entries:
        name = _name(token, text, as_ids)
        content.append(
            {
                "token": name,
                "logprob": lp,
                "bytes": list((text or "").encode()),
                "top_logprobs": [
                    {"token": _name(i, s, as_ids), "logprob": v, "bytes": list((s or "").encode())}
                    for i, v, s in top
                ],
            }
        )
    return {"content": content}


def _body(rid: str, model: str, obj: str, choices: Choices, prompt_tokens: int, choice) -> dict:
    """A non-streamed response: one ``choice(i, text, logprobs)`` dict per
    completion (its index, finish and stop reasons added here)."""
    out = []
    for i in sorted(choices.text):
        reason, stop = choices.finish.get(i, (None, None))
        body = choice("".join(choices.text[i]), choices.logprobs.get(i))
        out.append({"index": i, **body, "finish_reason": reason, "stop_reason": stop})
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": choices.usage(prompt_tokens),
    }


def completion_body(rid: str, model: str, choices: Choices, prompt_tokens: int, as_ids=False):
    def choice(text, lp):
        return {
            "text": text,
            "logprobs": completion_logprobs(lp, as_ids) if lp is not None else None,
        }

    return _body(rid, model, "text_completion", choices, prompt_tokens, choice)


def chat_body(rid: str, model: str, choices: Choices, prompt_tokens: int, as_ids=False):
    def choice(text, lp):
        message = {"role": "assistant", "content": text}
        return {
            "message": message,
            "logprobs": chat_logprobs(lp, as_ids) if lp is not None else None,
        }

    return _body(rid, model, "chat.completion", choices, prompt_tokens, choice)


def completion_chunk(
    rid: str, model: str, index: int, delta: Delta, as_ids=False, offset: int = 0
) -> dict:
    lp = completion_logprobs(delta.logprobs, as_ids, offset) if delta.logprobs is not None else None
    choice = {
        "index": index,
        "text": delta.text,
        "logprobs": lp,
        "finish_reason": delta.finish_reason,
    }
    if delta.finish_reason is not None:
        choice["stop_reason"] = delta.stop_reason
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def chat_chunk(rid: str, model: str, index: int, delta: dict, reason=None, logprobs=None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        ],
    }
