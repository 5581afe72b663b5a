"""Models whose cache rows are not a multiple of 16 bytes (issue 38, item 6): the
cases of ``tests/kernels/test_odd_widths.py`` (CPU) and ``tests/kernels/test_odd_widths_gpu.py``.

A case is a tiny transformers checkpoint with one odd width:

- ``mla26`` / ``mla30``: DeepSeek-V3 latent rows ``kv_lora_rank + qk_rope_head_dim``
  of 26 (20 + 6) and 30 (24 + 6) elements: 104 / 120 bytes in fp32, 52 / 60 in bf16;
- ``mha6`` / ``mha40``: Llama with head_dim 6 and 40 (24 / 160 bytes in fp32).

Run as a script (``python tests/odd_width_cases.py CASE --page-size 1 4 16 --dtype fp32
bf16``) it builds the case, runs ``unikv.LLM`` greedily (CUDA graphs on a GPU) at each
page size and dtype and prints one ``RESULT`` JSON line each, with the engine's tokens
and transformers' (eager attention, same weights): the GPU tests run one case per
subprocess, so a crashed CUDA context fails that case's lines, not the session.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from engine_fixtures import save_tiny_deepseek, save_tiny_model

CASES = {
    "mla26": ("deepseek", {"kv_lora_rank": 20, "qk_rope_head_dim": 6}),
    "mla30": ("deepseek", {"kv_lora_rank": 24, "qk_rope_head_dim": 6}),
    "mha6": ("llama", {"head_dim": 6}),
    "mha40": ("llama", {"head_dim": 40}),
}
PROMPT_LENS = (3, 9, 21, 40)
NEW_TOKENS = 12
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def save_case(name: str, path: str):
    """The case's random-init checkpoint saved at ``path``; returns transformers' fp32
    model (eager attention)."""
    family, overrides = CASES[name]
    if family == "deepseek":
        return save_tiny_deepseek(3, path, **overrides)
    return save_tiny_model("llama", path, **overrides)


def prompts(seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_tokens(path: str, device: str, dtype: torch.dtype) -> list[list[int]]:
    """transformers' greedy tokens of ``prompts()`` (eager attention)."""
    import transformers as tf

    from unikv.engine.demo import hf_greedy

    with open(f"{path}/config.json") as f:
        deepseek = "deepseek" in f.read()
    kw = {"experts_implementation": "eager"} if deepseek else {}
    model = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", **kw
    )
    model = model.to(device).eval()
    return [hf_greedy(model, p, NEW_TOKENS) for p in prompts()]


def engine_tokens(path: str, **kw) -> tuple[list[list[int]], dict]:
    """``unikv.LLM``'s greedy tokens of ``prompts()`` (kw: LLM's arguments) and what ran:
    ``graphs`` (CUDA graphs captured), ``torch_ops`` (ops ``kernels/runtime/widths.py`` moved to
    the torch references for these widths)."""
    import gc

    from unikv.engine import LLM, SamplingParams
    from unikv.kernels import get_backend

    kw = {"max_num_seqs": 4, "max_model_len": 96, "max_num_batched_tokens": 32, **kw}
    if kw.get("device") == "cuda" and "kv_cache_bytes" not in kw:
        kw["kv_cache_bytes"] = 8 << 20
    llm = LLM(path, **kw)
    outputs = llm.generate(prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    ref = get_backend("cpu", "torch")
    torch_ops = [] if llm.backend.name == "torch" else [
        op for op in ("decode_attention", "extend_attention", "store_kv", "mla_attention")
        if getattr(llm.backend, op) is getattr(ref, op)
    ]  # fmt: skip
    info = {"graphs": llm.runner.graphs is not None, "torch_ops": torch_ops}
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [o.output_ids for o in outputs], info


def sweep(case: str, page_sizes, dtypes, device: str = "cuda") -> None:
    """One RESULT line per (dtype, page size): the engine (Triton, CUDA graphs on a GPU)
    against transformers on the same weights."""
    with tempfile.TemporaryDirectory() as path:
        save_case(case, path)
        for dt in dtypes:
            want = hf_tokens(path, device, DTYPES[dt])
            for ps in page_sizes:
                graphs = True if device == "cuda" else None
                ours, info = engine_tokens(
                    path, device=device, dtype=DTYPES[dt], page_size=ps, cuda_graphs=graphs
                )
                row = {"case": case, "dtype": dt, "page_size": ps, "engine": ours, "hf": want}
                print("RESULT " + json.dumps({**row, **info}), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--page-size", type=int, nargs="+", default=[4])
    p.add_argument("--dtype", choices=sorted(DTYPES), nargs="+", default=["fp32"])
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    sweep(args.case, args.page_size, args.dtype, args.device)


if __name__ == "__main__":
    main()
