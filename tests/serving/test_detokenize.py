"""Incremental detokenization: the Rust ``DecodeStream`` path (``StreamDetokenizer``)
and the ``tokenizer.decode`` fallback (``IncrementalDetokenizer``), on byte-level
BPE, SentencePiece-style (Llama 2: byte fallback + Strip; Metaspace) tokenizers
built here with ``tokenizers``.

Oracles: transformers' ``decode`` of the whole sequence, ``decode(prompt +
outputs)[len(decode(prompt)):]`` (a prompt's unfinished character less), and the
two implementations against each other on every case; the tokenizers library's
own ``DecodeStream`` raising, for the fallback.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_fixtures import CORPUS, build_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from unikv.engine.detokenize import (
    PROMPT_CONTEXT,
    IncrementalDetokenizer,
    StreamDetokenizer,
    decodes_in_rust,
    make_detokenizer,
)
from unikv.engine.request import Request, Status
from unikv.engine.sampling import SamplingParams
from unikv.engine.tracks import RequestGroup

TEXTS = CORPUS + ["héllo wörld, 日本語 is spoken in 日本.", "Ça va? Très bien, merci."]
SAMPLES = ["I like 中文 😀 and 日本", "Hello, how are you? fine", " Très 日本語 ok", "a\n\nb  c"]


def _sentencepiece(byte_fallback: bool) -> PreTrainedTokenizerFast:
    """Llama 2's pipeline (``▁`` for spaces, byte-fallback ``<0xNN>`` tokens, a
    decoder that strips the first space) or a Metaspace one (Mistral/T5 style)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if byte_fallback:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(TEXTS * 4, trainer)
    if byte_fallback:  # rebuilt with the 256 byte tokens as ordinary vocabulary
        model = json.loads(tok.to_str())["model"]
        vocab = model["vocab"]
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        normalizer = tok.normalizer
        tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizer
        tok.add_special_tokens(specials)
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + [decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


TOKENIZERS = {
    "byte_bpe": build_tokenizer(),
    "llama2": _sentencepiece(byte_fallback=True),
    "metaspace": _sentencepiece(byte_fallback=False),
}


class SlowView:
    """A tokenizer that is not fast (no Rust backend): the decode fallback."""

    is_fast = False

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=False):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _run(cls, tok, prompt, outputs, skip, chunks=1):
    """(deltas, final text) of ``cls`` fed ``outputs`` ``chunks`` at a time."""
    detok = cls(tok, prompt, skip)
    pieces = [detok.update(outputs[i : i + chunks]) for i in range(0, len(outputs), chunks)]
    pieces.append(detok.flush())
    return pieces, detok.text


def _oracle(tok, prompt, outputs, skip):
    """decode(prompt + outputs) after the prompt's text (an unfinished character of
    the prompt belongs to the outputs), or None when that is no prefix of it."""
    if not outputs:
        return ""
    head = tok.decode(prompt, skip_special_tokens=skip).rstrip("\ufffd")
    whole = tok.decode(prompt + outputs, skip_special_tokens=skip)
    return whole[len(head) :] if whole.startswith(head) else None


@pytest.mark.parametrize("name", TOKENIZERS)
def test_fast_tokenizers_stream_and_others_fall_back(name):
    tok = TOKENIZERS[name]
    assert decodes_in_rust(tok)
    assert type(make_detokenizer(tok, [5, 6], True)) is StreamDetokenizer
    assert type(make_detokenizer(SlowView(tok), [5, 6], True)) is IncrementalDetokenizer


def test_a_tokenizer_whose_decode_differs_from_rust_falls_back():
    """transformers' ``clean_up_tokenization_spaces`` edits WordPiece text after the
    Rust decode, and a subclass may override ``decode``: both take the fallback."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "b", ".", ",", "!", "?", "n't"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    cleaned = PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=True)
    ids = cleaned.encode("a . b , a n't")
    assert cleaned.decode(ids) != raw.decode(ids)  # the cleanup is active
    assert not decodes_in_rust(cleaned)
    detok = make_detokenizer(cleaned, ids[:1], True)
    assert type(detok) is IncrementalDetokenizer
    assert "".join(detok.update([t]) for t in ids[1:]) + detok.flush() == cleaned.decode(ids)[1:]
    plain = PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False)
    assert decodes_in_rust(plain)

    class Shouting(PreTrainedTokenizerFast):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    assert not decodes_in_rust(Shouting(tokenizer_object=raw))


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("skip", [True, False])
def test_text_prompts_give_the_full_decode(name, sample, skip):
    """A real text cut into prompt and outputs at every point: both give the full
    decode after the prompt's text, token by token and in chunks of 3."""
    tok = TOKENIZERS[name]
    ids = tok.encode(sample, add_special_tokens=False)
    ids = [tok.bos_token_id or 1] + ids + [tok.eos_token_id]
    for cut in range(1, len(ids)):
        prompt, outputs = ids[:cut], ids[cut:]
        want = _oracle(tok, prompt, outputs, skip)
        for chunks in (1, 3):
            fast, fast_text = _run(StreamDetokenizer, tok, prompt, outputs, skip, chunks)
            slow, slow_text = _run(IncrementalDetokenizer, tok, prompt, outputs, skip, chunks)
            assert "".join(fast) == fast_text == "".join(slow) == slow_text == want
            assert not any("\ufffd" in p for p in fast)  # no half character is sent


def test_sentencepiece_keeps_the_first_output_space():
    """Llama 2's decoder strips the text's first space: decoded alone the output
    ``▁`` is "", after the prompt it is the space of the full text."""
    tok = TOKENIZERS["llama2"]
    ids = tok.encode("Hello world and more", add_special_tokens=False)
    at = next(i for i in range(1, len(ids)) if tok.convert_ids_to_tokens(ids[i]).startswith("▁"))
    assert not tok.decode(ids[at : at + 1]).startswith(" ")
    want = tok.decode(ids[: at + 1])[len(tok.decode(ids[:at])) :]
    assert want.startswith(" ")
    for cls in (StreamDetokenizer, IncrementalDetokenizer):
        assert cls(tok, ids[:at], True).update(ids[at : at + 1]) == want


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(skip):
    tok = TOKENIZERS["byte_bpe"]
    prompt = tok.encode("Hello, how")
    outputs = [1] + tok.encode(" are you") + [2, 0]  # <|im_start|> ... <|im_end|> <|endoftext|>
    for cls in (StreamDetokenizer, IncrementalDetokenizer):
        _, text = _run(cls, tok, prompt, outputs, skip)
        assert text == tok.decode(prompt + outputs, skip_special_tokens=skip)[len("Hello, how") :]
        assert ("<|im_start|>" in text) is not skip
        assert text.endswith("you" if skip else "<|endoftext|>")


@pytest.mark.parametrize("name", ["byte_bpe", "llama2"])
def test_a_character_split_over_tokens_is_sent_once_whole(name):
    """日/😀 are several byte tokens: nothing is sent until the last arrives, then
    the whole character; a prompt that ends inside one leaves it to the outputs."""
    tok = TOKENIZERS[name]
    ids = tok.encode("ab 😀 日", add_special_tokens=False)
    split = [i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd")]
    assert len(split) >= 3  # the emoji (4 bytes) and 日 (3) are byte tokens here
    for cls in (StreamDetokenizer, IncrementalDetokenizer):
        detok = cls(tok, ids[:1], True)
        pieces = [detok.update([t]) for t in ids[1:]]
        assert "".join(pieces) == tok.decode(ids)[len(tok.decode(ids[:1])) :]
        assert all("\ufffd" not in p for p in pieces) and "😀" in pieces and pieces[-1] == "日"
        inside = cls(tok, ids[: split[0]], True)  # the prompt ends inside the emoji
        assert inside.update(ids[split[0] :]) + inside.flush() == tok.decode(ids)[3:]


def test_an_unfinished_character_at_the_end_is_flushed():
    tok = TOKENIZERS["byte_bpe"]
    ids = tok.encode("ok 日")
    for cls in (StreamDetokenizer, IncrementalDetokenizer):
        pieces, text = _run(cls, tok, ids[:1], ids[1:-1], True)
        head = len(tok.decode(ids[:1]))
        assert pieces[-1].endswith("\ufffd") and text == tok.decode(ids[:-1])[head:]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(TOKENIZERS)),
    prompt=st.lists(st.integers(0, 560), min_size=1, max_size=8),
    outputs=st.lists(st.integers(0, 560), min_size=0, max_size=24),
    skip=st.booleans(),
    chunks=st.integers(1, 4),
)
def test_random_ids_match_the_window_decode_and_each_other(name, prompt, outputs, skip, chunks):
    """Any ids (special, byte and out-of-vocabulary ones included): the two agree;
    from a short prompt, byte-level and Metaspace text is the full decode (byte
    fallback is not: a later byte token can turn an earlier one into U+FFFD)."""
    tok = TOKENIZERS[name]
    fast, fast_text = _run(StreamDetokenizer, tok, prompt, outputs, skip, chunks)
    slow, slow_text = _run(IncrementalDetokenizer, tok, prompt, outputs, skip, chunks)
    assert "".join(fast) == fast_text == "".join(slow) == slow_text
    if len(prompt) <= PROMPT_CONTEXT and name != "llama2":  # the window is the whole prompt
        want = _oracle(tok, prompt, outputs, skip)
        assert want is None or fast_text == want


class _RawView:
    """A fast-looking tokenizer over a raw ``tokenizers.Tokenizer``."""

    is_fast = True

    def __init__(self, raw):
        self.backend_tokenizer = raw  # transformers' name for a fast tokenizer's Rust one

    def decode(self, ids, skip_special_tokens=False):
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class _Upper:
    """A decoder whose window text does not extend its prefix's: upper-case once a
    "c" follows the first token."""

    def decode_chain(self, tokens):
        text = "".join(tokens)
        return [text.upper() if "c" in tokens[1:] else text]


def test_a_failing_stream_falls_back_to_decode():
    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "?": 3}, unk_token="?"))
    raw.decoder = decoders.Decoder.custom(_Upper())
    tok, ids = _RawView(raw), [0, 1, 0, 2, 1, 0, 1]
    stream = DecodeStream(skip_special_tokens=False)
    stream.step(raw, ids[:1])
    with pytest.raises(Exception, match="(?i)prefix"):  # tokenizers' own stream fails here
        for t in ids[1:]:
            stream.step(raw, t)
    fast, fast_text = _run(StreamDetokenizer, tok, ids[:1], ids[1:], False)
    slow, slow_text = _run(IncrementalDetokenizer, tok, ids[:1], ids[1:], False)
    assert fast == slow and fast_text == slow_text


@pytest.mark.parametrize("view", [lambda t: t, SlowView], ids=["stream", "fallback"])
@pytest.mark.parametrize(
    ("text", "stop", "include"),
    [(" how are you today? fine", "you to", False), (" ab 日本 cd 日本", "日本", True)],
)
def test_stop_strings_across_updates_cut_the_streamed_text(view, text, stop, include):
    """A stop string spread over several tokens (and bytes of one character): the
    stream's deltas concatenate to the full text cut at its first occurrence."""
    tok = TOKENIZERS["byte_bpe"]
    prompt, outputs = tok.encode("Hello,"), tok.encode(text)
    params = SamplingParams(
        max_tokens=64, stop=[stop], include_stop_str_in_output=include, temperature=0.0
    )
    request = Request(0, prompt, params, 0, frozenset(), 1000)
    group = RequestGroup([request], None, sink=[].append, tokenizer=view(tok))
    track, sent = request.track, []

    def finish(r, reason):
        r.status, r.finish_reason = Status.FINISHED, reason

    for t in outputs:
        if request.status is Status.FINISHED:
            break
        request.output_ids.append(t)
        delta = track.advance(0, None, finish)
        sent.append(delta.text if delta is not None else "")
    full = tok.decode(prompt + outputs)[len("Hello,") :]
    want = full[: full.index(stop) + len(stop) * include]
    assert "".join(sent) == want == group.output().outputs[0].text
    assert request.finish_reason == "stop" and len(request.output_ids) < len(outputs)
