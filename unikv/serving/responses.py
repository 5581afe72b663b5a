"""OpenAI response bodies built from the engine's deltas.

Choice index of completion j of prompt i is ``i * n + j`` (OpenAI's order for
a list of prompts). Logprobs: completions use the legacy form (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``), chat the ``content``
list; both from the model's raw distribution, the sampled token first.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

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
        self.prompt_logprobs: dict[int, list] = {}  # choice -> its prompt's entries

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
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[i] = delta.prompt_logprobs
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


@dataclass
class Echo:
    """What a completions answer adds of its prompts: ``echo`` (the prompt's text
    and tokens before the completion's), ``prompt_logprobs`` (vLLM's field),
    ``drop``: max_tokens 0 (the one sampled token is left out)."""

    texts: list[str]  # per prompt
    first: list[tuple[int, str]]  # per prompt: its first token and that token's text
    echo: bool
    prompt_logprobs: bool
    drop: bool
    n: int

    @classmethod
    def of(cls, body, items, llm) -> Echo:
        tok = llm.tokenizer
        texts, first = [], []
        with llm.tokenizer_lock:
            for ids, text, _ in items:
                texts.append(text if text is not None else tok.decode(ids))
                first.append((ids[0], tok.decode([ids[0]], skip_special_tokens=False)))
        drop = body.max_tokens == 0
        return cls(texts, first, body.echo, body.prompt_logprobs is not None, drop, body.n)

    def prompt_entries(self, i: int, choices: Choices) -> list:
        """(first token, None logprob) then the entries of choice ``i``'s prompt."""
        return choices.prompt_logprobs.get(i - i % self.n) or [None]


def echo_logprobs(first: tuple[int, str], entries: list, out, as_ids, end: int) -> dict:
    """The legacy logprobs of an echoed prompt (its first token has no logprob),
    then the completion's entries ``out`` (or None), whose offsets start at ``end``
    (the prompt text's length)."""
    token, text = first
    rest = completion_logprobs(entries[1:], as_ids, len(text))
    lp = {
        "tokens": [_name(token, text, as_ids), *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }
    if out is not None:
        more = completion_logprobs(out, as_ids, end)
        for key in lp:
            lp[key] += more[key]
    return lp


def prompt_logprob_dicts(entries: list, as_ids: bool = False) -> list:
    """vLLM's ``prompt_logprobs``: None, then {token id: {logprob, rank,
    decoded_token}} per prompt token (the token and the top k)."""
    out = [None]
    for token, lp, rank, top, text in entries[1:]:
        d = {str(token): {"logprob": lp, "rank": rank, "decoded_token": _name(token, text, as_ids)}}
        for k, (i, v, s) in enumerate(top):
            d.setdefault(
                str(i), {"logprob": v, "rank": k + 1, "decoded_token": _name(i, s, as_ids)}
            )
        out.append(d)
    return out


def completion_body(
    rid: str, model: str, choices: Choices, prompt_tokens: int, as_ids=False, echo=None
):
    index = iter(sorted(choices.text))

    def choice(text, lp):
        i = next(index)
        if echo is not None and echo.drop:  # max_tokens 0: the sampled token left out
            text, lp = "", [] if lp is not None else None
            choices.token_ids[i] = []
        out = {
            "text": text,
            "logprobs": completion_logprobs(lp, as_ids) if lp is not None else None,
        }
        if echo is None:
            return out
        entries = echo.prompt_entries(i, choices)
        if echo.echo:
            out["text"] = echo.texts[i // echo.n] + text
            if lp is not None:
                j = i // echo.n
                out["logprobs"] = echo_logprobs(
                    echo.first[j], entries, lp, as_ids, len(echo.texts[j])
                )
        if echo.prompt_logprobs:
            out["prompt_logprobs"] = prompt_logprob_dicts(entries, as_ids)
        return out

    return _body(rid, model, "text_completion", choices, prompt_tokens, choice)


def chat_body(
    rid: str, model: str, choices: Choices, prompt_tokens: int, as_ids=False, parser=None
):
    """``parser``: a ``parsers.OutputParser`` (reasoning, tool calls) or None."""

    def choice(text, lp):
        message = {"role": "assistant", "content": text}
        if parser is not None:
            message |= parser.parse(text)[0]
        return {
            "message": message,
            "logprobs": chat_logprobs(lp, as_ids) if lp is not None else None,
        }

    body = _body(rid, model, "chat.completion", choices, prompt_tokens, choice)
    if choices.prompt_logprobs:  # vLLM's prompt_logprobs: the (one) prompt's, top level
        body["prompt_logprobs"] = prompt_logprob_dicts(choices.prompt_logprobs[0], as_ids)
    for c in body["choices"]:  # OpenAI: a choice that called a tool finishes "tool_calls"
        if c["message"].get("tool_calls") and c["finish_reason"] == "stop":
            c["finish_reason"] = "tool_calls"
    return body


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
