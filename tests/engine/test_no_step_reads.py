"""No step reads the environment or the device capability (issue 43 item 5).

Every variant (kernel backend, fresh-prompt attention, MoE path, switches) is decided
when the engine is built or in the step's plan from host ints. Oracle: once the engine
is built, ``os.environ`` is replaced by a fence that records (and refuses) any read
whose caller is a ``unikv`` module, and ``torch.cuda.get_device_capability`` by one
that records and raises; then a tiny model prefills and decodes on CPU, on the torch
references and on the Triton kernels (``TRITON_INTERPRET=1``, set by conftest). The
fence records as well as raises, since the engine contains a failing request; the
tokens must still equal transformers' greedy ones. A self-check shows the fence sees a
``unikv`` read (``env.Flags.from_environ``), so an empty record is not vacuous.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

import pytest
import torch
from engine_fixtures import VOCAB, hf_greedy, one_thread, save_tiny_model  # noqa: F401

from unikv import env
from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PASS_THROUGH = {
    "os",
    "_collections_abc",
    "collections.abc",
    __name__,
}  # frames between a reader and the fence


class EnvFence(MutableMapping):
    """``os.environ`` that records the key of every read made from a ``unikv`` module
    and raises there; writes and other callers (torch, Triton) pass through."""

    def __init__(self, real: MutableMapping) -> None:
        self.real, self.reads = real, []

    def _check(self, key: object) -> None:
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__") in PASS_THROUGH:
            frame = frame.f_back
        module = frame.f_globals.get("__name__", "") if frame is not None else ""
        if module == "unikv" or module.startswith("unikv."):
            self.reads.append(f"{module} read {key!r}")
            raise AssertionError(f"{module} read os.environ[{key!r}] after the engine was built")

    def __getitem__(self, key):
        self._check(key)
        return self.real[key]

    def __iter__(self):
        self._check("<iter>")
        return iter(self.real)

    def __len__(self) -> int:
        self._check("<len>")
        return len(self.real)

    def __setitem__(self, key, value) -> None:
        self.real[key] = value

    def __delitem__(self, key) -> None:
        del self.real[key]


def fence(monkeypatch) -> tuple[EnvFence, list]:
    env_fence, probes = EnvFence(os.environ), []

    def capability(*args, **kwargs):
        probes.append(args)
        raise AssertionError("torch.cuda.get_device_capability called after the engine was built")

    monkeypatch.setattr(os, "environ", env_fence)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    return env_fence, probes


def test_the_fence_sees_a_unikv_read_and_lets_others_through(monkeypatch):
    env_fence, _ = fence(monkeypatch)
    with pytest.raises(AssertionError, match="read os.environ"):
        env.Flags.from_environ()
    assert env_fence.reads and env_fence.reads[0].startswith("unikv.env read ")
    assert os.getenv("PATH") is None or isinstance(os.getenv("PATH"), str)  # the test's own
    assert env_fence.reads == env_fence.reads[:1]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_and_decode_read_no_environment_or_capability(backend, tmp_path, monkeypatch):
    hf = save_tiny_model("llama", str(tmp_path))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (11, 3)]
    want = [hf_greedy(hf, p, 4) for p in prompts]
    llm = LLM(
        str(tmp_path),
        device="cpu",
        backend=backend,
        page_size=4,
        max_model_len=64,
        max_num_batched_tokens=16,
    )
    assert llm.backend.name == backend
    env_fence, probes = fence(monkeypatch)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    assert env_fence.reads == [] and probes == []
    assert [o.output_ids for o in outputs] == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_cuda_steps_read_no_environment_or_capability(arch, tmp_path, monkeypatch):
    """The same on a GPU, where the Triton backend's variants (PDL, TMA, the MLA and
    decode plans, the Hopper kernels) are decided from the device: eager prefill, then
    decode steps (CUDA graphs included), with the fence up; every request completes."""
    from gpu_fixtures import gpu_llm

    save_tiny_model(arch, str(tmp_path))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 7, 19)]
    llm = gpu_llm(str(tmp_path), torch.bfloat16)
    env_fence, probes = fence(monkeypatch)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert env_fence.reads == [] and probes == []
    assert [len(o.output_ids) for o in outputs] == [6, 6, 6]
