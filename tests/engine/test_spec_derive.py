"""Verify steps planned ahead and derived on the device (``speculative/derive.py``):
step N + 1 is planned for N's full acceptance and moved on the device to where N's
acceptance puts it, so no step is thrown away for a partial acceptance.

Oracles: transformers' greedy tokens and the same engine without speculation
(Llama; gpt-oss with its 6-token window and sinks; Qwen3.5 and NemotronH, whose
state slot is chosen on the device too), at pages 1, 4 and 16, k = 1, 3
and 5, with prefix caching (a second turn hits) and under preemption; and, under a
planted acceptance rule (each draft kept with probability p, whatever the target
says), every verify step's last token is the target's greedy token after every
token before it, which holds only if the step's rows sat at the right positions
over the right K/V whatever the step before accepted. Counters: steps planned
ahead, steps thrown away (0 per 100 tokens at p = 0.3, 0.6, 1.0, where the bet
that N accepts everything would have lost most of them), and host reads while a
step is planned and launched ahead (none). Sampled requests (rejection sampling):
the pipelined run's tokens equal an unpipelined run handed the same drafts.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from engine_fixtures import VOCAB, assert_pages_returned, hf_greedy, one_thread, save_tiny_model  # noqa: F401

from unikv.engine import LLM, SamplingParams
from unikv.engine.scheduler import Scheduler
from unikv.engine.speculative import step as spec_step
from unikv.engine.speculative.verify import _emit
from unikv.hf_config import specs_from_hf_config
from unikv.placement import pool_bytes_for, worst_case_pages

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 24


@pytest.fixture(scope="module", params=["llama", "gpt_oss"])
def model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return path, save_tiny_model(request.param, path)


def prompts() -> list[list[int]]:
    """Repetitive prompts (the n-gram lookup finds drafts, some kept) and a random one."""
    g = torch.Generator().manual_seed(4)
    pattern = torch.randint(0, VOCAB, (5,), generator=g).tolist()
    return [pattern * 3 + [7, 9], torch.randint(0, VOCAB, (11,), generator=g).tolist()]


def make_llm(path: str, ps: int, k: int, pipeline: bool = True, **kw) -> LLM:
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "pipeline": pipeline} if k else None  # fmt: skip
    kw = {"device": "cpu", "max_num_seqs": 4, "max_num_batched_tokens": 32,
          "max_model_len": 64, "debug": True, **kw}  # fmt: skip
    return LLM(path, dtype=torch.float32, page_size=ps, speculative_config=spec, **kw)


def partial_spy(monkeypatch) -> dict:
    """Counts, per verify step that had a step planned ahead of it, whether some
    request kept fewer drafts than it was given (the bet would have lost)."""
    seen = {"partial": 0, "ahead": 0}
    complete = Scheduler.complete_verify

    def spy(sched, batch, emitted, ahead=None):
        if ahead is not None:
            seen["ahead"] += 1
            seen["partial"] += any(len(e) - 1 < len(d) for e, d in zip(emitted, batch.drafts))
        return complete(sched, batch, emitted, ahead)

    monkeypatch.setattr(Scheduler, "complete_verify", spy)
    return seen


def test_greedy_tokens_equal_plain_decoding(model, monkeypatch):
    """k = 1, 3 (prefix caching, a second turn hitting the cache) and 5 (a pool
    that preempts, by swap: ``test_spec_pipeline`` has recompute), rotated over
    pages 1, 4 and 16: pipelined tokens are the plain
    engine's and transformers'; steps were planned ahead after partial acceptances
    and kept, none thrown away; every page comes back."""
    path, hf = model
    items = prompts()
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    want = [hf_greedy(hf, p, NEW) for p in items]
    assert [o.output_ids for o in make_llm(path, 4, 0).generate(items, params)] == want
    seen = partial_spy(monkeypatch)
    for ps, k, kw in ((1, 1, {}), (4, 3, {"enable_prefix_caching": True})):
        llm = make_llm(path, ps, k, **kw)
        assert [o.output_ids for o in llm.generate(items, params)] == want, (ps, k)
        stats = llm.stats
        assert stats.spec_ahead_steps > 0 and stats.spec_ahead_dropped == 0, (ps, k)
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert seen["partial"] > 0, seen  # the bet would have lost these: kept now
    turns = [p + w + [1] for p, w in zip(items, want)]  # hits the pages speculation wrote
    short = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    again = [o.output_ids for o in llm.generate(turns, short)]
    assert again == [hf_greedy(hf, t, 12) for t in turns]
    assert llm.alloc.prefix.counters()["hit_tokens"] > 0
    assert_pages_returned(llm)
    configs = specs_from_hf_config(path, page_size=16, dtype=torch.float32)
    pages = {c.name: worst_case_pages(c.spec, 16, 64, 32) + 1 for c in configs}
    llm = make_llm(path, 16, 5, kv_cache_bytes=pool_bytes_for(configs, pages),
                   swap_host_bytes=1 << 22, preemption="swap")  # fmt: skip
    out = llm.generate(items + items[::-1], params)
    assert [o.output_ids for o in out] == want + want[::-1]
    assert llm.stats.preemptions > 0 and llm.stats.spec_ahead_steps > 0
    assert llm.stats.swapped_out > 0 and llm.stats.swapped_in > 0
    assert_pages_returned(llm)


def test_padded_graph_plans_derive_in_place(model):
    """The verify graphs' plans (every lane k + 1 rows, full-width tables), run
    eagerly on CPU: the derivation writes the same buffers; tokens equal plain;
    /metrics exports the steps planned ahead and thrown away as ``llm.stats``."""
    from prometheus_client import generate_latest
    from serving_fixtures import metric_values

    from unikv.serving.metrics import ServingMetrics

    path, hf = model
    items = prompts()
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, 4, 3)
    metrics = ServingMetrics(llm.engine, llm)
    llm.runner.capture_verify(4, 4, capture=False)
    llm.scheduler.spec.pad_drafts = True
    assert [o.output_ids for o in llm.generate(items, params)] == [
        hf_greedy(hf, p, NEW) for p in items
    ]
    stats = llm.stats
    assert stats.spec_ahead_steps > 0 and stats.spec_ahead_dropped == 0
    text = generate_latest(metrics.registry).decode()
    ahead = metric_values(text, "unikv:spec_decode_ahead_steps_total")
    dropped = metric_values(text, "unikv:spec_decode_ahead_dropped_total")
    assert list(ahead.values()) == [stats.spec_ahead_steps] and list(dropped.values()) == [0]
    assert_pages_returned(llm)


def planted(p: float):
    """A greedy acceptance that keeps each draft with probability ``p`` (a hash of
    the draft, its position and a step counter on the device), whatever the target
    says; the first rejection (or the bonus) emits the target's argmax."""
    count = torch.zeros((), dtype=torch.int64)

    def accept(logits, drafts, num_drafts, force=False):
        count.add_(1)
        pos = torch.arange(drafts.shape[1])[None, :]
        mix = (drafts * 1103515245 + pos * 12345 + count * 2654435761) & 0x7FFFFFFF
        kept = (mix >> 8) % 1000 < int(p * 1000)
        return _emit(logits.argmax(dim=-1), drafts, num_drafts, kept)

    return accept


@torch.no_grad()
def check_bonus(hf, prompt: list[int], out: list[int], bonus: list[int]) -> None:
    """Output ``i`` of each verify step's last token (``bonus``) is the target's
    greedy token after every token before it."""
    greedy = hf(torch.tensor([prompt + out])).logits[0].argmax(-1).tolist()
    for i in bonus:
        assert out[i] == greedy[len(prompt) + i - 1], (i, bonus)


@pytest.mark.parametrize("p", [0.3, 0.6, 1.0])
def test_no_step_thrown_away_at_any_acceptance(model, p, monkeypatch):
    """One request, k = 3, acceptance planted at p: after its first verify step
    every step is planned ahead and kept (0 thrown away per 100 tokens) although
    the bet on full acceptance would have lost a share near 1 - p^3 of them; each
    step's last token is the target's (the moved rows were right)."""
    path, hf = model
    monkeypatch.setattr(spec_step, "greedy_accept", planted(p))
    seen, bonus = partial_spy(monkeypatch), []  # bonus: output index of each step's last
    complete = Scheduler.complete_verify

    def spy(sched, batch, tokens, ahead=None):
        bonus.append(len(batch.requests[0].output_ids) + len(tokens[0]) - 1)
        return complete(sched, batch, tokens, ahead)

    monkeypatch.setattr(Scheduler, "complete_verify", spy)
    item, new = prompts()[0], 40
    llm = make_llm(path, 4, 3)
    out = llm.generate([item], SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    got = out[0].output_ids
    stats = llm.stats
    assert len(got) == new and stats.spec_ahead_steps >= len(bonus) - 3
    assert 100 * stats.spec_ahead_dropped / new == 0
    rate = stats.spec_accepted_tokens / stats.spec_draft_tokens
    assert abs(rate - p) < 0.25, rate
    bet_lost = seen["partial"]  # what the bet would have thrown away
    assert bet_lost > 0.3 * seen["ahead"] if p < 1 else bet_lost == 0, seen
    check_bonus(hf, item, got, [i for i in bonus if i < new])
    assert_pages_returned(llm)


def test_no_host_read_while_planning_ahead(model, monkeypatch):
    """While a step is planned and launched ahead (``verify_ahead`` and its launch)
    nothing reads a tensor's values on the host (``.item``, ``.tolist``, ``.numpy``,
    ``bool``/``int``, ``synchronize``): the derivation runs on the device; the one
    read per step is the step in flight's tokens, after the next one is enqueued.
    (The CPU stand-ins of device kernels, ``unikv/kernels/*/ref.py``, run on the
    host by design and are not counted: on CUDA they are Triton launches.)"""
    from unikv.engine import online
    from unikv.engine.runner import ModelRunner as Runner

    path, _ = model
    llm = make_llm(path, 4, 3, debug=False)
    reads, inside = [], [False]

    def count(name, fn):
        def spy(*args, **kw):
            caller = sys._getframe(1).f_code.co_filename
            if inside[0] and f"unikv{os.sep}kernels{os.sep}" not in caller:
                reads.append(f"{name} in {caller}")
            return fn(*args, **kw)

        return spy

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, count(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", count("synchronize", torch.cuda.synchronize))
    launched = []

    def bracket(fn, ahead_only):
        def run(*args, **kw):
            batch = args[1]
            on = not ahead_only or batch.derive is not None
            inside[0] = on
            try:
                return fn(*args, **kw)
            finally:
                inside[0] = False
                launched.append(on) if ahead_only else None

        return run

    monkeypatch.setattr(online, "verify_ahead", bracket(online.verify_ahead, False))
    monkeypatch.setattr(Runner, "_launch_verify", bracket(Runner._launch_verify, True))
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(), params)
    assert sum(launched) > 5 and reads == [], reads
    assert_pages_returned(llm)


def test_derivation_against_a_naive_rebuild():
    """``Derivation``'s arrays, for ragged drafts and every acceptance: the
    positions move by a - n, each row's virtual id is the one of its position
    (N's rows then N + 1's, built by hand), the sources are the bonus then the
    candidate row a of each request."""
    from types import SimpleNamespace

    from unikv.engine.speculative.derive import Derivation

    counts = np.array([2, 0, 3], np.int64)
    rooms = [3, 1, 2]
    cands = [np.arange(100 * b, 100 * b + (n + 1) * m).reshape(n + 1, m)
             for b, (n, m) in enumerate(zip(counts.tolist(), rooms))]  # fmt: skip
    start = [10, 4, 7]  # L_b
    ids_n = [1000 + 10 * b + i for b, n in enumerate(counts.tolist()) for i in range(n + 1)]
    ids_a = [2000 + 10 * b + i for b, m in enumerate(rooms) for i in range(m + 1)]
    vid = {}  # (b, position) -> virtual id, by hand
    for b, n in enumerate(counts.tolist()):
        for i in range(n + 1):
            vid[b, start[b] + i] = 1000 + 10 * b + i
        for i in range(rooms[b] + 1):
            vid[b, start[b] + n + 1 + i] = 2000 + 10 * b + i

    class Alloc:
        def translate(self, vids, name, out):
            out[: len(vids)] = vids.data * 3
            return out

    for accepted in ([0, 0, 0], [2, 0, 1], [1, 0, 3]):
        d = Derivation(counts, cands)
        d.upload(torch.device("cpu"), False)
        acc = torch.tensor(accepted)
        bonus = torch.tensor([7, 8, 9])
        src = d.sources(acc, bonus).tolist()
        want_src = [7, 8, 9] + [t for b in range(3) for t in cands[b][accepted[b]].tolist()]
        assert src == want_src
        for b in range(3):  # the placeholders index those sources
            pend, drafts = d.placeholders(b)
            assert src[-1 - pend] == [7, 8, 9][b]
            assert [src[-1 - x] for x in drafts] == cands[b][accepted[b]].tolist()
        full = [start[b] + counts[b] + 1 + j for b in range(3) for j in range(rooms[b] + 1)]
        write = torch.zeros(len(full), dtype=torch.int64)
        plan = SimpleNamespace(
            positions=torch.tensor(full + [0, 0]),
            seq_lens=torch.tensor(
                [start[b] + counts[b] + rooms[b] + 2 for b in range(3)] + [1], dtype=torch.int32
            ),
            subpools={"full": SimpleNamespace(write_ids=SimpleNamespace(data=write))},
        )
        out = d.fix(plan, acc, torch.tensor(ids_n + ids_a), Alloc()).tolist()
        true = [(b, start[b] + accepted[b] + 1 + j) for b in range(3) for j in range(rooms[b] + 1)]
        assert plan.positions.tolist() == [pos for _, pos in true] + [0, 0]
        assert plan.seq_lens.tolist() == [
            start[b] + accepted[b] + rooms[b] + 2 for b in range(3)
        ] + [1]
        assert out == [vid[key] for key in true]
        assert write.tolist() == [3 * vid[key] for key in true]


def test_sampled_steps_planned_ahead_equal_the_same_drafts_unpipelined(model, monkeypatch):
    """temperature 0.8, top-k 20, seeded: rejection sampling's randomness is a function
    of (seed, output step), so an unpipelined engine handed the very drafts each step
    of the pipelined run verified (a replay of its proposals) emits the same tokens,
    which holds only if every step planned ahead counted its output steps from the
    acceptance of the step before (``Derivation.delta``); steps were planned ahead
    after partial acceptances and none thrown away."""
    from unikv.engine.speculative.engine import Speculator

    path, _ = model
    items = prompts()
    params = SamplingParams(max_tokens=NEW, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    verified = {}  # (prompt, outputs before the step) -> the drafts it verified
    seen = partial_spy(monkeypatch)
    complete = Scheduler.complete_verify

    def record(sched, batch, emitted, ahead=None):
        for r, d in zip(batch.requests, batch.drafts):
            verified[tuple(r.prompt_ids), len(r.output_ids)] = d.tolist()
        return complete(sched, batch, emitted, ahead)

    with monkeypatch.context() as m:
        m.setattr(Scheduler, "complete_verify", record)
        llm = make_llm(path, 4, 3)
        got = [o.output_ids for o in llm.generate(items, params)]
    assert llm.stats.spec_ahead_steps > 0 and llm.stats.spec_ahead_dropped == 0
    assert seen["partial"] > 0, seen

    def replay(self, r, room):
        return np.asarray(verified.get((tuple(r.prompt_ids), len(r.output_ids)), [])[:room])

    monkeypatch.setattr(Speculator, "_propose", replay)
    plain = make_llm(path, 4, 3, pipeline=False)
    assert [o.output_ids for o in plain.generate(items, params)] == got
    assert plain.stats.spec_verify_steps == llm.stats.spec_verify_steps
    assert_pages_returned(llm)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_recurrent_targets_select_their_state_on_the_device(family, tmp_path, monkeypatch):
    """Qwen3.5 (Gated DeltaNet) and NemotronH (Mamba-2), k = 3, page size 4: a step
    planned ahead starts from the state slot of the step before's acceptance, chosen
    on the device (``derive.select_states``: the exchange ``MambaSlots.select`` makes
    on the host one step later). Real n-gram drafts for three requests, then six in
    a pool that preempts by swap: tokens equal transformers'; acceptance planted at
    0.5 for one request: every step's last token
    is the target's (fails with the selection removed), none thrown away. With
    prefix caching on (state checkpoints read the state after step N) a hybrid's
    steps are not planned ahead."""
    from engine_fixtures import save_tiny_hybrid, save_tiny_nemotron_h

    path = str(tmp_path)
    hf = save_tiny_hybrid(family, path) if family == "qwen3_5" else (
        save_tiny_nemotron_h(path, "M*M-M*-"))  # fmt: skip
    items = prompts()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, 4, 3)
    assert [o.output_ids for o in llm.generate(items, params)] == [
        hf_greedy(hf, p, 16) for p in items
    ]
    assert llm.stats.spec_ahead_steps > 0 and llm.stats.spec_ahead_dropped == 0
    assert_pages_returned(llm)
    from test_spec_recurrent import TIGHT_LEN, tight_pool

    swapped = make_llm(path, 4, 3, kv_cache_bytes=tight_pool(path, 4, 3), max_model_len=TIGHT_LEN,
                       swap_host_bytes=1 << 22, preemption="swap")  # fmt: skip
    short = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    out = swapped.generate(items + items[::-1], short)
    assert [o.output_ids for o in out] == [hf_greedy(hf, p, 14) for p in items + items[::-1]]
    assert swapped.stats.swapped_out > 0 and swapped.stats.spec_ahead_steps > 0
    assert_pages_returned(swapped)
    cached = make_llm(path, 4, 3, enable_prefix_caching=True)
    cached.generate(items, params)
    assert cached.stats.spec_verify_steps > 0 and cached.stats.spec_ahead_steps == 0
    monkeypatch.setattr(spec_step, "greedy_accept", planted(0.5))
    seen, bonus = partial_spy(monkeypatch), []
    complete = Scheduler.complete_verify

    def spy(sched, batch, tokens, ahead=None):
        bonus.append(len(batch.requests[0].output_ids) + len(tokens[0]) - 1)
        return complete(sched, batch, tokens, ahead)

    monkeypatch.setattr(Scheduler, "complete_verify", spy)
    llm = make_llm(path, 4, 3)
    got = llm.generate([items[0]], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert llm.stats.spec_ahead_steps > 5 and llm.stats.spec_ahead_dropped == 0
    assert seen["partial"] > 0, seen
    check_bonus(hf, items[0], got[0].output_ids, [i for i in bonus if i < 32])
    assert_pages_returned(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("ps", [1, 16])
def test_pipelined_derivation_on_gpu(model, ps, monkeypatch):
    """On CUDA (verify graphs, pinned readbacks, fp32), real n-gram drafts: tokens
    equal the same engine's without pipelining and transformers', steps are planned
    ahead and none thrown away, and every step planned ahead is planned and launched
    under ``torch.cuda.set_sync_debug_mode("error")`` (no host sync)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from unikv.engine import online
    from unikv.engine.runner import ModelRunner

    path, hf = model
    kw = {"device": "cuda", "debug": False, "max_num_seqs": 8, "kv_cache_bytes": 64 << 20}
    items = prompts()
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    want = [
        o.output_ids for o in make_llm(path, ps, 3, pipeline=False, **kw).generate(items, params)
    ]
    assert want == [hf_greedy(hf, p, NEW) for p in items]
    guarded = []

    def strict(fn, ahead_only):
        def run(*args, **kw):
            if ahead_only and args[1].derive is None:
                return fn(*args, **kw)
            guarded.append(fn.__name__)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        return run

    monkeypatch.setattr(online, "verify_ahead", strict(online.verify_ahead, False))
    monkeypatch.setattr(ModelRunner, "_launch_verify", strict(ModelRunner._launch_verify, True))
    llm = make_llm(path, ps, 3, **kw)
    assert llm.runner.verify_graphs is not None
    assert [o.output_ids for o in llm.generate(items, params)] == want
    assert llm.stats.spec_ahead_steps > 0 and llm.stats.spec_ahead_dropped == 0
    assert "_launch_verify" in guarded


def test_lookups_of_several_prefixes_equal_one_at_a_time():
    """``propose_ngram_ends`` (the candidates' lookups at once) against
    ``propose_ngram`` on each prefix, over random short histories of few symbols
    (many repeats) and every n-gram range and draft length."""
    from unikv.engine.speculative.ngram import propose_ngram, propose_ngram_ends

    rng = np.random.default_rng(0)
    for _ in range(500):
        size = int(rng.integers(1, 30))
        history = rng.integers(0, int(rng.integers(1, 5)), size).astype(np.int64)
        ends = sorted({int(e) for e in rng.integers(1, size + 1, int(rng.integers(1, 5)))})
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 3))
        hi = lo + int(rng.integers(0, 3))
        got = propose_ngram_ends(history, ends, k, lo, hi)
        for e, found in zip(ends, got):
            assert np.array_equal(found, propose_ngram(history[:e], k, lo, hi)), (history, e)


@pytest.mark.gpu
def test_recurrent_pipelined_on_gpu(tmp_path):
    """Qwen3.5 on CUDA (verify graphs, the Triton recurrent kernels with their draft
    slots, fp32): with real n-gram drafts the pipelined tokens equal transformers';
    under forced acceptance, pipelined or not, every verify step's last token is the
    target's greedy token after every token before it, and no step planned ahead is
    thrown away."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from engine_fixtures import save_tiny_hybrid
    from gpu_fixtures import torch_reference_kernels

    from unikv.engine.speculative.config import allow_forced_acceptance

    path = str(tmp_path)
    hf = save_tiny_hybrid("qwen3_5", path)
    torch_reference_kernels(hf)  # the oracle is transformers' torch path, not fla's
    kw = {"device": "cuda", "debug": False, "max_num_seqs": 8, "kv_cache_bytes": 64 << 20}
    items = prompts()
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    llm = make_llm(path, 16, 3, **kw)
    assert llm.runner.verify_graphs is not None
    assert [o.output_ids for o in llm.generate(items, params)] == [
        hf_greedy(hf, p, NEW) for p in items
    ]
    assert llm.stats.spec_ahead_steps > 0 and llm.stats.spec_ahead_dropped == 0
    # forced acceptance keeps whatever was drafted, and a step planned ahead drafts
    # before the step it follows has its bonus token, so the two runs' drafts (and so
    # their tokens) differ; what must hold in both is that every verify step's last
    # token is the target's greedy token after every token before it
    spec = {"method": "ngram", "num_speculative_tokens": 3, "force_accept": True}
    complete = Scheduler.complete_verify
    for pipeline in (False, True):
        emitted: dict[tuple[int, ...], list[int]] = {}

        def spy(sched, batch, out, ahead=None, emitted=emitted):
            for r, tokens in zip(batch.requests, out):
                emitted.setdefault(tuple(r.prompt_ids), []).append(len(tokens))
            return complete(sched, batch, out, ahead)

        with allow_forced_acceptance():
            forced = LLM(path, dtype=torch.float32, page_size=16,
                         speculative_config={**spec, "pipeline": pipeline}, **kw)  # fmt: skip
        with pytest.MonkeyPatch.context() as m:
            m.setattr(Scheduler, "complete_verify", spy)
            outs = [o.output_ids for o in forced.generate(items, params)]
        for p, out in zip(items, outs):
            with torch.no_grad():
                greedy = hf(torch.tensor([p + out])).logits[0].argmax(-1).tolist()
            at, checked = 0, 0  # output 0 is the prefill's
            for n in emitted[tuple(p)]:
                at += n
                if at < len(out):
                    assert out[at] == greedy[len(p) + at - 1], (pipeline, at, out)
                    checked += 1
            assert checked >= NEW // 8, (pipeline, emitted[tuple(p)])
    assert forced.stats.spec_ahead_steps > 0 and forced.stats.spec_ahead_dropped == 0
