"""Streamed tool calls and the parser flags, without a server.

Oracle: the same text parsed whole (``OutputParser.parse``, what a non-streamed
answer carries), against the stream's deltas fed in every split (hypothesis
picks the cut points), reassembled as a client does: per ``index``, the id and
name of the first delta, the arguments' pieces concatenated. The arguments are
also checked against ``json.loads`` of the text the test wrote.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unikv.serving.ops import ServeOptions
from unikv.serving.parsers import HarmonyParser, OutputParser

ARGS = {"city": "Paris", "when": {"days": [1, 2]}, "note": "a } b", "empty": {}}
TEXT = (
    "<think>\nHm.\n</think>\n\nOk. <tool_call>\n"
    f'{{"name": "weather", "arguments": {json.dumps(ARGS)}}}\n</tool_call>\n'
    '<tool_call>{"name":"clock","arguments":{}}</tool_call>'
)


def _reassemble(deltas: list[dict]) -> tuple[str, str, list[tuple]]:
    calls: dict[int, dict] = {}
    for d in deltas:
        for t in d.get("tool_calls") or ():
            c = calls.setdefault(t["index"], {"arguments": ""})
            if "id" in t:  # the call's first delta: id, type and name
                assert "id" not in c and t["type"] == "function"
                c.update(id=t["id"], name=t["function"]["name"])
            c["arguments"] += t["function"]["arguments"]
    content = "".join(d.get("content") or "" for d in deltas)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    ordered = [calls[k] for k in sorted(calls)]
    assert sorted(calls) == list(range(len(calls)))
    return content, reasoning, [(c["name"], c["arguments"]) for c in ordered]


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(1, len(TEXT) - 1), max_size=40, unique=True))
def test_streamed_tool_calls_reassemble_to_the_whole_answer(cuts):
    parser = OutputParser(reasoning=True, tools=True)
    message, called = parser.parse(TEXT)
    assert called and message["content"] == "Ok. " and message["reasoning_content"] == "Hm.\n"
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert [(n, json.loads(a)) for n, a in want] == [("weather", ARGS), ("clock", {})]
    stream, deltas, start = parser.stream(), [], 0
    for cut in [*sorted(cuts), len(TEXT)]:
        deltas += stream.feed(TEXT[start:cut])
        start = cut
    deltas += stream.finish()
    assert stream.called
    assert _reassemble(deltas) == ("Ok. ", "Hm.\n", want)


def test_a_call_streams_its_name_before_its_arguments_end():
    stream = OutputParser(reasoning=False, tools=True).stream()
    head = '<tool_call>{"name": "weather", "arguments": {"city": "Pa'
    first = stream.feed(head)
    header, *pieces = [t for d in first for t in d["tool_calls"]]
    assert header["function"] == {"name": "weather", "arguments": ""} and header["index"] == 0
    assert "".join(t["function"]["arguments"] for t in pieces) == '{"city": "Pa'
    later = stream.feed('ris"}}</tool_call>') + stream.finish()
    (rest,) = [t for d in later for t in d["tool_calls"]]
    assert rest == {"index": 0, "function": {"arguments": 'ris"}'}}


def test_a_block_that_never_gives_a_call_is_content():
    stream = OutputParser(reasoning=False, tools=True).stream()
    text = "Sure <tool_call>not json</tool_call>"
    deltas = stream.feed(text) + stream.finish()
    assert not stream.called
    assert "".join(d.get("content") or "" for d in deltas) == text


def test_vllm_parser_flags_choose_the_format():
    body = SimpleNamespace(tools=[{"type": "function"}], tool_choice="auto")
    bare = "{{ messages }}"  # a template with no tag: nothing by default
    assert OutputParser.for_request(bare, "p", body) is None
    hermes = OutputParser.for_request(bare, "p", body, "hermes", "qwen3")
    assert (hermes.tools, hermes.reasoning) == (True, True)
    assert isinstance(OutputParser.for_request(bare, "p", body, "openai"), HarmonyParser)
    assert isinstance(OutputParser.for_request(bare, "p", body, None, "openai_gptoss"),
                      HarmonyParser)  # fmt: skip
    none = SimpleNamespace(tools=[{"type": "function"}], tool_choice="none")
    assert OutputParser.for_request(bare, "p", none, "hermes") is None
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServeOptions(tool_call_parser="pythonic")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServeOptions(reasoning_parser="r1")
