"""A steady verify step's plan updated in place (``plan_steady.SteadyVerify``,
``plan_tables.KeptTables``, issue 42): steady speculative decoding builds the
verify plan's host arrays from the requests only at its first verify step,
advancing them afterwards, and builds its block tables only where the allocator's
page mapping changed; every advanced plan's bytes equal a full rebuild of the same
batch (a second description), and every verify plan's block tables and write ids
equal the allocator's tables built afresh from ``req_to_token`` (the rows' ids
gathered there, not read from the host mirror), over runs whose acceptance varies,
with a finish and an admission in the middle, preemption, compaction between steps
and a draft model's placeholders, at pages 1, 4 and 16; the tokens stay
transformers'. Verify graphs run as their eager stand-in (``capture=False``: the
same padded plans)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_fixtures import (  # noqa: F401  (a fixture)
    VOCAB,
    assert_pages_returned,
    hf_greedy,
    one_thread,
    save_tiny_model,
)

from unikv.engine import LLM, SamplingParams
from unikv.engine.plan import StepPlanner
from unikv.engine.plan_upload import SOME, StepUpload
from unikv.engine.scheduler import Scheduler
from unikv.engine.speculative.config import allow_forced_acceptance
from unikv.hf_config import specs_from_hf_config
from unikv.ids import VirtualTokenIds
from unikv.placement import pool_bytes_for, worst_case_pages

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3
FIELDS = ("input_ids", "positions", "logits_indices", "seq_lens", "slots", "q_indptr")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    return path, save_tiny_model("llama", path)


def make_llm(path: str, spec: dict, ps: int = 4, seqs: int = 4, kv_cache_bytes=8 << 20) -> LLM:
    with allow_forced_acceptance():
        llm = LLM(path, device="cpu", dtype=torch.float32, page_size=ps, max_num_seqs=seqs,
                  max_num_batched_tokens=32, max_model_len=80, kv_cache_bytes=kv_cache_bytes,
                  speculative_config=spec, debug=True)  # fmt: skip
    llm.runner.capture_verify(K + 1, seqs, capture=False)  # the graphs' eager stand-in
    llm.scheduler.spec.pad_drafts = True
    return llm


def watch_builds(monkeypatch) -> list[bool]:
    """Per full build of the step arrays: whether its batch was a verify step."""
    builds, real = [], StepUpload.build

    def build(self, batch, *a, **k):
        builds.append(batch.drafts is not None)
        return real(self, batch, *a, **k)

    monkeypatch.setattr(StepUpload, "build", build)
    return builds


def test_steady_verify_steps_build_nothing(llama, monkeypatch):
    """One request, every draft accepted (steady from its first verify step): the
    full builder runs for the first verify step only, every later one is advanced."""
    path, hf = llama
    spec = {"method": "ngram", "num_speculative_tokens": K, "force_accept": True}
    llm = make_llm(path, spec)
    builds = watch_builds(monkeypatch)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], params)[0].output_ids
    steps = llm.stats.spec_verify_steps
    assert steps >= 9 and llm.stats.spec_accepted_tokens == llm.stats.spec_draft_tokens
    assert sum(builds) == 1, f"{sum(builds)} full builds for {steps} verify steps"
    assert llm.runner.planner.upload.steady.advanced == steps - 1
    with torch.no_grad():  # each step's bonus is the target's greedy token
        greedy = hf(torch.tensor([prompt + out])).logits[0].argmax(-1).tolist()
    for at in range(K + 1, len(out), K + 1):
        assert out[at] == greedy[len(prompt) + at - 1]


def compare_with_rebuild(monkeypatch, planner) -> dict:
    """After every advanced upload: its host and device bytes (the fields a verify
    step reads; ``lanes`` only one-token steps read) and placeholder kind equal a
    full build of the same batch by a fresh ``StepUpload``, and its staged row ids
    are the rows' ids in ``req_to_token``. After every verify plan: its block
    tables and write ids equal ``compare_tables``'."""
    seen = {"advanced": 0, "deltas": set(), "pending": set()}
    real, steady, build = StepUpload.upload, planner.upload.steady, StepUpload.build

    def upload(self, batch, rows, pad_q=1, row_ids=None, write_ids=None):
        before, starts = steady.advanced, getattr(steady, "starts", None)
        dev, host, pending = real(self, batch, rows, pad_q, row_ids, write_ids)
        if steady.advanced == before:
            return dev, host, pending
        seen["advanced"] += 1
        seen["deltas"].update((steady.starts - starts).tolist())
        ref = StepUpload(torch.device("cpu"), max_seqs=self.max_seqs,
                         max_tokens=self.max_tokens, pin=False)  # fmt: skip
        ref_dev, ref_host, ref_pending = build(ref, batch, rows, pad_q)
        assert pending == ref_pending
        seen["pending"].add(pending)
        for name in FIELDS:
            want = ref_host[name].tobytes()
            assert host[name].tobytes() == want, f"{name}: advanced != rebuilt"
            assert dev[name].numpy().tobytes() == want, f"{name} on the device"
            assert ref_dev[name].numpy().tobytes() == want
        return dev, host, pending

    monkeypatch.setattr(StepUpload, "upload", upload)
    return check_tables(monkeypatch, planner, seen)


def check_tables(monkeypatch, planner, seen: dict) -> dict:
    """After every verify plan of ``planner``: ``compare_tables`` (counted in
    ``seen["verify"]``)."""
    plan = StepPlanner.plan
    seen.setdefault("verify", 0)

    seen.setdefault("host_writes", 0)

    def checked(self, batch, *a, **k):
        staged = batch.host_rows is not None and not batch.host_rows.on_device
        before = self.host_writes
        out = plan(self, batch, *a, **k)
        if self is planner and batch.drafts is not None and batch.derive is None:
            seen["verify"] += 1
            # rows known on the host (not a draft model's): write ids from the host
            assert self.host_writes - before == int(staged), "host write ids not used"
            seen["host_writes"] += int(staged)
            compare_tables(self, batch, out, k.get("slack", 0))
        return out

    monkeypatch.setattr(StepPlanner, "plan", checked)
    return seen


def compare_tables(planner, batch, plan, slack: int) -> None:
    """A verify plan's block tables and write ids (the planner's buffers, kept or
    built) equal tables the allocator builds afresh into new tensors for the same
    slots and lengths, from the rows' virtual ids gathered from ``req_to_token``
    on the device (``token_vids``); padded rows and lanes point at the sink."""
    alloc, num = planner.alloc, len(batch.requests)
    starts = np.fromiter((r.num_cached for r in batch.requests), np.int64, num)
    slots = np.fromiter((r.slot for r in batch.requests), np.int64, num)
    counts = np.asarray(batch.num_new, np.int64)
    vids = VirtualTokenIds(alloc.view.token_vids(slots, starts, counts))
    if batch.host_rows is not None:  # the rows' ids the step uploaded: the same ids
        assert batch.host_rows.data.tolist() == vids.data.tolist()
    dev = vids.data.device
    seq_lens = torch.from_numpy((starts + counts).astype(np.int32)).to(dev)
    slots_dev = torch.from_numpy(slots.astype(np.int32)).to(dev)
    real = int(counts.sum())
    for sub in planner.subpools:
        step = plan.subpools[sub.name]
        table, write = step.block_table, step.write_ids.data
        window = sub.spec.sliding_window or 0
        window += max(batch.num_new) - 1 + slack if window else 0
        want = torch.full((num, table.shape[1]), -7, dtype=torch.int32, device=dev)
        alloc.block_table(slots_dev, seq_lens, sub.name, want, window=window)
        assert torch.equal(table[:num], want), f"{sub.name}: block table != rebuilt"
        assert not table[num:].any(), "padded rows read the sink"
        ids = alloc.translate(vids, sub.name).data.long()  # the device translation
        got = write[:real].cpu().numpy().tobytes()
        assert got == ids.cpu().numpy().tobytes(), f"{sub.name}: write ids != translated"
        assert not write[real:].any(), "padded lanes write the sink"


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_advanced_plans_equal_a_rebuild(llama, monkeypatch, ps):
    """Real n-gram drafts (acceptance varies), two seats for three requests: the
    first finishes early and the third is admitted in its seat mid-run. Every
    advanced verify plan equals a full rebuild byte for byte; the tokens are
    transformers'."""
    path, hf = llama
    g = torch.Generator().manual_seed(4)
    pattern = torch.randint(0, VOCAB, (5,), generator=g).tolist()
    items = [pattern * 3 + [7, 9], pattern * 2 + [3], pattern[::-1] * 3]
    limits = [10, 28, 20]
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip
    llm = make_llm(path, spec, ps, seqs=2)
    seen = compare_with_rebuild(monkeypatch, llm.runner.planner)
    builds = watch_builds(monkeypatch)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in limits]
    got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, n) for p, n in zip(items, limits)]
    s = llm.stats
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens  # accepts and rejects
    assert seen["advanced"] >= 4 and len(seen["deltas"]) > 1, seen  # acceptance varied
    assert seen["advanced"] + sum(builds) == s.spec_verify_steps == seen["verify"]
    assert seen["host_writes"] == seen["verify"]  # (every rows' ids on the host)
    assert sum(builds) >= 2  # the batch changed (a finish, an admission): built again
    assert np.all(np.asarray(sorted(seen["deltas"])) >= 1)
    reused = llm.runner.planner.kept_tables.reused
    print(f"ps {ps}: {reused} of {seen['verify']} verify steps reused their tables")
    if ps == 16:  # (rows stay inside their page for steps on end)
        assert reused > 0


def test_advanced_plans_under_pressure(llama, monkeypatch):
    """A pool too small for every request's rows: the engine preempts and readmits
    (recompute), the batch changes under the kept arrays; every advanced plan still
    equals a full rebuild and the tokens are transformers'."""
    path, hf = llama
    configs = specs_from_hf_config(path, page_size=4, dtype=torch.float32)
    pages = worst_case_pages(configs[0].spec, 4, 80, 32) + 1
    g = torch.Generator().manual_seed(11)
    items = [torch.randint(0, VOCAB, (4,), generator=g).tolist() * 4 for _ in range(4)]
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}  # fmt: skip
    llm = make_llm(path, spec, kv_cache_bytes=pool_bytes_for(configs, {"full": pages}))
    seen = compare_with_rebuild(monkeypatch, llm.runner.planner)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, 40) for p in items]
    assert llm.stats.preemptions > 0 and seen["advanced"] > 0
    assert seen["verify"] == llm.stats.spec_verify_steps
    assert seen["host_writes"] == seen["verify"]  # (every rows' ids on the host)
    assert_pages_returned(llm)


def test_kept_tables_across_compaction(llama, monkeypatch):
    """Pages of 16, a repetitive prompt per request (n-gram drafts mostly kept); a
    request of the allocator's own holds the pages under theirs until mid-run, then
    leaves (holes), and compaction runs before every later step: it moves the
    running requests' pages under tables kept from the last verify step. Every
    verify plan's tables and write ids equal a rebuild (``compare_tables``: a step
    after a move must build them again), some steps reuse them, and the tokens are
    transformers' (the moved pages' rows intact)."""
    path, hf = llama
    g = torch.Generator().manual_seed(9)
    items = [torch.randint(0, VOCAB, (4,), generator=g).tolist() * 5 for _ in range(2)]
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip
    llm = make_llm(path, spec, 16, seqs=3)
    alloc = llm.alloc
    below = alloc.new_request()  # three pages under every page the run takes
    alloc.alloc_extend(np.array([below]), np.array([0]), np.array([48]))
    seen = compare_with_rebuild(monkeypatch, llm.runner.planner)
    moved, schedule = [], Scheduler.schedule

    def compacting(self, *a, **k):
        moved.append(self.alloc.compact() if len(moved) > 6 else 0)
        if len(moved) == 6:
            self.alloc.free_request(below)  # (a table write: the next plan builds anyway)
        return schedule(self, *a, **k)

    monkeypatch.setattr(Scheduler, "schedule", compacting)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, 40) for p in items]
    kept = llm.runner.planner.kept_tables
    assert sum(moved) > 0 and kept.reused > 0, (moved, kept.reused)
    assert seen["verify"] == llm.stats.spec_verify_steps
    assert seen["host_writes"] == seen["verify"]  # (every rows' ids on the host)
    assert_pages_returned(llm)


def test_kept_tables_without_graphs(llama, monkeypatch):
    """Eager verify steps (no verify graphs: tables as wide as the longest request,
    no padded rows): every verify plan's tables and write ids equal a rebuild, some
    steps reuse them, and the tokens are transformers'."""
    path, hf = llama
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip
    llm = LLM(path, device="cpu", dtype=torch.float32, page_size=16, max_num_seqs=2,
              max_num_batched_tokens=32, max_model_len=80, kv_cache_bytes=8 << 20,
              speculative_config=spec, debug=True)  # fmt: skip
    assert llm.runner.verify_graphs is None
    seen = check_tables(monkeypatch, llm.runner.planner, {})
    g = torch.Generator().manual_seed(4)
    items = [torch.randint(0, VOCAB, (5,), generator=g).tolist() * 3 for _ in range(2)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, 30) for p in items]
    assert seen["verify"] == llm.stats.spec_verify_steps
    assert seen["host_writes"] == seen["verify"]  # (every rows' ids on the host)
    assert llm.runner.planner.kept_tables.reused > 0


def test_advanced_plans_with_device_drafts(llama, monkeypatch):
    """A draft model (the target as its own draft): the verify step's drafts are on
    the device, its arrays hold placeholders for them; the advanced plans equal a
    rebuild (placeholders included) and the tokens are transformers'."""
    path, hf = llama
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    llm = make_llm(path, spec)
    seen = compare_with_rebuild(monkeypatch, llm.runner.planner)
    g = torch.Generator().manual_seed(5)
    items = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 11)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = [o.output_ids for o in llm.generate(items, params)]
    assert got == [hf_greedy(hf, p, 24) for p in items]
    assert seen["advanced"] >= 3 and llm.stats.spec_verify_steps > seen["advanced"]
    assert seen["pending"] == {SOME}  # (the drafts' placeholders, filled on the device)
    assert seen["verify"] == llm.stats.spec_verify_steps


@pytest.mark.gpu
@pytest.mark.parametrize("ps", [4, 16])
def test_steady_verify_plans_on_gpu(llama, monkeypatch, ps):
    """On a CUDA GPU with CUDA graphs (``pytest -m gpu``; fp32): forced acceptance,
    one request, real verify graphs: one full build for all its verify steps, every
    verify plan's tables equal a rebuild (pages of 16: some reused), the tokens of
    the same engine's eager verify steps (no graphs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path, _ = llama
    spec = {"method": "ngram", "num_speculative_tokens": K, "force_accept": True}
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True)
    kw = {"device": "cuda", "dtype": torch.float32, "page_size": ps, "max_num_seqs": 4,
          "max_num_batched_tokens": 32, "max_model_len": 80, "kv_cache_bytes": 8 << 20,
          "speculative_config": spec}  # fmt: skip
    with allow_forced_acceptance():
        want = LLM(path, cuda_graphs=False, **kw).generate([prompt], params)[0].output_ids
        llm = LLM(path, cuda_graphs=True, **kw)
    assert llm.runner.verify_graphs is not None and llm.runner.verify_graphs.graphs
    builds = watch_builds(monkeypatch)
    seen = check_tables(monkeypatch, llm.runner.planner, {})
    assert llm.generate([prompt], params)[0].output_ids == want
    assert sum(builds) == 1 and llm.stats.spec_verify_steps >= 9
    assert seen["verify"] == llm.stats.spec_verify_steps
    assert llm.runner.planner.kept_tables.reused > 0 if ps == 16 else True
