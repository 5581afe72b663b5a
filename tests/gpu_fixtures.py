"""Shared pieces of the engine's GPU tests (``-m gpu``): seeded prompts,
transformers' models on the GPU (eager attention: its SDPA path drops Gemma-2's
soft-capping; eager experts), teacher-forced logits, the per-token record of a
bf16 run against transformers in bf16 and fp32, and what makes the GPU suite fit
the device budget:

- ``References``: one transformers model per (checkpoint, dtype) and its greedy
  tokens per prompt, computed once per test module and reused by every test of
  that checkpoint (the same weights and prompts give the same oracle);
- ``refs_fixture()`` / ``llms_fixture()``: the module-scoped ``refs`` and ``llms``
  fixtures of a test module whose ``saved`` fixture yields ``(name, path)``;
- ``gpu_llm``: an ``LLM`` on CUDA with the tests' shapes whose pool holds every
  request at once (``roomy_bytes``, the CPU default rule) instead of 90 % of the
  H200's free memory, which is ~10^8 pages of a tiny model at page size 1 (GBs of
  host and device page tables per LLM) and leaves nothing for a second process.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest
import torch
from engine_fixtures import VOCAB, assert_pages_returned

from unikv.engine.demo import hf_greedy

MAX_NUM_SEQS, MAX_MODEL_LEN, CHUNK = 8, 256, 32
PROMPT_LENS = [3, 17, 30, 45, 64, 100]  # the engine GPU tests' prompts
NEW_TOKENS = 32


def seeded_prompts(lens: list[int], seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def engine_prompts(seed: int = 7) -> list[list[int]]:
    """``seeded_prompts`` of ``PROMPT_LENS`` (451 tokens)."""
    return seeded_prompts(PROMPT_LENS, seed)


def hf_model(path: str, dtype: torch.dtype):
    """transformers' model of the checkpoint at ``path`` on the GPU, eval mode, on
    its own torch paths (``torch_reference_kernels``)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    torch_reference_kernels(model)
    return model.cuda().eval()


def torch_reference_kernels(model) -> list[str]:
    """Point the module-level kernels of ``model``'s modelling file back at
    transformers' torch references; returns their names.

    transformers swaps in fla-core's chunked kernels (gated delta rule, KDA) and
    causal-conv1d when they are installed, at import of the modelling file. fla's
    chunked form runs its dots in TF32 even on fp32 inputs: on the H100 with fla-core
    0.6.0, transformers' fp32 greedy tokens of the tiny Qwen3.5-MoE and Kimi-Linear
    left its own torch path's (a gap of 0.55 at the first token of a 30-token
    prompt), and with fla hidden both files passed (session 22). The oracle is the
    torch path: each such function is the hub wrapper
    ``use_kernel_func_from_hub_with_fallback`` (a closure over
    ``is_new_implementation``) around the torch function it names."""
    import inspect
    import sys

    module = sys.modules[type(model).__module__]
    swapped = []
    for name, fn in list(vars(module).items()):
        code = getattr(fn, "__code__", None)
        if code is not None and "is_new_implementation" in code.co_freevars:
            setattr(module, name, inspect.unwrap(fn))
            swapped.append(name)
    return swapped


class References:
    """transformers' side of one checkpoint, built lazily and kept: ``model(dtype)``
    loads once per dtype (with ``load(path, dtype)``, default ``hf_model``), and
    ``greedy(prompts, n, dtype)`` runs ``hf_greedy`` once per (dtype, prompt, n).
    ``close()`` frees the models (module teardown)."""

    def __init__(self, path: str, load=hf_model) -> None:
        self.path, self._load = path, load
        self._models: dict[torch.dtype, object] = {}
        self._greedy: dict[tuple, list[int]] = {}

    def model(self, dtype: torch.dtype = torch.float32):
        if dtype not in self._models:
            self._models[dtype] = self._load(self.path, dtype)
        return self._models[dtype]

    def greedy(
        self, prompts: list[list[int]], max_new_tokens: int, dtype: torch.dtype = torch.float32
    ) -> list[list[int]]:
        """transformers' greedy tokens of each prompt (lists of token ids)."""
        out = []
        for p in prompts:
            key = (dtype, tuple(p), max_new_tokens)
            if key not in self._greedy:
                self._greedy[key] = hf_greedy(self.model(dtype), p, max_new_tokens)
            out.append(list(self._greedy[key]))
        return out

    def close(self) -> None:
        self._models.clear()
        gc.collect()
        torch.cuda.empty_cache()


def _module_fixture(name: str, make, teardown):
    """The module-scoped fixture ``name``: ``make(path)`` of the module's ``saved``
    fixture (``(name, path)``), ``teardown(value)`` at module end."""

    @pytest.fixture(scope="module", name=name)
    def fixture(saved):
        value = make(saved[1])
        yield value
        teardown(value)

    return fixture


def refs_fixture():
    """The module-scoped ``refs`` fixture (``refs = refs_fixture()`` in a test
    module): ``References`` of the checkpoint of the module's ``saved`` fixture,
    shared by its tests and closed at module teardown."""
    return _module_fixture("refs", References, References.close)


def llms_fixture():
    """The module-scoped ``llms`` fixture (``llms = llms_fixture()``): ``LLMs`` of the
    ``saved`` checkpoint, reused by the tests that only read a run's results."""
    return _module_fixture("llms", LLMs, LLMs.clear)


def roomy_bytes(
    path: str,
    *,
    page_size: int,
    dtype: torch.dtype,
    max_num_seqs: int = MAX_NUM_SEQS,
    max_model_len: int = MAX_MODEL_LEN,
    chunk: int = CHUNK,
) -> int:
    """A pool budget holding ``max_num_seqs`` worst-case requests side by side (what
    ``LLM`` takes on CPU): no preemption, and a few MB for the tiny test models."""
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for, worst_case_pages

    configs = specs_from_hf_config(path, page_size=page_size, dtype=dtype)
    pages = {
        c.name: max_num_seqs * worst_case_pages(c.spec, c.page_size, max_model_len, chunk)
        for c in configs
    }
    return pool_bytes_for(configs, pages)


def gpu_llm(path: str, dtype: torch.dtype, **kw):
    """``unikv.LLM`` on CUDA with the engine tests' shapes (8 sequences, 256
    tokens, 32-token chunks, page 16) unless ``kw`` says otherwise; the pool is
    ``roomy_bytes`` unless ``kv_cache_bytes`` is given (None: sized from free
    memory, the engine's CUDA default)."""
    from unikv.engine import LLM

    kw.setdefault("page_size", 16)
    kw.setdefault("max_num_seqs", MAX_NUM_SEQS)
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    kw.setdefault("max_num_batched_tokens", CHUNK)
    if "kv_cache_bytes" not in kw:
        kw["kv_cache_bytes"] = roomy_bytes(
            path,
            page_size=kw["page_size"],
            dtype=dtype,
            max_num_seqs=kw["max_num_seqs"],
            max_model_len=kw["max_model_len"],
            chunk=kw["max_num_batched_tokens"],
        )
    return LLM(path, device="cuda", dtype=dtype, **kw)


class LLMs:
    """``gpu_llm``s of one checkpoint by configuration, built once and reused by the
    tests that only read a run's results (``LLMs(path)(dtype, **kw)``); ``clear()``
    drops them (module teardown)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._built: dict[tuple, object] = {}

    def __call__(self, dtype: torch.dtype, **kw):
        key = (dtype, *sorted(kw.items()))
        if key not in self._built:
            self._built[key] = gpu_llm(self.path, dtype, **kw)
        return self._built[key]

    def clear(self) -> None:
        self._built.clear()
        gc.collect()
        torch.cuda.empty_cache()


def assert_fp32_greedy(llm, refs: References, graphs: bool) -> None:
    """``llm`` runs the Triton backend, with CUDA graphs iff ``graphs``, and its
    greedy tokens of ``engine_prompts()`` are transformers' (fp32), with decode steps."""
    from unikv.engine import SamplingParams

    assert llm.backend.name == "triton" and (llm.runner.graphs is not None) == graphs
    outputs = llm.generate(engine_prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert_same_greedy(refs, engine_prompts(), outputs, NEW_TOKENS)
    assert llm.stats.decode_steps > 0


def assert_same_greedy(refs: References, prompts, outputs, max_new_tokens: int) -> None:
    """The outputs' tokens are transformers' fp32 greedy tokens; on a mismatch the
    message says where each request left them and how far its token lay below
    transformers' argmax over the engine's own sequence (teacher-forced): a gap near
    1e-6 is an fp32 near-tie, a large one a wrong computation."""
    want = refs.greedy(prompts, max_new_tokens)
    ours = [o.output_ids for o in outputs]
    if ours == want:
        return
    report = []
    for k, (prompt, out, ref) in enumerate(zip(prompts, ours, want, strict=True)):
        if out == ref:
            continue
        first = next(j for j, (a, b) in enumerate(zip(out, ref)) if a != b)
        gaps = teacher_forced_gaps(refs.model(), prompt, out)
        report.append(f"request {k} (prompt {len(prompt)}): leaves at token {first}, "
                      f"gap there {gaps[first].item():.3g}, worst {gaps.max().item():.3g}")  # fmt: skip
    raise AssertionError("not transformers' greedy tokens:\n" + "\n".join(report))


def assert_pool_empty(llm) -> None:
    """The allocator's invariants hold and no sub-pool has a live page after a run
    (the prefix cache dropped first: ``engine_fixtures.assert_pages_returned``)."""
    assert_pages_returned(llm)


def run_preempting(path: str, refs, tie: float, window_requests: int = 2, **kw):
    """fp32 on CUDA (graphs on) in a pool that holds two requests of 160 tokens (each
    sub-pool's worst case: full pages, a window, a state slot), so the batch of
    ``engine_prompts(11)`` (6 prompts of up to 100 + NEW_TOKENS tokens) must preempt:
    transformers' greedy tokens up to ``tie``, at least one preemption, the pool empty
    after. A windowed sub-pool holds ``window_requests`` requests' windows (Gemma-3's
    six sliding layers to one full layer: two windows' bytes would hold the whole batch's
    full-attention pages, so it never preempts). ``kw`` goes to ``gpu_llm``; returns the
    LLM."""
    from unikv.engine import SamplingParams
    from unikv.hf_config import specs_from_hf_config
    from unikv.placement import worst_case_pages
    from unikv.pool import pool_bytes_for

    chunk = kw.setdefault("max_num_batched_tokens", CHUNK)
    configs = specs_from_hf_config(path, page_size=16, dtype=torch.float32)
    share = {c.name: window_requests if getattr(c.spec, "sliding_window", None) else 2
             for c in configs}  # fmt: skip
    pages = {c.name: share[c.name] * worst_case_pages(c.spec, 16, 160, chunk) for c in configs}
    prompts = engine_prompts(11)
    llm = gpu_llm(path, torch.float32, kv_cache_bytes=pool_bytes_for(configs, pages),
                  max_model_len=160, **kw)  # fmt: skip
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    greedy = refs.greedy(prompts, NEW_TOKENS)
    assert_greedy_up_to_ties(refs.model(torch.float32), prompts, outputs, greedy, tie)
    assert llm.stats.preemptions > 0
    assert_pool_empty(llm)
    return llm


def decode_without_host_sync(llm, prompts: list[list[int]], steps: int = 3) -> None:
    """Prefill ``prompts`` (synchronous steps), then run ``steps`` decode steps in
    the engine loop's order (schedule N, launch N, resolve N-1, complete_ahead N)
    with ``torch.cuda.set_sync_debug_mode("error")`` around everything but the
    resolve (the one intended sync); then run the rest synchronously to the end, so
    the LLM is empty again. Asserts that each of those steps is a DECODE batch."""
    from unikv.engine import SamplingParams
    from unikv.engine.scheduler import BatchKind

    sched, runner = llm.scheduler, llm.runner
    for r in llm.make_requests(prompts, SamplingParams(max_tokens=steps + 5, temperature=0.0)):
        sched.add(r)
    while any(r.num_pending != 1 for r in sched.running) or sched.waiting:  # prefill first
        batch = sched.schedule()
        sched.complete(batch, runner.step(batch)[0])
    prev = None
    torch.cuda.synchronize()
    for _ in range(steps):
        torch.cuda.set_sync_debug_mode("error")
        try:
            batch = sched.schedule()
            assert batch.is_decode and batch.kind is BatchKind.DECODE, "a decode batch"
            launched = runner.launch(batch, prev)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if prev is not None:
            sched.resolve(prev.batch, prev.tokens())
        torch.cuda.set_sync_debug_mode("error")
        try:
            sched.complete_ahead(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        prev = launched
    sched.resolve(prev.batch, prev.tokens())
    while sched.has_work():  # the rest, synchronously
        batch = sched.schedule()
        sched.complete(batch, runner.step(batch)[0])


def teacher_forced(hf, seq: list[int]) -> torch.Tensor:
    """(len(seq), vocab) fp32 logits of one full forward over ``seq``, on the host."""
    with torch.no_grad():
        return hf(torch.tensor([seq]).cuda()).logits[0].float().cpu()


def teacher_forced_gaps(hf, prompt: list[int], out: list[int]) -> torch.Tensor:
    """(len(out),) how far each token of ``out`` lies below transformers' argmax
    given ``prompt`` and the tokens before it (0: it is the argmax)."""
    rows = teacher_forced(hf, prompt + out)[len(prompt) - 1 : -1]
    return rows.max(dim=-1).values - rows.gather(1, torch.tensor(out)[:, None])[:, 0]


@dataclass
class TokenCheck:
    """One engine token of a bf16 run, against transformers over the same sequence:
    max |logit difference| of the engine's row to transformers-fp32 and to
    transformers-bf16, transformers-bf16's own to fp32, and how far the engine's
    token lies below transformers-bf16's argmax (0 = the same token)."""

    request: int
    index: int
    ours_vs_fp32: float
    ours_vs_bf16: float
    hf16_vs_fp32: float
    gap: float


def bf16_token_checks(llm, hf16, hf32, prompts, max_tokens: int) -> list[TokenCheck]:
    """Generate greedily on ``llm`` (bf16) recording the logit row of every sampled
    token, then compare each with transformers' teacher-forced rows."""
    from unikv.engine import SamplingParams

    rows = {}

    def record(llm, batch, logits):
        for i, r in enumerate(batch.requests):
            if r.num_pending == 1:
                rows[(r.request_id, r.seq_len - 1)] = logits[i].float().cpu()

    outputs = llm.generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), on_step=record
    )
    first = llm.requests.next_id - len(outputs)
    checks = []
    for k, out in enumerate(outputs):
        seq = out.prompt_ids + out.output_ids
        ref16, ref32 = teacher_forced(hf16, seq), teacher_forced(hf32, seq)
        for j, token in enumerate(out.output_ids):
            p = len(out.prompt_ids) + j
            ours, r16, r32 = rows[(first + k, p)], ref16[p - 1], ref32[p - 1]
            checks.append(
                TokenCheck(
                    k,
                    j,
                    (ours - r32).abs().max().item(),
                    (ours - r16).abs().max().item(),
                    (r16 - r32).abs().max().item(),
                    (r16.max() - r16[token]).item(),
                )
            )
    return checks


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def assert_greedy_up_to_ties(hf32, prompts, outputs, refs_greedy, tie: float) -> None:
    """The engine's fp32 tokens are transformers' greedy tokens, or else every token
    is transformers-fp32's argmax over the engine's own sequence up to ``tie``.

    Recomputing a preempted request's tokens as one prefill runs other kernels than
    the decode steps transformers used for them (chunked recurrent kernels accumulate
    in TF32 on the GPU), so a near-tie of a tiny random model can flip one token and
    the continuations part. The teacher-forced check still covers every token: each
    must be the argmax of the reference up to ``tie`` given the tokens before it.
    """
    ours = [o.output_ids for o in outputs]
    if ours == refs_greedy:
        return
    worst = []
    for prompt, out in zip(prompts, ours, strict=True):
        worst.append(teacher_forced_gaps(hf32, prompt, out).max().item())
    flips = sum(o != r for o, r in zip(ours, refs_greedy, strict=True))
    print(f"{flips} request(s) left transformers' greedy path; worst teacher-forced gap "
          f"per request: {[round(w, 6) for w in worst]} (tie {tie})")  # fmt: skip
    assert max(worst) <= tie, f"a token is not transformers' fp32 argmax: gaps {worst}"
    assert flips <= 1, f"{flips} requests left transformers' greedy path (at most 1 near-tie)"


def assert_bf16_close(checks: list[TokenCheck], tie: float, off_fraction: float = 0.05) -> None:
    """bf16 against transformers, teacher-forced (``bf16_token_checks``): unikv-bf16
    is as close to transformers-fp32 as transformers-bf16 is (mean row error within
    1.5x, worst row within 2x), and at most ``off_fraction`` of the tokens lie more
    than ``tie`` below transformers-bf16's argmax (MoE routing and a recurrent state
    can flip a bf16 near-tie)."""
    ours_mean, hf_mean = mean(c.ours_vs_fp32 for c in checks), mean(c.hf16_vs_fp32 for c in checks)
    ours_max, hf_max = max(c.ours_vs_fp32 for c in checks), max(c.hf16_vs_fp32 for c in checks)
    off = [c for c in checks if c.gap > tie]
    print(f"mean row error vs fp32 {ours_mean:.4f} (transformers bf16 {hf_mean:.4f}), max "
          f"{ours_max:.3f} ({hf_max:.3f}), {len(off)}/{len(checks)} off argmax: {off[:4]}")  # fmt: skip
    assert ours_mean <= 1.5 * hf_mean + 0.02, (ours_mean, hf_mean)
    assert ours_max <= 2 * hf_max + 0.05, (ours_max, hf_max)
    assert len(off) <= off_fraction * len(checks), f"{len(off)} of {len(checks)} off argmax"
