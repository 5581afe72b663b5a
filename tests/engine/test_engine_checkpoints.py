"""Real-checkpoint behaviour: EOS ids of generation_config.json, chat templates,
special tokens left out of the text, incremental detokenization, rope_scaling
of transformers 4.x configs, and the start-up / input errors of the review.

Oracles: transformers' ``generate`` (which applies generation_config.json) and
tokenizer (``decode(skip_special_tokens=True)``, ``apply_chat_template``) on
the same checkpoint; transformers' own rotary embedding for the rope tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from engine_fixtures import hf_greedy, one_thread  # noqa: F401  (a fixture)
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_fixtures import build_tokenizer, save_instruct_llama

from unikv.engine import LLM, SamplingParams
from unikv.engine.detokenize import IncrementalDetokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("instruct"))
    return path, save_instruct_llama(path)


def test_generation_config_eos_ids_stop_as_in_transformers(tmp_path, ckpt):
    _path, hf = ckpt
    tok = build_tokenizer()
    ids = tok.encode(PROMPT)
    free = hf_greedy(hf, ids, 20)
    extra = free[2]  # an EOS id only generation_config.json names
    assert extra not in free[:2] and extra != tok.eos_token_id
    model = save_instruct_llama(str(tmp_path), generation_eos=[tok.eos_token_id, extra])
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20)
    want = want[0, len(ids) :].tolist()
    assert want == free[:3]  # transformers stops after 3 tokens
    llm = LLM(str(tmp_path), device="cpu", page_size=4, max_model_len=128)
    assert extra in llm.eos_token_ids
    out = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert out.output_ids == want and out.finish_reason == "stop"
    free_out = llm.generate(
        PROMPT, SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
    )[0]
    assert free_out.output_ids == free


def test_chat_applies_the_tokenizer_template(ckpt):
    path, hf = ckpt
    llm = LLM(path, device="cpu", page_size=4, max_model_len=128)
    want_ids = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    want_ids = want_ids if isinstance(want_ids, list) else want_ids["input_ids"]
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))[0]
    assert out.prompt_ids == list(want_ids)
    assert out.output_ids == hf_greedy(hf, list(want_ids), 8)
    both = llm.chat([MESSAGES, MESSAGES[1:]], SamplingParams(max_tokens=3, temperature=0.0))
    assert both[0].prompt_ids == out.prompt_ids and len(both) == 2
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"content": "no role"}])


def test_special_tokens_are_left_out_of_the_text(tmp_path):
    """A model that emits special tokens (their lm_head rows copy a likely token's,
    scaled up): the ids keep them, the text is transformers' decode without them."""
    hf = save_instruct_llama(str(tmp_path))
    tok = build_tokenizer()
    ids = tok.encode(PROMPT)
    free = hf_greedy(hf, ids, 12)
    with torch.no_grad():
        hf.lm_head.weight[1] = hf.lm_head.weight[free[1]] * 3  # <|im_start|>
    hf.save_pretrained(str(tmp_path))
    want = hf_greedy(hf, ids, 12)
    assert 1 in want  # the special token is emitted now
    llm = LLM(str(tmp_path), device="cpu", page_size=4, max_model_len=128)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))[0]
    assert out.output_ids == want
    assert out.text == tok.decode(want, skip_special_tokens=True)
    assert "<|im_start|>" not in out.text
    raw = llm.generate(
        PROMPT,
        SamplingParams(max_tokens=12, ignore_eos=True, skip_special_tokens=False, temperature=0.0),
    )
    assert raw[0].text == tok.decode(want, skip_special_tokens=False)


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 319), min_size=1, max_size=8),
    outputs=st.lists(st.integers(0, 319), min_size=0, max_size=24),
    skip=st.booleans(),
)
def test_incremental_text_is_the_full_decode(prompt, outputs, skip):
    """Token by token (then a flush), the text is transformers' decode of all the
    outputs after the prompt's text, special tokens and split UTF-8 included."""
    tok = _TOKENIZER
    detok = IncrementalDetokenizer(tok, prompt, skip)
    pieces = [detok.update([t]) for t in outputs] + [detok.flush()]
    tail = prompt[-5:]
    head = tok.decode(tail, skip_special_tokens=skip)
    whole = tok.decode(tail + outputs, skip_special_tokens=skip)
    if whole.startswith(head) and not head.endswith("\ufffd"):
        assert "".join(pieces) == whole[len(head) :]
    assert "".join(pieces) == detok.text


_TOKENIZER = build_tokenizer()


def test_legacy_rope_scaling_is_read_from_config_json(tmp_path, monkeypatch):
    """Under transformers 4.x a config has ``rope_scaling`` and no
    ``rope_parameters``: the llama3 scaling must survive (rotary table equal to
    transformers' llama3 rope at position 1000)."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from unikv.models import loader
    from unikv.models.rope import Rotary

    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }  # fmt: skip
    save_instruct_llama(str(tmp_path), max_position_embeddings=2048)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.update(rope_scaling=scaling, rope_theta=50000.0)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    legacy = types.SimpleNamespace(**{k: v for k, v in raw.items() if k != "rope_scaling"})
    legacy.rope_scaling = None  # 4.x-like: the raw dict lives in config.json
    monkeypatch.setattr(tf.AutoConfig, "from_pretrained", lambda *a, **k: legacy)
    config, _ = loader.load_model_config(str(tmp_path))
    assert config.rope["rope_type"] == "llama3" and config.rope["rope_theta"] == 50000.0
    modern = tf.LlamaConfig(**{**raw, "rope_parameters": dict(scaling, rope_theta=50000.0)})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](modern, "cpu")
    head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    rotary = Rotary(config.rope, head_dim, 2048)
    cos_ref = torch.cos(1000.0 * inv_freq.float())  # (head_dim / 2,)
    torch.testing.assert_close(rotary.cos[1000], cos_ref, rtol=1e-5, atol=1e-5)
    default = Rotary({"rope_type": "default", "rope_theta": 50000.0}, head_dim, 2048)
    assert not torch.allclose(default.cos[1000], cos_ref, atol=1e-3)  # scaling matters here


def test_bad_start_up_options_are_refused(ckpt):
    path, _ = ckpt
    with pytest.raises(ValueError, match="bf16, fp16 or fp32.*kv_cache_dtype"):
        LLM(path, device="cpu", dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto'"):
        LLM(path, device="cpu", kv_cache_dtype="bf16")  # fp32 model: neither its dtype nor fp8
    with pytest.raises(ValueError, match="kv_cache_bytes must be None .* or an int > 0, got 0"):
        LLM(path, device="cpu", kv_cache_bytes=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use device 'cpu'"):
            LLM(path, device="cuda")
    with pytest.raises(ValueError, match="once"):
        LLM(path, model=path)
    assert LLM(model=path, device="cpu", max_model_len=32).max_model_len == 32


def test_bad_prompts_get_clear_errors(ckpt):
    path, _ = ckpt
    llm = LLM(path, device="cpu", page_size=4, max_model_len=64)
    with pytest.raises(TypeError, match="prompts must be a str, a list of int token ids"):
        llm.generate(5)
    with pytest.raises(TypeError, match="a prompt is a str or a list of int token ids"):
        llm.generate([PROMPT, 3.5])
    with pytest.raises(ValueError, match="stop_token_ids must hold int token ids"):
        llm.generate(PROMPT, SamplingParams(stop_token_ids=["a"], temperature=0.0))
    assert (
        len(llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0))[0].output_ids) <= 2
    )


def test_a_truncated_weights_file_is_named(ckpt, tmp_path):
    path, _ = ckpt
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        if name == "model.safetensors":
            data = data[: len(data) // 2]
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match="model.safetensors.*truncated or corrupt"):
        LLM(str(tmp_path), device="cpu")


def _cli(*args: str, stdin=None, env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", "import sys; from unikv.cli import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_cli_errors_are_one_line_not_tracebacks(ckpt, tmp_path):
    path, _ = ckpt
    if not torch.cuda.is_available():
        run = _cli("generate", "--model", path, "--prompt", "hi", "--device", "cuda")
        assert run.returncode == 2 and "Traceback" not in run.stderr
        assert "use device 'cpu'" in run.stderr
    run = _cli("generate", "--model", path, "--prompt", "hi", "--dtype", "fp8")
    assert run.returncode == 2 and "Traceback" not in run.stderr and "bf16" in run.stderr
    # a missing extra: transformers hidden from import
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "transformers.py").write_text("raise ModuleNotFoundError(name='transformers')\n")
    pythonpath = os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])
    run = _cli("generate", "--model", path, "--prompt", "hi", env={"PYTHONPATH": pythonpath})
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "pip install 'unikv[models]'" in run.stderr
    # a closed pipe (`unikv inspect ... | head`): the reader is gone before the first write
    inspect = [sys.executable, "-c", "import sys; from unikv.cli import main; sys.exit(main())"]
    shell = subprocess.run(
        " ".join([*map(_quote, inspect), "inspect", "llama-3.2-1b", "|", "true"]),
        shell=True,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in shell.stderr and "BrokenPipe" not in shell.stderr


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def test_cli_generate_chat_and_stop(ckpt, capsys):
    from unikv.cli import main

    path, _ = ckpt
    llm = LLM(path, device="cpu", page_size=4, max_model_len=64)
    want = llm.chat(
        [{"role": "user", "content": "Hello!"}], SamplingParams(max_tokens=6, temperature=0.0)
    )[0]
    argv = ["generate", "--model", path, "--prompt", "Hello!", "--chat", "--max-tokens", "6"]
    assert main(argv + ["--page-size", "4", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert repr(want.text) in out and f"({len(want.prompt_ids)} prompt tokens" in out
    assert main(argv + ["-n", "2", "--temperature", "1", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "[0.0]" in out and "[0.1]" in out
