"""Issue 37's engine matrix: four tiny models (Llama: full attention; Mistral:
sliding window only; gpt-oss: full and sliding-window layers with sinks; Qwen3.5:
Gated DeltaNet + full attention) under five memory options (prefix caching; caching
with a host tier behind it; swap preemption; caching with swap; all three), each on
the smallest pool that starts (one page fewer is refused at start-up), in debug mode
(``check_integrity`` after every allocator verb): ten greedy prompts that share
prefixes give the tokens of the same engine on a pool large enough for all of them.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import one_thread, save_tiny_hybrid, save_tiny_model  # noqa: F401
from prefix_fixtures import host_tier_bytes, pool_budget, prefix_llm

from unikv.engine import SamplingParams
from unikv.hf_config import specs_from_hf_config

PS, MAX_LEN = 4, 48
OPTIONS = {
    "cache": {"caching": True},
    "cache+host": {"caching": True, "host": True},
    "swap": {"caching": False, "swap": True},
    "cache+swap": {"caching": True, "swap": True},
    "cache+host+swap": {"caching": True, "host": True, "swap": True},
}
ARCHS = ["llama", "mistral", "gpt_oss", "qwen3_5"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for arch in ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        (save_tiny_hybrid if arch == "qwen3_5" else save_tiny_model)(arch, path)
        out[arch] = path
    return out


def prompts(seed: int = 5) -> list[list[int]]:
    """Ten prompts over a 13-token system prompt (5 to 13 tokens of it, 3 to 21 own)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 256, (13,), generator=g).tolist()
    return [
        system[: 5 + i] + torch.randint(0, 256, (3 + 2 * i,), generator=g).tolist()
        for i in range(10)
    ]


def _llm(path, pages, caching=False, host=False, swap=False, configs=None):
    kw = {"kv_cache_bytes": pool_budget(configs, pages, state_slots=2), "max_model_len": MAX_LEN}
    if host:
        kw["prefix_host_bytes"] = host_tier_bytes(configs, PS, 12, 12)
    if swap:
        kw.update(swap_host_bytes=8 << 20, preemption="swap")
    return prefix_llm(path, PS, caching, **kw)


def smallest(path, configs, **options):
    """The LLM on the fewest pages per sub-pool that starts (searched upwards)."""
    for pages in range(2, 64):
        try:
            return _llm(path, pages, configs=configs, **options), pages
        except ValueError:
            continue
    raise AssertionError("no pool up to 64 pages starts")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("arch", ARCHS)
def test_the_smallest_pool_gives_the_big_pools_tokens(models, arch, option):
    path = models[arch]
    opts = dict(OPTIONS[option])
    configs = specs_from_hf_config(path, page_size=PS, dtype=torch.float32)
    params = SamplingParams(max_tokens=8, temperature=0)
    want = [o.output_ids for o in prefix_llm(path, PS, False).generate(prompts(), params)]
    llm, pages = smallest(path, configs, **opts)
    if opts.get("host"):
        llm.alloc.prefix.host.policy.mode = "always"  # CPU: reload whenever it hits
    got = [o.output_ids for o in llm.generate(prompts(), params)]
    assert got == want, f"{arch} {option} on {pages} pages"
    llm.alloc.check_integrity()
    if llm.scheduler.swap is not None:
        llm.scheduler.swap.check_integrity()
