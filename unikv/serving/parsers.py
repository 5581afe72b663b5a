"""Chat output parsers: reasoning separated from the answer (Qwen3's
``<think>...</think>``) and Hermes / Qwen-style tool calls
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) into OpenAI's
``tool_calls``.

Which apply is read from the chat template in use (the request's
``chat_template`` or the tokenizer's): a template that writes ``<think>`` gets
reasoning separation, one that writes ``<tool_call>`` gets tool-call parsing
when the request passes ``tools`` (and ``tool_choice`` is not "none"). vLLM's
``--tool-call-parser`` / ``--reasoning-parser`` choose them instead
(``TOOL_PARSERS``, ``REASONING_PARSERS``).

``OutputParser.parse(text)`` gives a whole message's fields; ``stream()`` a
``StreamState`` that turns text deltas into chat delta dicts: reasoning and
content as they come (holding back a tail that may begin a tag), and tool
calls as OpenAI streams them (``ToolStream``: a call's id and name first, then
its arguments in pieces).

gpt-oss's harmony format (a template that writes ``<|channel|>``) has its own
parser, ``HarmonyParser``: the output's messages (``<|channel|>analysis``:
reasoning, ``final``: the answer, ``commentary to=functions.NAME``: a tool call)
are read from the text decoded with its special tokens kept. It reads the text
itself: the ``openai-harmony`` package needs its vocabulary file downloaded
before it parses anything, which an offline server cannot do.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# vLLM's --tool-call-parser / --reasoning-parser names -> the format parsed here
TOOL_PARSERS = {"hermes": "hermes", "openai": "harmony"}
REASONING_PARSERS = {"qwen3": "think", "deepseek_r1": "think", "openai_gptoss": "harmony"}
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _raw_arguments(block: str) -> tuple[str, str] | None:
    """(name, arguments text) of a whole block whose call is written name first with
    its arguments an object: the arguments exactly as the model wrote them (what
    the stream sends piece by piece); None for any other form."""
    head = _HEAD.match(block)
    if head is None or block[head.end() : head.end() + 1] != "{":
        return None
    try:
        call, _ = json.JSONDecoder().raw_decode(block.strip())
        _, end = json.JSONDecoder().raw_decode(block, head.end())
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return call["name"], block[head.end() : end]


def _one_call(block: str) -> tuple[str, str] | None:
    """(name, arguments text) of one block's call, or None when not parsable."""
    raw = _raw_arguments(block)
    if raw is not None:
        return raw
    try:
        call = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return call["name"], args if isinstance(args, str) else json.dumps(args)


def parse_tool_calls(text: str) -> tuple[str, list[dict]] | None:
    """(content outside the blocks, OpenAI tool_calls) of Hermes-style text, or
    None when it holds no parsable tool call."""
    calls = []
    for block in _TOOL_BLOCK.findall(text):
        call = _one_call(block)
        if call is None:
            return None
        calls.append(
            {"id": _call_id(), "type": "function",
             "function": {"name": call[0], "arguments": call[1]}}
        )  # fmt: skip
    if not calls:
        return None
    content = text[: text.index(TOOL_OPEN)]
    return (content if content.strip() else ""), calls


class ToolStream:
    """Hermes tool calls streamed as OpenAI streams them: per call (``index``) a
    first delta with its id, type and name (arguments ""), then the arguments'
    text in pieces as it arrives (a trailing run of ``}`` and spaces, which may
    close the call rather than its arguments, held back until the block
    closes). The pieces concatenate to the non-streamed call's arguments."""

    def __init__(self) -> None:
        self.text = ""  # from the first <tool_call> on
        self.calls: list[dict] = []  # per block: id, name, args start, sent, done

    def _blocks(self, final: bool) -> list[tuple[str, bool]]:
        parts = self.text.split(TOOL_OPEN)[1:]
        out = []
        for k, part in enumerate(parts):
            body, closed, _ = part.partition(TOOL_CLOSE)
            out.append((body, bool(closed) or final or k + 1 < len(parts)))
        return out

    def feed(self, text: str, final: bool = False) -> list[dict]:
        self.text += text
        out = []
        for k, (body, closed) in enumerate(self._blocks(final)):
            if k == len(self.calls):
                head = _HEAD.match(body)
                if head is None or body[head.end() : head.end() + 1] != "{":
                    if not closed:
                        return out  # the name (or the arguments' form) is still arriving
                    call = _one_call(body)
                    if call is None:
                        continue  # not parsable: left out (finish decides)
                    self.calls.append({"start": None, "sent": 0, "done": True})
                    out.append(self._delta(k, _call_id(), call[0], call[1]))
                    continue
                name = json.loads(f'"{head.group(1)}"')
                self.calls.append({"start": head.end(), "sent": 0, "done": False})
                out.append(self._delta(k, _call_id(), name, ""))
            state = self.calls[k] if k < len(self.calls) else None
            if state is None or state["done"]:
                continue
            if closed:
                raw = _raw_arguments(body)
                args = raw[1] if raw is not None else body[state["start"] :].rstrip()
                state["done"] = True
            else:
                args = body[state["start"] : len(body) - _held(body, TOOL_CLOSE)]
                args = args.rstrip("} \n\t\r")
            if len(args) > state["sent"]:
                out.append(self._delta(k, None, None, args[state["sent"] :]))
                state["sent"] = len(args)
        return out

    @staticmethod
    def _delta(index: int, cid, name, args: str) -> dict:
        if cid is None:
            return {"index": index, "function": {"arguments": args}}
        return {"index": index, "id": cid, "type": "function",
                "function": {"name": name, "arguments": args}}  # fmt: skip


@dataclass
class OutputParser:
    """reasoning: split ``<think>`` blocks off; tools: parse tool calls;
    opened: the prompt already opened the think block (the template wrote
    ``<think>`` at the end of the generation prompt)."""

    reasoning: bool
    tools: bool
    opened: bool = False

    harmony = False

    @classmethod
    def for_request(cls, template: str | None, prompt: str, body, tool_parser=None,
                    reasoning_parser=None):  # fmt: skip
        """The parser of a request (an OutputParser, a HarmonyParser or None):
        ``tool_parser`` / ``reasoning_parser`` (vLLM's flag values, None: read
        off the chat template) choose the formats."""
        template = template or ""
        wants_tools = bool(body.tools) and body.tool_choice != "none"
        tool = TOOL_PARSERS.get(tool_parser)
        think = REASONING_PARSERS.get(reasoning_parser)
        if "harmony" in (tool, think) or (tool is think is None and CHANNEL in template):
            return HarmonyParser(wants_tools)
        reasoning = think == "think" if think else THINK_OPEN in template or THINK_CLOSE in template
        tools = wants_tools and (tool == "hermes" if tool else TOOL_OPEN in template)
        if not (reasoning or tools):
            return None
        return cls(reasoning, tools, reasoning and prompt.rstrip().endswith(THINK_OPEN))

    def parse(self, text: str) -> tuple[dict, bool]:
        """(message fields: content, reasoning_content, tool_calls; whether it
        called a tool)."""
        reasoning, content = None, text
        if self.reasoning:
            body = text.lstrip()
            opened = self.opened or body.startswith(THINK_OPEN)
            if opened:
                body = body.removeprefix(THINK_OPEN)
                if THINK_CLOSE in body:
                    reasoning, content = body.split(THINK_CLOSE, 1)
                    content = content.lstrip("\n")
                else:
                    reasoning, content = body, ""
        message = {"content": content or None if reasoning is not None else content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning.lstrip("\n")
        called = False
        if self.tools and content and TOOL_OPEN in content:
            parsed = parse_tool_calls(content)
            if parsed is not None:
                message["content"] = parsed[0] or None
                message["tool_calls"] = parsed[1]
                called = True
        return message, called

    def stream(self) -> StreamState:
        return StreamState(self)


class StreamState:
    """One streamed choice's parser state: ``feed(text)`` and ``finish()`` return
    chat delta dicts; ``called`` once a tool call was sent."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.pending = ""
        self.phase = "start" if parser.reasoning else "content"
        if parser.reasoning and parser.opened:
            self.phase = "reasoning"
        self.tools = ToolStream()
        self.sent_content = False
        self.called = False
        self.started_reasoning = False
        self.started_content = not parser.reasoning  # after </think>: newlines dropped

    def feed(self, text: str, final: bool = False) -> list[dict]:
        self.pending += text
        out: list[dict] = []
        while True:
            before = (self.phase, len(self.pending))
            if self.phase == "start":
                head = self.pending.lstrip()
                if head.startswith(THINK_OPEN):
                    self.pending = head[len(THINK_OPEN) :]
                    self.phase = "reasoning"
                elif THINK_OPEN.startswith(head) and not final:
                    return out  # may still become the open tag
                else:
                    self.phase = "content"
            elif self.phase == "reasoning":
                i = self.pending.find(THINK_CLOSE)
                if i >= 0:
                    self._reasoning(out, self.pending[:i])
                    self.pending = self.pending[i + len(THINK_CLOSE) :].lstrip("\n")
                    self.phase = "content"
                else:
                    keep = 0 if final else _held(self.pending, THINK_CLOSE)
                    self._reasoning(out, self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    return out
            elif self.phase == "content":
                if not self.started_content:
                    self.pending = self.pending.lstrip("\n")
                    if not self.pending:
                        return out
                    self.started_content = True
                i = self.pending.find(TOOL_OPEN) if self.parser.tools else -1
                if i >= 0:
                    head = self.pending[:i]  # (blank before any content: none, as parse's)
                    if head.strip() or (head and self.sent_content):
                        out.append({"content": head})
                    self.pending = self.pending[i:]
                    self.phase = "tool"
                else:
                    tag = TOOL_OPEN if self.parser.tools else ""
                    keep = 0 if final or not tag else _held(self.pending, tag)
                    sent = self.pending[: len(self.pending) - keep]
                    if sent:
                        out.append({"content": sent})
                        self.sent_content = True
                    self.pending = self.pending[len(self.pending) - keep :]
                    return out
            else:  # tool: each call's name, then its arguments as they come
                text, self.pending = self.pending, ""
                calls = self.tools.feed(text, final)
                if calls:
                    self.called = True
                    out.append({"tool_calls": calls})
                return out
            if (self.phase, len(self.pending)) == before:
                return out

    def _reasoning(self, out: list, text: str) -> None:
        if not self.started_reasoning:
            text = text.lstrip("\n")
        if text:
            self.started_reasoning = True
            out.append({"reasoning_content": text})

    def finish(self) -> list[dict]:
        """The deltas still held when the stream ends (a tool block that never
        gave a call: its text as content)."""
        out = self.feed("", final=True)
        if self.phase == "tool" and not self.called:
            out.append({"content": self.tools.text})
        return out


CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_TRAILING_SPECIAL = re.compile(r"<\|[^|<>]*\|>$")
_TAIL_TAG = re.compile(r"<\|[^|<>]*(\|>?)?")  # a tag (maybe still arriving) at a body's end


def _harmony_messages(text: str) -> list[tuple[str, str | None, str, bool]]:
    """(channel, tool name or None, body, complete) of each message of harmony text
    (the assistant's output: its first header follows the prompt's ``<|start|>assistant``)."""
    out = []
    pos = 0
    while pos < len(text):
        m = text.find(MESSAGE, pos)
        if m < 0:
            break
        header = text[pos:m]
        end, stop = len(text), None
        for tag in _ENDS:
            i = text.find(tag, m)
            if i >= 0 and i < end:
                end, stop = i, tag
        channel = ""
        if CHANNEL in header:
            channel = header.split(CHANNEL, 1)[1].split(" ", 1)[0].split("<|", 1)[0].strip()
        tool = _RECIPIENT.search(header)
        out.append((channel, tool.group(1) if tool else None, text[m + len(MESSAGE) : end],
                    stop is not None))  # fmt: skip
        if stop is None:
            break
        pos = end + len(stop)
        nxt = text.find(START, pos)
        pos = len(text) if nxt < 0 else nxt + len(START)
    return out


@dataclass
class HarmonyParser:
    """gpt-oss's output: reasoning (analysis), content (final) and tool calls
    (commentary to=functions.NAME). ``tools``: tool calls are parsed."""

    tools: bool
    harmony = True

    def fields(self, text: str, final: bool) -> tuple[str, str, list[dict]]:
        """(reasoning, content, tool calls) of ``text``; while streaming
        (``final`` False) an open message's tail that may begin a tag is held back."""
        reasoning, content, calls = [], [], []
        for channel, tool, body, complete in _harmony_messages(text):
            if not complete and not final:  # hold back a tag that may be arriving
                i = body.rfind("<|")
                tail = i >= 0 and _TAIL_TAG.fullmatch(body[i:]) is not None
                cut = i if tail else len(body) - _held(body, "<|")
                body = body[:cut]
            elif not complete:  # the stop token's text (decoded with the specials kept)
                body = _TRAILING_SPECIAL.sub("", body)
            if tool is not None and self.tools:
                if complete or final:
                    calls.append((tool, body.strip()))
            elif channel == "analysis":
                reasoning.append(body)
            elif channel == "final" or (tool is None and channel != "commentary"):
                content.append(body)
            else:  # commentary to the user: part of the answer
                content.append(body)
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            for name, args in calls
        ]
        return "".join(reasoning), "".join(content), tool_calls

    def parse(self, text: str) -> tuple[dict, bool]:
        reasoning, content, calls = self.fields(text, True)
        message = {"content": content or None, "reasoning_content": reasoning or None}
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self)


class HarmonyStream:
    """A streamed choice of ``HarmonyParser``: each feed re-reads the text so far
    and sends what grew (reasoning, content); tool calls at the end."""

    def __init__(self, parser: HarmonyParser) -> None:
        self.parser, self.text = parser, ""
        self.sent = {"reasoning_content": 0, "content": 0}
        self.called = False

    def _grown(self, final: bool) -> tuple[list[dict], list[dict]]:
        reasoning, content, calls = self.parser.fields(self.text, final)
        out = []
        for key, value in (("reasoning_content", reasoning), ("content", content)):
            if len(value) > self.sent[key]:
                out.append({key: value[self.sent[key] :]})
                self.sent[key] = len(value)
        return out, calls

    def feed(self, text: str) -> list[dict]:
        self.text += text
        return self._grown(False)[0]

    def finish(self) -> list[dict]:
        out, calls = self._grown(True)
        if calls:
            self.called = True
            out.append({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
        return out


@dataclass
class ForcedToolParser:
    """A call that ``tool_choice`` forced through a JSON-schema grammar: the output
    is the named function's arguments (``names``: that one name), or with
    ``required`` a list of {"name", "parameters"}."""

    names: list[str]
    required: bool
    harmony = False

    def parse(self, text: str) -> tuple[dict, bool]:
        if self.required:
            try:
                calls = [(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):  # cut short: not parsable
                return {"content": text}, False
        else:
            calls = [(self.names[0], text)]
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            for name, args in calls
        ]
        return {"content": None, "tool_calls": tool_calls}, True

    def stream(self) -> ForcedToolStream:
        return ForcedToolStream(self)


class ForcedToolStream:
    """A streamed forced call: the whole call once the stream ends."""

    def __init__(self, parser: ForcedToolParser) -> None:
        self.parser, self.text, self.called = parser, "", False

    def feed(self, text: str) -> list[dict]:
        self.text += text
        return []

    def finish(self) -> list[dict]:
        message, self.called = self.parser.parse(self.text)
        if not self.called:
            return [{"content": self.text}]
        return [{"tool_calls": [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]}]
