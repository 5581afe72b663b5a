"""lm-eval-harness (``local-completions``) against ``unikv serve`` on a tiny model:
one loglikelihood task (multiple choice) and one generate task, from local JSON
files (no download). Each score is compared with the same task computed here
in-process: ``LLM.generate``'s prompt logprobs (loglikelihood: the argmax of the
continuations' summed logprobs) and greedy texts (generate: exact match).
Skipped when lm-eval is not installed.
"""

from __future__ import annotations

import json
import os

import pytest
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import ServerProcess, save_instruct_llama

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
lm_eval = pytest.importorskip("lm_eval")
MAX_LEN = 128
QUESTIONS = [
    "The quick brown fox",
    "Hello, how are you",
    "unikv serves models over",
    "A stop string cuts",
    "Pages move, requests keep",
    "I am fine,",
]
CHOICES = ["jumps over", "today", "the text", "pages"]
MC_TASK = """task: unikv_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: unikv_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def _write(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def _loglikelihood(llm, tok, context: str, continuation: str) -> float:
    """lm-eval's split of (context, continuation) into tokens, scored in-process."""
    whole = tok.encode(context + continuation)
    ctx = tok.encode(context)
    out = llm.generate(whole, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    lps = out[0].prompt_logprobs
    return sum(lps[k][whole[k]].logprob for k in range(len(ctx), len(whole)))


def test_lm_eval_scores_equal_in_process(tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    path = str(tmp_path / "model")
    save_instruct_llama(path)
    llm = LLM(path, device="cpu", page_size=4, max_model_len=MAX_LEN)
    tok = llm.tokenizer
    # multiple choice: answers chosen so that the in-process accuracy is neither 0 nor 1
    mc, correct = [], 0
    for i, q in enumerate(QUESTIONS):
        scores = [_loglikelihood(llm, tok, q, " " + c) for c in CHOICES]
        best = max(range(len(CHOICES)), key=scores.__getitem__)
        answer = best if i % 2 == 0 else (best + 1) % len(CHOICES)
        correct += answer == best
        mc.append({"question": q, "choices": CHOICES, "answer": answer})
    # generate: half the answers are the model's own greedy text (cut at ".")
    gen, hits = [], 0
    for i, q in enumerate(QUESTIONS):
        text = llm.generate(
            tok.encode(q), SamplingParams(max_tokens=6, temperature=0.0, stop=["."])
        )[0].text
        answer = text if i % 2 == 0 else text + "x"
        hits += answer == text
        gen.append({"question": q, "answer": answer})
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _write(str(tmp_path / "mc.jsonl"), mc)
    _write(str(tmp_path / "gen.jsonl"), gen)
    (tasks / "mc.yaml").write_text(MC_TASK.format(path=tmp_path / "mc.jsonl"))
    (tasks / "gen.yaml").write_text(GEN_TASK.format(path=tmp_path / "gen.jsonl"))

    server = ServerProcess(path, "--max-model-len", str(MAX_LEN), "--served-model-name", "tiny")
    try:
        args = (
            f"model=tiny,base_url={server.url}/v1/completions,tokenizer={path},"
            f"tokenizer_backend=huggingface,max_length={MAX_LEN},max_retries=1,num_concurrent=1"
        )
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        results = simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=["unikv_tiny_mc", "unikv_tiny_gen"],
            task_manager=TaskManager(include_path=str(tasks)),
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
        )
    finally:
        server.stop()
    res = results["results"]
    assert res["unikv_tiny_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))
    assert res["unikv_tiny_gen"]["exact_match,none"] == pytest.approx(hits / len(QUESTIONS))
    assert 0 < correct < len(QUESTIONS) and 0 < hits < len(QUESTIONS)
