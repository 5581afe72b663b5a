"""``TextStage``: the API process's text of a completion from the engine's token ids.

Oracle: the tokenizer's own ``decode`` of the outputs (the full text), cut
before the first stop string, and the output tokens cut at the first token
whose text completes it (what one token at a time gives). The raw deltas are
fed in random chunk sizes (hypothesis): several tokens at once, as a
speculative verify step sends them, end at the same token and text; the
streamed text pieces concatenate to the final text.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_fixtures import CORPUS, build_tokenizer

from unikv.engine.sampling import SamplingParams
from unikv.engine.tracks import Delta
from unikv.serving.text_stage import TextStage

TOK = build_tokenizer()
PROMPT = TOK.encode("Hello, how are you")
OUTPUT = TOK.encode(" " + CORPUS[0] + " " + CORPUS[3])


def _run(stage: TextStage, chunks: list[list[int]], last: str) -> tuple[list, str, list]:
    ids, pieces, deltas = [], [], []
    for k, chunk in enumerate(chunks):
        reason = last if k == len(chunks) - 1 else None
        delta = stage.advance((chunk, None, reason, None, None, 0, None))
        if delta is not None:
            ids += delta.token_ids
            pieces.append(delta.text)
            deltas.append(delta)
        if stage.done:
            break
    return ids, "".join(pieces), deltas


def _chunks(tokens: list[int], sizes: list[int]) -> list[list[int]]:
    out, pos = [], 0
    for size in sizes:
        if pos >= len(tokens):
            break
        out.append(tokens[pos : pos + size])
        pos += size
    if pos < len(tokens):
        out.append(tokens[pos:])
    return out


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=30),
    stop=st.sampled_from(["lazy", "dog. A", "cuts", "zzz"]),
    min_tokens=st.integers(0, 6),
)
def test_chunked_deltas_stop_where_one_token_at_a_time_does(sizes, stop, min_tokens):
    params = SamplingParams(max_tokens=64, stop=(stop,), min_tokens=min_tokens)
    # the oracle: the first output prefix (at least min_tokens long) whose text holds stop
    full = TOK.decode(OUTPUT)
    cut = next(
        (n for n in range(max(min_tokens, 1), len(OUTPUT) + 1) if stop in TOK.decode(OUTPUT[:n])),
        None,
    )
    stage = TextStage(0, PROMPT, params, TOK, threading.Lock())
    ids, text, deltas = _run(stage, _chunks(OUTPUT, sizes), "length")
    if cut is None:
        assert ids == OUTPUT and text == full and deltas[-1].finish_reason == "length"
        assert not stage.hit_stop
        return
    want = TOK.decode(OUTPUT[:cut])
    assert ids == OUTPUT[:cut]
    assert text == want[: want.index(stop)]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop


def test_logprob_texts_and_the_engines_finish_pass_through():
    params = SamplingParams(max_tokens=4, logprobs=1)
    stage = TextStage(1, PROMPT, params, TOK, threading.Lock())
    tok, other = OUTPUT[0], OUTPUT[1]
    row = (tok, -0.5, 1, [(other, -1.0, None)], None)
    delta = stage.advance(([tok], [row], None, None, None, 3, None))
    assert delta.index == 1 and delta.finish_reason is None and delta.cached_tokens is None
    assert delta.logprobs == [(tok, -0.5, 1, [(other, -1.0, TOK.decode([other]))],
                               TOK.decode([tok]))]  # fmt: skip
    end = stage.advance(([], None, "stop", 2, None, 3, None))
    assert (end.finish_reason, end.stop_reason, end.cached_tokens) == ("stop", 2, 3)
    assert stage.advance(([OUTPUT[2]], None, None, None, None, 3, None)) is None  # ended
    failed = TextStage(0, PROMPT, params, TOK, threading.Lock())
    delta = failed.advance(([], None, "error", None, "RuntimeError: boom", 0, None))
    assert delta.error == "RuntimeError: boom" and delta.finish_reason == "error"
    assert failed.failed("gone") is None  # already ended


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(include):
    params = SamplingParams(max_tokens=64, stop=("lazy",), include_stop_str_in_output=include)
    stage = TextStage(0, PROMPT, params, TOK, threading.Lock())
    _, text, _ = _run(stage, [[t] for t in OUTPUT], "length")
    full = TOK.decode(OUTPUT)
    end = full.index("lazy") + (len("lazy") if include else 0)
    assert text == full[:end]


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=30), n=st.integers(1, 3))
def test_the_plain_fast_path_gives_the_general_paths_deltas(sizes, n):
    """A completion with no stop strings and no logprobs takes ``advance``'s fast
    path; the same rows through the general path (``plain`` off) give equal
    Deltas, and their text is the tokenizer's decode of the outputs."""
    params = SamplingParams(max_tokens=64, n=n)
    fast = TextStage(2, PROMPT, params, TOK, threading.Lock())
    slow = TextStage(2, PROMPT, params, TOK, threading.Lock())
    assert fast.plain
    slow.plain = False
    chunks = _chunks(OUTPUT, sizes)
    got = _run(fast, chunks, "length")
    want = _run(slow, chunks, "length")
    assert got[2] == want[2]  # every Delta, field by field
    assert got[0] == OUTPUT and got[1] == TOK.decode(OUTPUT)
    assert got[2][-1].finish_reason == "length"


def test_the_one_token_call_gives_the_general_paths_deltas():
    """``token(t)`` (the engine client's one-token rows of a plain completion) gives
    the Delta the general path gives the row ``([t], None, ...)``, token by token,
    and leaves the stage where that path does (its finishing row then agrees)."""
    params = SamplingParams(max_tokens=64)
    fast = TextStage(1, PROMPT, params, TOK, threading.Lock())
    slow = TextStage(1, PROMPT, params, TOK, threading.Lock())
    slow.plain = False
    for t in OUTPUT[:-1]:
        want = slow.advance(([t], None, None, None, None, None, None))
        assert isinstance(want, Delta) and fast.token(t) == want
    last = ([OUTPUT[-1]], None, "length", None, None, 0, None)
    assert fast.advance(last) == slow.advance(last)
    assert fast.detok.text == slow.detok.text == TOK.decode(OUTPUT)
