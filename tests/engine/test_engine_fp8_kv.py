"""An fp8 KV cache (``LLM(kv_cache_dtype="fp8")``): attention K/V stored as fp8 with
scale 1 (clamped), read back by the attention kernels, compute in fp32 on CPU.

The reference is transformers' own model with the same weights, its K (after rope)
and V rounded through the same fp8 format as they enter its cache: the patched
``apply_rotary_pos_emb`` and a forward hook on every ``v_proj``. The engine's greedy
tokens and every sampled logit row equal that model's; the fp8 pool holds the pages
its bytes allow (4x fp32's); prefix hits, chunked prefill and preemption read the
fp8 pages back; an MLA model and an unknown KV dtype are refused."""

from __future__ import annotations

import contextlib

import pytest
import torch
from engine_fixtures import (
    GreedyReference,
    check_engine_outputs,
    check_greedy_run,
    engine_llm,
    save_tiny_deepseek,
    save_tiny_model,
)

from unikv.engine import LLM, SamplingParams

PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24


def _round(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    bound = torch.finfo(fp8).max
    return x.clamp(-bound, bound).to(fp8).to(x.dtype)


@contextlib.contextmanager
def fp8_cache_rounding(hf, module, fp8: torch.dtype):
    """transformers' ``hf`` (its modelling ``module``) with K after rope and V rounded
    through ``fp8`` before its cache stores them."""
    rope = module.apply_rotary_pos_emb

    def rounded_rope(q, k, *args, **kwargs):
        q, k = rope(q, k, *args, **kwargs)
        return q, _round(k, fp8)

    hooks = [
        layer.self_attn.v_proj.register_forward_hook(lambda _m, _i, out: _round(out, fp8))
        for layer in hf.model.layers
    ]
    module.apply_rotary_pos_emb = rounded_rope
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = rope
        for h in hooks:
            h.remove()


ARCHS = {  # arch -> transformers modelling module
    "llama": "transformers.models.llama.modeling_llama",
    "mistral": "transformers.models.mistral.modeling_mistral",  # sliding window
}
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module", params=[("llama", "fp8"), ("mistral", "fp8"), ("llama", "fp8_e5m2")],
                ids=lambda p: "-".join(p))  # fmt: skip
def case(request, tmp_path_factory):
    import importlib

    arch, name = request.param
    path = str(tmp_path_factory.mktemp(f"{arch}_{name}"))
    hf = save_tiny_model(arch, path)
    module = importlib.import_module(ARCHS[arch])
    with fp8_cache_rounding(hf, module, FP8[name]):
        ref = GreedyReference(hf, path, PROMPT_LENS, NEW_TOKENS)
    plain = GreedyReference(hf, path, PROMPT_LENS, NEW_TOKENS)
    return ref, plain, module, name


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_and_logits_match_transformers_with_an_fp8_cache(case, page_size):
    ref, plain, module, name = case
    llm = engine_llm(ref, page_size=page_size, kv_cache_dtype=name)
    assert llm.kv_cache_dtype == FP8[name]
    assert all(s.spec.dtype == FP8[name] for s in llm.pool.subpools.values())
    with fp8_cache_rounding(ref.hf, module, FP8[name]):
        check_greedy_run(ref, llm)
    # the rounding is visible: the same model without it differs somewhere
    assert ref.greedy != plain.greedy or _logits_differ(ref, module, name)


def _logits_differ(ref, module, name) -> bool:
    from engine_fixtures import hf_logits

    seq = ref.prompts[3] + ref.greedy[3]
    with fp8_cache_rounding(ref.hf, module, FP8[name]):
        rounded = hf_logits(ref.hf, seq)
    return (rounded - hf_logits(ref.hf, seq)).abs().max().item() > 1e-4


def test_chunked_prefill_prefix_hits_and_preemption_read_fp8_pages(case):
    """7-token steps, a tight pool (preemptions; for the windowed model a full pool)
    and a second pass that hits the prefix cache (on by default for full attention):
    transformers' fp8-rounded tokens throughout."""
    ref, _, module, name = case
    windowed = module.__name__.endswith("mistral")  # a 7-token window: far fewer pages
    tokens, slack = (30, 0) if windowed else (130, 4096)
    tight = LLM(ref.path, device="cpu", kv_cache_dtype=name, max_num_seqs=4,
                max_num_batched_tokens=7, max_model_len=96, page_size=4,
                kv_cache_bytes=_bytes_for_tokens(ref.path, name, tokens) + slack)  # fmt: skip
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    with fp8_cache_rounding(ref.hf, module, FP8[name]):
        first = tight.generate(ref.prompts, params)
        stats = tight.stats
        assert [o.output_ids for o in first] == ref.greedy
        again = tight.generate(ref.prompts, params)
        check_engine_outputs(ref, tight, again)
    if not windowed:
        assert stats.preemptions > 0
    else:  # the window's few pages: admission waits instead, but the pool ran full
        (sub,) = tight.pool.subpools.values()
        assert stats.peak_pages[sub.name] >= 0.8 * (sub.num_pages - sub.first_page)
    if tight.prefix_caching:
        assert sum(o.num_cached_tokens for o in again) > 0


def _bytes_for_tokens(path: str, name: str, tokens: int) -> int:
    from unikv.hf_config import specs_from_hf_config

    configs = specs_from_hf_config(path, page_size=4, dtype=FP8[name])
    return sum(c.spec.entry_bytes for c in configs) * (tokens + 8)  # + the sink page


def test_fp8_pool_holds_four_times_the_fp32_tokens(case):
    ref, _, _, name = case
    budget = 1 << 20
    pages = {}
    for dtype in ("auto", name):
        llm = engine_llm(ref, kv_cache_dtype=dtype, kv_cache_bytes=budget)
        pages[dtype] = {n: s.num_pages - s.first_page for n, s in llm.pool.subpools.items()}
    for sub, n in pages[name].items():
        assert 4 * pages["auto"][sub] - 4 <= n <= 4 * pages["auto"][sub] + 4, pages


def test_bad_kv_dtypes_are_refused(case, tmp_path):
    ref, _, _, _ = case
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto'"):
        LLM(ref.path, device="cpu", kv_cache_dtype="fp16")  # neither the model dtype nor fp8
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(ref.path, device="cpu", kv_cache_dtype="int4")
    save_tiny_deepseek(3, str(tmp_path))
    with pytest.raises(ValueError, match="MLA latent sub-pool"):
        LLM(str(tmp_path), device="cpu", kv_cache_dtype="fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_fp8_cache_on_triton_under_the_interpreter(case):
    """The Triton store, extend (fresh prompts read the rounded cache, not their own
    K/V) and decode kernels over fp8 views (TRITON_INTERPRET set by conftest)."""
    ref, _, module, name = case
    prompts = [ref.prompts[1], ref.prompts[0]]
    llm = engine_llm(ref, backend="triton", max_model_len=48, kv_cache_dtype=name)
    with fp8_cache_rounding(ref.hf, module, FP8[name]):
        out = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
        want = [ref.greedy[1][:6], ref.greedy[0][:6]]
    assert [o.output_ids for o in out] == want


def test_recurrent_hybrid_keeps_its_state_dtypes(tmp_path):
    """Qwen3.5 (Gated DeltaNet + gated attention): the attention sub-pool holds fp8
    while the recurrent state keeps exactly the spec (dtypes) it has without fp8, and
    a run completes (its tokens are not compared: the reference patch is Llama's)."""
    from engine_fixtures import save_tiny_hybrid

    save_tiny_hybrid("qwen3_5", str(tmp_path))
    auto = LLM(str(tmp_path), device="cpu", max_model_len=64, page_size=4)
    fp8 = LLM(str(tmp_path), device="cpu", max_model_len=64, page_size=4, kv_cache_dtype="fp8")
    kinds = {s.spec.kind: s.spec for s in fp8.pool.subpools.values()}
    assert kinds["full"].dtype == torch.float8_e4m3fn
    assert kinds["mamba"] == {s.spec.kind: s.spec for s in auto.pool.subpools.values()}["mamba"]
    out = fp8.generate([[3, 1, 4, 1, 5, 9, 2, 6]], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(out[0].output_ids) == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_fp32_model_with_fp8_cache_matches_transformers(case, graphs):
    """On CUDA with the Triton kernels (graphs on and off), an fp32 model over an fp8
    cache gives transformers' fp8-rounded greedy tokens (computed on the CPU)."""
    from gpu_fixtures import gpu_llm

    ref, _, _, name = case
    llm = gpu_llm(ref.path, torch.float32, kv_cache_dtype=name, cuda_graphs=graphs,
                  max_model_len=96)  # fmt: skip
    out = llm.generate(ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.output_ids for o in out] == ref.greedy
