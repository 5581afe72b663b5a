"""vLLM's sampling knobs: penalties, min_p, min_tokens, logprobs, n, stop strings
and the parameter checks.

Oracles: transformers' ``generate`` on the same weights (repetition penalty,
min_new_tokens), transformers' logits (logprobs), per-row loops written from
vLLM's definitions (frequency / presence penalties, min_p), and the unstopped
text of the same greedy run (stop strings).
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_fixtures import assert_pages_returned, one_thread  # noqa: F401  (a fixture)
from serving_fixtures import save_instruct_llama

from unikv.engine import LLM, SamplingParams
from unikv.engine.logits import apply_penalties
from unikv.engine.request import Request
from unikv.engine.sampling import _allowed

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "Hello, how are you today?"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("instruct"))
    hf = save_instruct_llama(path)
    return path, hf, LLM(path, device="cpu", page_size=4, max_model_len=128)


def _hf_generate(hf, ids: list[int], max_new_tokens: int, **kw) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, **kw)
    return out[0, len(ids) :].tolist()


def test_repetition_penalty_and_min_tokens_match_transformers(ckpt):
    _path, hf, llm = ckpt
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=24, repetition_penalty=1.7, temperature=0.0)
    out = llm.generate(PROMPT, params)[0]
    assert out.output_ids == _hf_generate(hf, ids, 24, repetition_penalty=1.7)
    assert (
        out.output_ids
        != llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0))[0].output_ids
    )
    # min_tokens masks the EOS until then: transformers' min_new_tokens
    free = llm.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))[
        0
    ].output_ids
    eos = free[2]
    llm.eos_token_ids = (eos,)  # (a local EOS the greedy run meets at step 3)
    try:
        early = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0))[0]
        late = llm.generate(PROMPT, SamplingParams(max_tokens=24, min_tokens=9, temperature=0.0))[0]
    finally:
        llm.eos_token_ids = (2,)
    assert early.output_ids == free[:3] and early.finish_reason == "stop"
    want = _hf_generate(hf, ids, 24, min_new_tokens=9, eos_token_id=eos)
    assert late.output_ids == want and len(want) >= 9


def _request(prompt, outputs, params):
    r = Request(0, list(prompt), params, 0, frozenset(), 1000)
    r.output_ids = list(outputs)
    return r


def test_frequency_and_presence_penalties_follow_vllms_definition():
    vocab = 11
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 3
    reqs = [
        _request(
            [1, 2],
            [3, 3, 5],
            SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, temperature=0.0),
        ),
        _request([4], [4, 7, 7, 7], SamplingParams(repetition_penalty=1.5, temperature=0.0)),
        _request([9], [8], SamplingParams(temperature=0.0)),  # no penalty: untouched
    ]
    got = logits.clone()
    apply_penalties(got, reqs, None, pin=False)
    want = logits.clone()
    for row, r in enumerate(reqs):
        p = r.params
        for tok in range(vocab):
            count = r.output_ids.count(tok)
            x = want[row, tok].item()
            if tok in r.prompt_ids or count:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            want[row, tok] = x
    torch.testing.assert_close(got, want)


def test_placeholder_outputs_are_read_from_the_previous_step():
    """A penalised request whose newest token is still on the device (-(1 + lane))."""
    logits = torch.zeros(1, 6)
    prev = torch.tensor([4, 2])  # lane 1 sampled token 2
    r = _request([0], [5, -2], SamplingParams(presence_penalty=1.0, temperature=0.0))
    apply_penalties(logits, [r], prev, pin=False)
    assert logits[0].tolist() == [0, 0, -1, 0, 0, -1]


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_one():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.05, 0.03]]))
    for min_p in (0.0, 0.1, 0.25, 0.7, 1.0):
        keep = _allowed(
            logits, torch.zeros(1, dtype=torch.int64), torch.ones(1), torch.tensor([min_p])
        )
        probs = logits.exp()[0].tolist()
        assert keep[0].tolist() == [p >= min_p * max(probs) - 1e-7 for p in probs]


def test_logprobs_are_the_models_raw_log_softmax(ckpt):
    _path, hf, llm = ckpt
    params = SamplingParams(max_tokens=6, logprobs=3, temperature=0.8, seed=5)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        full = hf(torch.tensor([ids + out.token_ids])).logits[0].log_softmax(-1)
    assert len(out.logprobs) == len(out.token_ids)
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = full[len(ids) - 1 + j]
        assert math.isclose(entry[tok].logprob, row[tok].item(), abs_tol=1e-4)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(3)
        for value, i in zip(top.values.tolist(), top.indices.tolist()):
            assert math.isclose(entry[i].logprob, value, abs_tol=1e-4)


def test_n_completions_share_the_prompt_with_reproducible_seeds(ckpt):
    _, _, llm = ckpt
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    one, two = llm.generate([PROMPT], params)[0], llm.generate([PROMPT], params)[0]
    assert [c.index for c in one.outputs] == [0, 1, 2]
    assert [c.token_ids for c in one.outputs] == [c.token_ids for c in two.outputs]
    assert len({tuple(c.token_ids) for c in one.outputs}) == 3
    solo = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=7))[0]
    assert solo.output_ids[:3] == one.outputs[0].token_ids[:3]  # completion 0 keeps the seed
    assert one.output_ids == one.outputs[0].token_ids and one.text == one.outputs[0].text


def test_stop_strings_cut_the_text_before_them(ckpt):
    _, _, llm = ckpt
    free = llm.generate(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0))[0]
    text = free.text
    stop = text[7:9]  # two characters from the middle of the greedy text
    cut = text.find(stop)
    out = llm.generate(
        PROMPT, SamplingParams(max_tokens=30, ignore_eos=True, stop=stop, temperature=0.0)
    )[0]
    c = out.outputs[0]
    assert c.text == text[:cut] and c.finish_reason == "stop" and c.stop_reason == stop
    # the tokens end at the one that completed the stop string
    tok = llm.tokenizer
    n = len(c.token_ids)
    assert c.token_ids == free.output_ids[:n]
    assert stop in tok.decode(free.output_ids[:n]) and stop not in tok.decode(
        free.output_ids[: n - 1]
    )
    kept = llm.generate(
        PROMPT,
        SamplingParams(
            max_tokens=30,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
            temperature=0.0,
        ),
    )[0]
    assert kept.text == text[: cut + len(stop)]
    assert_pages_returned(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_tokens": 2.0}, "max_tokens"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_max_tokens_none_runs_to_the_context_end(ckpt):
    _, _, llm = ckpt
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0))[0]
    assert len(out.output_ids) == llm.max_model_len - len(ids) and out.finish_reason == "length"
