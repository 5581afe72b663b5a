"""Structured outputs through xgrammar: a JSON schema, any JSON object, a regex,
an EBNF grammar or a choice of strings constrains a request's tokens (a JSON
schema's values are compact: no free whitespace between tokens, so a bounded
schema gives a bounded output).

``compile_structured(llm, kind, spec)`` compiles the constraint once (cached per
tokenizer and spec) into a ``StructuredOutputs`` that ``SamplingParams.structured``
carries. The engine gives each such request its own ``xgrammar.GrammarMatcher``
on its first step (``Request.grammar``); before every sample of a step that
holds such requests, the matchers accept the tokens sampled since (this waits
for the previous step's tokens: the one host sync, only in steps with such
requests) and fill one bitmask row each, which is applied to those rows' logits
only. The grammar's end allows only the stop tokens (the model's EOS), so a
finished value ends the request.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field

import torch

KINDS = ("json", "json_object", "regex", "grammar", "choice")
CACHE_SIZE = 256  # compiled constraints kept per LLM


@dataclass(frozen=True)
class StructuredOutputs:
    """A compiled constraint: ``kind`` (one of KINDS), ``spec`` its source text,
    ``compiled`` xgrammar's CompiledGrammar."""

    kind: str
    spec: str
    compiled: object = field(compare=False, repr=False)


class _Compiler:
    """xgrammar's GrammarCompiler of one LLM's tokenizer, and its compiled cache."""

    def __init__(self, llm) -> None:
        import xgrammar as xgr

        if llm.tokenizer is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer")
        info = xgr.TokenizerInfo.from_huggingface(
            llm.tokenizer,
            vocab_size=llm.config.vocab_size,
            stop_token_ids=sorted(llm.eos_token_ids) or None,
        )
        self.compiler = xgr.GrammarCompiler(info)
        self.cache: dict[tuple[str, str], StructuredOutputs] = {}
        self.lock = threading.Lock()

    def compile(self, kind: str, spec: str) -> StructuredOutputs:
        key = (kind, spec)
        with self.lock:
            hit = self.cache.get(key)
        if hit is not None:
            return hit
        c = self.compiler
        if kind == "json":
            compiled = c.compile_json_schema(spec, any_whitespace=False)
        elif kind == "json_object":
            compiled = c.compile_builtin_json_grammar()
        elif kind == "regex":
            compiled = c.compile_regex(spec)
        elif kind == "grammar":
            compiled = c.compile_grammar(spec)
        elif kind == "choice":
            choices = json.loads(spec)
            ebnf = "root ::= " + " | ".join(json.dumps(s) for s in choices)
            compiled = c.compile_grammar(ebnf)
        else:
            raise ValueError(f"structured outputs: unknown kind {kind!r}, expected one of {KINDS}")
        out = StructuredOutputs(kind, spec, compiled)
        with self.lock:
            self.cache[key] = out
            while len(self.cache) > CACHE_SIZE:  # oldest first: many distinct schemas
                del self.cache[next(iter(self.cache))]
        return out


_COMPILERS_LOCK = threading.Lock()
# one compiler per tokenizer (an engine's, or the API process's), kept while it lives
_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compile_structured(llm, kind: str, spec: str) -> StructuredOutputs:
    """The StructuredOutputs of ``spec`` (a JSON schema's text for "json", "" for
    "json_object", a regex, an EBNF grammar, or a JSON list of strings for
    "choice"); ValueError (or xgrammar's own error) for an invalid one. ``llm``:
    anything with the engine's ``tokenizer``, ``config`` and ``eos_token_ids``."""
    if llm.tokenizer is None:
        raise ValueError("structured outputs need the checkpoint's tokenizer")
    key = (llm.config.vocab_size, tuple(sorted(llm.eos_token_ids)))
    with _COMPILERS_LOCK:
        compilers = _COMPILERS.setdefault(llm.tokenizer, {})
        compiler = compilers.get(key)
        if compiler is None:
            compiler = compilers[key] = _Compiler(llm)
    return compiler.compile(kind, spec)


def mask_structured(logits: torch.Tensor, reqs, prev_tokens: list[int] | None) -> bool:
    """Apply the grammar bitmask of every structured request of ``reqs`` (batch
    order) to its row of ``logits`` (B, V) fp32, in place; False when none is
    structured. ``prev_tokens``: the previous step's sampled tokens on the host
    (placeholders ``-(1 + lane)`` in output ids read from it)."""
    rows = [i for i, r in enumerate(reqs) if r.params.structured is not None]
    if not rows:
        return False
    import xgrammar as xgr

    vocab = logits.shape[-1]
    mask = xgr.allocate_token_bitmask(len(rows), vocab)  # all allowed
    for k, i in enumerate(rows):
        r = reqs[i]
        if r.grammar is None:
            r.grammar = [xgr.GrammarMatcher(r.params.structured.compiled), 0]
        matcher, done = r.grammar
        for t in r.output_ids[done:]:
            if t < 0:
                t = prev_tokens[-t - 1]
            if not matcher.is_terminated():
                matcher.accept_token(t)
        r.grammar[1] = len(r.output_ids)
        if not matcher.is_terminated():  # else: a step run ahead of its stop; discarded
            matcher.fill_next_token_bitmask(mask, k)
    rows_t = torch.tensor(rows, dtype=torch.int64).to(logits.device)
    x = logits.index_select(0, rows_t)
    xgr.apply_token_bitmask_inplace(x, mask.to(logits.device), vocab_size=vocab)
    logits.index_copy_(0, rows_t, x)
    return True
