"""GPU only (``-m gpu``; needs cuda-bindings): two tiny models sharing one CUDA
reservation (``MultiLLM``, issue 44 item 4). The busy model takes the idle
one's memory and gives it back; greedy tokens (fp32, Triton, CUDA graphs) equal
transformers' (a fixed-size ``LLM``'s run, which that implies, is left out: two
engine builds with graph capture, to keep this file under 60 s on the H100); an
explicit shrink hands the released
bytes back to the driver (``torch.cuda.mem_get_info``) within one chunk; the
committed chunks of both never pass the budget."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MIB = 1 << 20
TOTAL = 16 * MIB  # 8 chunks of CHUNK; a burst of 64 requests needs about 12 MiB of pages
KW = {"device": "cuda", "dtype": torch.float32, "page_size": 16, "max_num_seqs": 64,
      "max_model_len": 512, "max_num_batched_tokens": 256}  # fmt: skip
NEW = 24
CHUNK = 2 * MIB  # the driver's granularity on the H100 (the default chunk is 8 MiB)


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_two_models_share_one_cuda_reservation(tmp_path):
    pytest.importorskip("cuda.bindings")
    from engine_fixtures import VOCAB, hf_greedy, save_tiny_model

    from unikv.engine import SamplingParams
    from unikv.engine.multi import MultiLLM

    paths, want = {}, {}
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 33, 90, 200)]
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    for i, (name, arch) in enumerate((("a", "llama"), ("b", "qwen3"))):
        paths[name] = str(tmp_path / name)
        hf = save_tiny_model(arch, paths[name], seed=i + 1)
        want[name] = [hf_greedy(hf, p, NEW) for p in prompts]
    multi = MultiLLM(paths, total_kv_bytes=TOTAL, chunk=CHUNK, **KW)
    try:
        chunk = multi.backing.chunk
        assert multi.llms["a"].runner.graphs is not None, "decode under CUDA graphs"
        share = multi.committed()
        for name, other in (("a", "b"), ("b", "a")):
            out = multi.generate(name, prompts * 16, params)
            assert [o.output_ids for o in out] == want[name] * 16, name
            now = multi.committed()
            assert sum(now.values()) == multi.backing.committed_bytes <= TOTAL
            assert now[name] > share[name] and now[other] < share[other], (name, now)
        # an explicit shrink of the idle model: the driver gets the bytes back
        b = multi.budget.members["b"]
        before, held = _free(), b.committed
        multi.resize_kv_cache("b", b.floor)
        released = held - b.committed
        assert released > 0
        assert abs((_free() - before) - released) <= chunk, (released, chunk)
        out = multi.generate("b", prompts, params)  # grows back on demand
        assert [o.output_ids for o in out] == want["b"]
        assert multi.backing.committed_bytes <= TOTAL
    finally:
        multi.close()
