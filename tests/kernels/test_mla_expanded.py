"""MLA prefill in the expanded form (``ExtendAttention.mla_expanded``) and the rule
that picks it (``engine.attention.mla_prefill_costs``), fp32 on CPU.

The tiny DeepSeek-V2 / V3 of ``engine_fixtures.tiny_deepseek_config`` (rank 24, rope
8, nope 12, v 20, 4 heads) run through ``LLM`` with every extend step forced into one
form (the runner's ExtendAttention replaced by one with ``mla_form`` set):

- both forms: greedy tokens identical to transformers for 24 new tokens over prompts
  of 5, 17, 33 and 60 tokens at page sizes 1, 4 and 16, every sampled logit row
  within 1e-4 of transformers' teacher-forced logits; chunked prefill (7-token
  steps: chunks over cached prefixes share steps with decodes); the Triton backend
  under the interpreter (expanded); the rule itself takes both forms on the
  engine's chunked steps, same tokens;
- on the engine's own plans (mixed cached / new lengths, chunked), every expanded
  layer call equals the absorbed form computed on the same step from the model's
  weights (W_UK absorbed into the queries, W_UV applied after) within fp32 rounding;
- the rule on DeepSeek-V3's widths: decode-like steps and small chunks over long
  contexts absorb, large prefills expand, the memory cap holds, and its predicted
  absorbed / expanded ratio at the H200 anchor shape is the measured one
  (benchmarks/results/mla_prefill_h200.json);
- on a CUDA GPU (``-m gpu``): fp32 greedy tokens of a V3 at DeepSeek's MLA widths
  (rank 512, rope 64, nope 128, v 128) with each form forced, on the Triton kernels.
"""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from engine_fixtures import (
    GreedyReference,
    check_engine_outputs,
    check_greedy_run,
    engine_llm,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_deepseek,
)

from unikv.engine import LLM, SamplingParams, runner
from unikv.engine.attention import (
    EXPANDED_MAX_BYTES,
    MLA_FORMS,
    DecodeAttention,
    ExtendAttention,
    MLALayerCache,
    mla_prefill_costs,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24
V3 = {"heads": 128, "rank": 512, "rope": 64, "nope": 128, "v_dim": 128}
PREFILL_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks/results/mla_prefill_h200.json"


@pytest.fixture(scope="module", params=[2, 3])
def ref(request, tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp(f"deepseek_v{request.param}"))
    return GreedyReference(save_tiny_deepseek(request.param, path), path, PROMPT_LENS, NEW_TOKENS)


_llm = functools.partial(engine_llm, max_model_len=128)


def _force(monkeypatch, kind) -> None:
    monkeypatch.setattr(runner, "ExtendAttention", kind)


class CheckedExpanded(ExtendAttention):
    """Expanded on every extend step; each layer call also computes the absorbed form
    on the same plan (the model's W_UK / W_UV split written here) and records the
    largest difference and the steps' shapes (requests, cached tokens)."""

    errors: ClassVar[list[float]] = []
    shapes: ClassVar[list[tuple[int, int]]] = []

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, mla_form="expanded", **kw)

    def mla_expanded(self, layer, q, latent, rope, kv_b_weight, sm_scale):
        out = super().mla_expanded(layer, q, latent, rope, kv_b_weight, sm_scale)
        heads, rank, nope = q.shape[1], latent.shape[1], q.shape[2] - rope.shape[1]
        w = kv_b_weight.view(heads, -1, rank)  # (H, nope + v, rank)
        q_latent = torch.einsum("thd,hdr->thr", q[..., :nope], w[:, :nope])
        absorbed = self.mla(layer, q_latent, q[..., nope:], latent, rope, sm_scale)
        absorbed = torch.einsum("thr,hvr->thv", absorbed, w[:, nope:])
        self.errors.append((out - absorbed).abs().max().item())
        new = self.plan.q_indptr.diff()
        cached = int((self.plan.seq_lens - new).sum())
        self.shapes.append((self.plan.seq_lens.shape[0], cached))
        return out


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_both_forms_match_transformers(ref, monkeypatch, form, page_size):
    _force(monkeypatch, functools.partial(ExtendAttention, mla_form=form))
    llm = _llm(ref, page_size=page_size)
    check_greedy_run(ref, llm)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_expanded_equals_absorbed_on_engine_plans(ref, monkeypatch, page_size):
    """7-token steps cut prompts mid-way: chunks over cached prefixes share steps
    with other requests' chunks and decodes (mixed cached / new lengths)."""
    _force(monkeypatch, CheckedExpanded)
    CheckedExpanded.errors, CheckedExpanded.shapes = [], []
    llm = _llm(ref, page_size=page_size, max_num_batched_tokens=7)
    outputs = llm.generate(ref.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    check_engine_outputs(ref, llm, outputs)
    assert any(b > 1 and cached > 0 for b, cached in CheckedExpanded.shapes)
    assert max(CheckedExpanded.errors) < 1e-5


class RecordedRule(ExtendAttention):
    """The rule as the runner uses it; records the form each extend step took."""

    forms: ClassVar[list[str]] = []

    def expands_mla(self, layer, **widths) -> bool:
        expands = super().expands_mla(layer, **widths)
        if layer == 0:
            self.forms.append(self.mla_form)
        return expands


def test_rule_takes_both_forms_on_engine_steps(ref, monkeypatch):
    """7-token steps at page 1, the longest prompt first: its chunks run alone over
    their own rows (expanded); then steps mixing its decodes or last chunk with other
    requests' chunks, whose B x Lmax gathered rows outweigh the attention, absorb.
    The tokens are transformers' either way."""
    _force(monkeypatch, RecordedRule)
    RecordedRule.forms = []
    llm = _llm(ref, max_num_batched_tokens=7, page_size=1)
    order = sorted(range(len(ref.prompts)), key=lambda i: -len(ref.prompts[i]))
    outputs = llm.generate(
        [ref.prompts[i] for i in order], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    )
    want = [hf_greedy(ref.hf, ref.prompts[i], NEW_TOKENS) for i in order]
    assert [o.output_ids for o in outputs] == want
    assert RecordedRule.forms[0] == "expanded" and set(RecordedRule.forms) == set(MLA_FORMS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs Triton natively")
def test_expanded_on_triton_under_the_interpreter(ref, monkeypatch):
    """Expanded prefill through the Triton store and extend kernels (TRITON_INTERPRET
    set by conftest); decodes through the Triton MLA kernel."""
    _force(monkeypatch, functools.partial(ExtendAttention, mla_form="expanded"))
    prompts = [ref.prompts[2][:30], ref.prompts[0][:3]]  # a chunked one and a short one
    llm = _llm(ref, backend="triton", max_model_len=64, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(ref.hf, p, 6) for p in prompts]


def _expands(bsz, new, cached, page_size=16, dtype=torch.bfloat16) -> bool:
    """The ExtendAttention rule on a host-only plan: ``bsz`` requests of ``new`` new
    tokens over ``cached`` cached ones (meta tensors: shapes only)."""
    pages = -(-(cached + new) // page_size)
    meta = torch.device("meta")
    table = torch.empty(bsz, pages, dtype=torch.int32, device=meta)
    plan = types.SimpleNamespace(
        input_ids=torch.empty(bsz * new, dtype=torch.int64, device=meta),
        max_q_len=new,
        subpools={"mla": types.SimpleNamespace(block_table=table)},
    )
    cache = MLALayerCache("mla", torch.empty(1, 576, dtype=dtype, device=meta), page_size)
    return ExtendAttention([cache], plan, None, 1.0).expands_mla(0, **V3)


def test_rule_on_deepseek_v3_widths():
    assert _expands(1, 4096, 0) and _expands(1, 1024, 0) and _expands(1, 16384, 0)
    assert _expands(8, 512, 4096)
    assert _expands(4, 128, 2048)
    assert not _expands(64, 1, 4096)  # decode-like rows in an extend step
    assert not _expands(1, 8, 8192)  # a small chunk over a long context
    assert not _expands(8, 8192, 32768)  # cheaper, but over the transient-memory cap
    rows = 8 * (32768 + 8192)
    assert rows * 128 * (2 * 128 + 64 + 128) * 2 > EXPANDED_MAX_BYTES
    # monotone in the new tokens per request over a fixed cached prefix
    picks = [_expands(4, n, 4096) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert picks == sorted(picks) and picks[0] is False and picks[-1] is True


def test_rule_picks_the_faster_form_measured_on_the_h200():
    """``bench_mla_prefill`` on the H200 (cac53ea: DeepSeek-V3's layer, 128 heads, page
    16, both forms through unikv's kernels): at 8 x (4k cached + n new) for n 8..128
    and on the 4k and 16k fresh prefills the rule picks the form that ran faster, and
    around the crossover (n 32..128) its cost ratio is the measured time ratio within
    15 %."""
    rows = json.loads(PREFILL_RESULTS.read_text())["extend"]
    checked = 0
    for row in rows:
        if (row["B"], row["cached"], row["new"]) == (1, 0, 1024):
            continue  # launch-bound: both forms far from their FLOP rates
        b, cached, new = row["B"], row["cached"], row["new"]
        absorbed, expanded = mla_prefill_costs(
            num_tokens=b * new, num_rows=b * (cached + new), max_q_len=new,
            max_len=cached + new, **V3,
        )  # fmt: skip
        measured = row["expanded_us"] / row["absorbed_us"]
        assert (expanded < absorbed) == (measured < 1.0), row
        if cached and 32 <= new <= 128:
            assert expanded / absorbed == pytest.approx(measured, rel=0.15), row
        checked += 1
    assert checked == 8


def test_forms_and_decode_steps():
    """Decode steps always absorb; a forced form is kept; a bad one is refused."""
    assert DecodeAttention([None], None, None, 1.0).expands_mla(0, **V3) is False
    assert (
        ExtendAttention([None], None, None, 1.0, mla_form="absorbed").expands_mla(0, **V3) is False
    )
    assert ExtendAttention([None], None, None, 1.0, mla_form="expanded").expands_mla(0, **V3)
    with pytest.raises(ValueError, match="mla_form"):
        ExtendAttention([None], None, None, 1.0, mla_form="fast")


WIDE = {  # DeepSeek's MLA widths, 16 heads (as tests/engine/test_engine_deepseek_gpu.py)
    "hidden_size": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": 96,
    "num_hidden_layers": 2,
    "initializer_range": 0.05,
}


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_gpu_fp32_both_forms_at_deepseek_widths(tmp_path, monkeypatch, form):
    """fp32 on CUDA (Triton store, MLA and extend kernels; decodes in CUDA graphs):
    transformers' greedy tokens with every extend step in one form, chunked."""
    hf = save_tiny_deepseek(3, str(tmp_path), **WIDE)
    g = torch.Generator().manual_seed(5)
    lens = (3, 45, 100)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    want = [hf_greedy(hf, p, 16) for p in prompts]
    _force(monkeypatch, functools.partial(ExtendAttention, mla_form=form))
    llm = LLM(
        str(tmp_path), device="cuda", dtype=torch.float32, page_size=16, max_num_seqs=4,
        max_model_len=160, max_num_batched_tokens=64, cuda_graphs=True,
    )  # fmt: skip
    assert llm.backend.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    assert [o.output_ids for o in outputs] == want
