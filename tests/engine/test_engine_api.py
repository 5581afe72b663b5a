"""The engine's API, sampling, stop rules, sliding-window page recycling, bad
input and the CLI, on tiny random-init models (CPU, fp32).

Oracles: transformers' greedy tokens; the same request run alone (batch
independence of seeded sampling); the window arithmetic written out here
(pages a request may hold); the checkpoint's own tokenizer.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from engine_fixtures import (
    VOCAB,
    assert_pages_returned,
    hf_greedy,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_model,
)

from unikv.engine import LLM, SamplingParams
from unikv.hf_config import specs_from_hf_config
from unikv.pool import pool_bytes_for

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    return path, save_tiny_model("llama", path)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    return path, save_tiny_model("gpt_oss", path)


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _tight_budget(path, pages):
    configs = specs_from_hf_config(path, page_size=4, dtype=torch.float32)
    return pool_bytes_for(configs, {c.name: pages for c in configs})


def test_seeded_sampling_does_not_depend_on_batch_or_preemption(llama):
    path, _ = llama
    prompts = _prompts([5, 21, 38, 12])
    params = [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=24, seed=100 + i)
        for i in range(len(prompts))
    ]
    roomy = LLM(path, device="cpu", page_size=4, max_model_len=80, max_num_seqs=4)
    batched = [o.output_ids for o in roomy.generate(prompts, params)]
    alone = [roomy.generate([p], [sp])[0].output_ids for p, sp in zip(prompts, params)]
    tight = LLM(
        path,
        device="cpu",
        page_size=4,
        max_model_len=80,
        max_num_seqs=4,
        kv_cache_bytes=_tight_budget(path, 24),
        max_num_batched_tokens=8,
    )
    squeezed = [o.output_ids for o in tight.generate(prompts, params)]
    assert tight.stats.preemptions > 0
    assert batched == alone == squeezed
    assert len({tuple(o) for o in batched}) == len(batched)
    greedy = roomy.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert [o.output_ids for o in greedy] != batched  # sampling did sample


def test_top_k_one_samples_greedily(llama):
    path, hf = llama
    prompt = _prompts([9])[0]
    llm = LLM(path, device="cpu", page_size=4, max_model_len=64)
    out = llm.generate(prompt, SamplingParams(temperature=1.5, top_k=1, max_tokens=16))
    assert out[0].output_ids == hf_greedy(hf, prompt, 16)


def test_stop_tokens_max_tokens_and_context_end(llama):
    path, hf = llama
    prompt = _prompts([10])[0]
    ref = hf_greedy(hf, prompt, 20)
    stop = ref[6]
    cut = ref.index(stop) + 1
    llm = LLM(path, device="cpu", page_size=4, max_model_len=64)
    out = llm.generate(
        prompt, SamplingParams(max_tokens=20, stop_token_ids=(stop,), temperature=0.0)
    )[0]
    assert out.output_ids == ref[:cut] and out.finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(max_tokens=7, temperature=0.0))[0]
    assert out.output_ids == ref[:7] and out.finish_reason == "length"
    short = LLM(path, device="cpu", page_size=4, max_model_len=16)
    out = short.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert out.output_ids == ref[:6] and out.finish_reason == "length"  # 10 + 6 = 16


def test_eos_from_config_stops_unless_ignored(tmp_path, llama):
    _, hf = llama
    prompt = _prompts([10])[0]
    ref = hf_greedy(hf, prompt, 20)
    hf.config.eos_token_id = ref[4]
    hf.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", page_size=4, max_model_len=64)
    assert (
        llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0))[0].output_ids
        == ref[: ref.index(ref[4]) + 1]
    )
    free = llm.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0))[0]
    assert free.output_ids == ref


def test_window_pages_leave_the_pool(gpt_oss):
    """gpt-oss (window 6, page 4): at every step each running request holds all
    its full-attention pages but only the SWA pages its next query can see."""
    path, hf = gpt_oss
    prompts = _prompts([40, 9, 27])
    llm = LLM(
        path,
        device="cpu",
        page_size=4,
        max_model_len=128,
        max_num_batched_tokens=5,
        enable_prefix_caching=False,
    )  # the cache keeps cached prefixes' window pages
    window, ps, chunk = 6, 4, 5
    seen = []

    def check(llm, batch, logits):
        for r in llm.scheduler.running:
            held = {n: len(cols) for n, (cols, _) in llm.alloc.request_pages(r.slot).items()}
            assert held["full"] == -(-r.num_cached // ps)
            # the next step writes up to `chunk` tokens and its first query sees
            # `window` keys back: pages overlapping [num_cached - window + 1, end)
            assert held["swa"] <= -(-(window - 1) // ps) + 1, (held, r.num_cached)
            seen.append(held["swa"] < held["full"])

    outputs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0), on_step=check)
    assert any(seen)  # pages did leave the window (not vacuous)
    assert [o.output_ids for o in outputs] == [hf_greedy(hf, p, 32) for p in prompts]
    assert chunk == llm.scheduler.max_num_batched_tokens


def test_text_prompts_use_the_checkpoint_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf = save_tiny_model("llama", str(tmp_path))
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", page_size=4, max_model_len=64)
    out = llm.generate("w5 w17 w200 w3", SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.prompt_ids == [5, 17, 200, 3]
    assert out.output_ids == hf_greedy(hf, [5, 17, 200, 3], 8)
    assert out.text.split() == [f"w{t}" for t in out.output_ids]


def test_bad_input_raises_and_leaves_the_engine_usable(llama, tmp_path):
    path, _ = llama
    llm = LLM(path, device="cpu", page_size=4, max_model_len=32)
    good = _prompts([5])[0]
    with pytest.raises(ValueError, match="too long"):
        llm.generate([good, list(range(32))], SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([good + [VOCAB]], SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(ValueError, match=r"in \[0, .*got \[-1\]"):
        llm.generate([[-1] + good], SamplingParams(max_tokens=4, temperature=0.0))
    for odd in (True, 2.0, None):  # a bool, a float, not an int: not token ids
        with pytest.raises(TypeError, match="list of int token ids"):
            llm.generate([good, [*good, odd]], SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4, temperature=0.0))
    assert not llm.scheduler.has_work()
    assert len(llm.generate(good, SamplingParams(max_tokens=4, temperature=0.0))[0].output_ids) == 4
    with pytest.raises(ValueError, match="cannot run alone"):
        LLM(
            path, device="cpu", page_size=4, max_model_len=64, kv_cache_bytes=_tight_budget(path, 8)
        )
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"), device="cpu")
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    config["architectures"] = ["BertForMaskedLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(path, device="cpu", max_model_len=10**6)


def test_cli_generate_and_errors(llama, capsys):
    from unikv.cli import main

    path, hf = llama
    prompt = _prompts([7])[0]
    code = main(
        [
            "generate",
            "--model",
            path,
            "--token-ids",
            ",".join(map(str, prompt)),
            "--max-tokens",
            "6",
            "--page-size",
            "4",
            "--max-model-len",
            "64",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert str(hf_greedy(hf, prompt, 6)) in out
    assert "tokens/s" in out and "preemptions 0" in out and "full" in out
    assert main(["generate", "--model", path + "-missing", "--token-ids", "1,2"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_demo_runs_and_matches_transformers(capsys):
    from unikv.engine.cli import demo_main

    assert demo_main([]) == 0
    out = capsys.readouterr().out
    assert out.count("IDENTICAL") == 3 and "MISMATCH" not in out
    hybrid = out[out.index("== qwen3.5:") :]
    assert "sub-pools ['full', 'mamba']" in hybrid and "the sink is 1 slot" in hybrid
    frames = [line for line in hybrid.splitlines() if line.lstrip().startswith("step ")]
    slots = [int(re.search(r"mamba +(\d+) slots?", f).group(1)) for f in frames]
    pictures = [f[f.index("|") : f.rindex("|")] for f in frames]
    # one run of M or m per live slot: the picture shows the Mamba band slot by slot
    assert [len(re.findall(r"M+|m+", p)) for p in pictures] == slots
    assert max(slots) >= 3 and slots[-1] == 0  # the band grows, then gives its bytes back


def test_a_stop_seen_one_step_late_cuts_outputs_and_frees_pages(llama):
    """The engine plans step N+1 before step N's tokens reach the host, so a stop
    token is seen one step late, after its request was planned once more. Its
    outputs must still end at the stop, every page must come back, and the
    other requests of the batch must be untouched (compared with transformers)."""
    path, hf = llama
    prompts = _prompts([10, 17, 5])
    refs = [hf_greedy(hf, p, 20) for p in prompts]
    stop = refs[0][3]
    llm = LLM(path, device="cpu", page_size=4, max_model_len=64)
    params = [SamplingParams(max_tokens=20, stop_token_ids=(stop,), temperature=0.0)] + [
        SamplingParams(max_tokens=20, temperature=0.0)
    ] * 2
    outs = llm.generate(prompts, params)
    assert outs[0].output_ids == refs[0][: refs[0].index(stop) + 1]
    assert outs[0].finish_reason == "stop"
    assert [o.output_ids for o in outs[1:]] == refs[1:]
    assert all(t >= 0 for o in outs for t in o.output_ids)  # no placeholder leaks
    assert_pages_returned(llm)


def test_debug_mode_generates_the_same_tokens(gpt_oss):
    """In debug mode every block table goes through the allocator's tombstone
    check (a live lane reading a freed window page raises); a sliding-window model
    with chunked prefill must still run and match transformers."""
    path, hf = gpt_oss
    prompts = _prompts([40, 9, 27])
    llm = LLM(
        path, device="cpu", page_size=4, max_model_len=128, max_num_batched_tokens=5, debug=True
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    assert [o.output_ids for o in outputs] == [hf_greedy(hf, p, 16) for p in prompts]
