"""Speculative decoding over the unified pool (issue 42).

    config.py   ``speculative_config`` (vLLM's keys), validated once at start-up
    ngram.py    prompt-lookup proposals from a request's token history (host)
    verify.py   acceptance: greedy prefix match and rejection sampling (torch)
    engine.py   the scheduler's hook: drafts, the verify batch, its rollback, metrics
    ahead.py    a verify step planned while the last one runs (``Speculator.pipeline``)
    headroom.py a verify step's rows held to the end of their page (``VerifyRows``)

A speculating step is an EXTEND step of ``1 + k_i`` rows per decoding request (its
pending token and its drafts); their K/V land in the request's pages through the
normal store, every row's logits are scored, and the rejected rows are rolled back
through the allocator's ``truncate`` (rows trimmed, emptied pages freed, window
bookkeeping restored).
"""

from unikv.engine.speculative.config import SpeculativeConfig, speculative_config_of

__all__ = ["SpeculativeConfig", "speculative_config_of"]
