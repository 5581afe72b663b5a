"""The models and layout schemes ``bench_capacity.py`` compares.

A scheme is a pool policy (``unified``: one pool, moving boundaries;
``static_split``: SGLang's fixed regions) applied to the model's sub-pools after
an optional layout transform:

- ``pad_kv``: K and V rows padded to ``max(head_dim, v_head_dim)``, i.e. the
  spec with ``v_head_dim`` raised to ``head_dim``: what the padded layout cost
  per token (``L * H * 2 * max(D, Dv) * itemsize`` instead of ``L * H * (D + Dv)``).
- ``expand_mla``: the MLA latent sub-pool replaced by what a pool without an
  MLA kind stores: per-head K (``qk_nope + qk_rope``) and V (``v_head_dim``) rows
  for every attention head of the same layers (an MHA spec).

No ``padded_latent`` scheme: neither FlashInfer's MLA page layout (``ckv`` 512
and ``kpe`` 64 wide, separate caches) nor FlashMLA's (one 576-wide bf16 row per
token) pads the latent row, so no padding width is justified.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from unikv.pool import SubPoolConfig
from unikv.specs import MambaSpec, MHASpec, MLASpec, StatePart

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ROOT / "unikv/presets"
GIB = 1 << 30
SWA_FULL_TOKENS_RATIO = 0.8  # SGLang ServerArgs default
MAMBA_FULL_MEMORY_RATIO = 0.9  # SGLang ServerArgs default
VLLM_PAGE_ALIGN = 16  # tokens: attention page sizes are multiples of this


def pad_kv(configs: list[SubPoolConfig], hf: dict) -> list[SubPoolConfig]:
    """MHA sub-pools with V rows padded to the K row width (``v_head_dim = head_dim``)."""
    del hf
    out = []
    for c in configs:
        if isinstance(c.spec, MHASpec) and c.spec.v_head_dim != c.spec.head_dim:
            wide = max(c.spec.head_dim, c.spec.v_head_dim)
            c = dataclasses.replace(
                c, spec=dataclasses.replace(c.spec, head_dim=wide, v_head_dim=wide)
            )
        out.append(c)
    return out


def expanded_kv_spec(mla: MLASpec, hf: dict) -> MHASpec:
    """The MHA spec of ``mla``'s layers with the per-head K and V an MLA model's
    attention computes (``hf``: its config.json dict; K = qk_nope + qk_rope wide,
    V = v_head_dim wide, one KV head per attention head)."""
    need = ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [k for k in need if k not in hf]
    if missing:
        raise ValueError(f"expand_mla needs the MLA config fields {need}; missing {missing}")
    return MHASpec(
        num_layers=mla.num_layers,
        num_kv_heads=hf["num_attention_heads"],
        head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        dtype=mla.dtype,
    )


def expand_mla(configs: list[SubPoolConfig], hf: dict) -> list[SubPoolConfig]:
    """MLA sub-pools replaced by their expanded per-head K/V (``expanded_kv_spec``)."""
    return [
        dataclasses.replace(c, spec=expanded_kv_spec(c.spec, hf))
        if isinstance(c.spec, MLASpec)
        else c
        for c in configs
    ]


def static_shares(configs: list[SubPoolConfig]) -> dict[str, float]:
    """Byte share of each sub-pool in SGLang's default static split."""
    by_kind = {c.spec.kind: c for c in configs}
    if "mamba" in by_kind:
        mamba = MAMBA_FULL_MEMORY_RATIO / (1 + MAMBA_FULL_MEMORY_RATIO)
        return {c.name: (mamba if c.spec.kind == "mamba" else 1 - mamba) for c in configs}
    full, swa = by_kind.get("full"), by_kind.get("swa")
    if full is None or swa is None or len(configs) != 2:
        raise ValueError(
            f"static split needs full + swa or full + mamba sub-pools, got {[c.name for c in configs]}"
        )
    weight = {
        full.name: full.spec.entry_bytes,
        swa.name: SWA_FULL_TOKENS_RATIO * swa.spec.entry_bytes,
    }
    total = sum(weight.values())
    return {n: w / total for n, w in weight.items()}


def equal_page_configs(configs: list[SubPoolConfig]) -> list[SubPoolConfig]:
    """The sub-pools padded to equal page bytes (see the module docstring)."""
    tokens = [c for c in configs if isinstance(c.spec, (MHASpec, MLASpec))]
    if len({c.spec.layer_bytes for c in tokens}) > 1:
        raise ValueError(
            "equal_pages pads layer counts; it needs one row width across attention sub-pools"
        )
    layers = max(c.spec.num_layers for c in tokens)
    out = [
        dataclasses.replace(c, spec=dataclasses.replace(c.spec, num_layers=layers), layers=())
        for c in tokens
    ]
    mamba = [c for c in configs if isinstance(c.spec, MambaSpec)]
    if not mamba:
        return out
    spec = mamba[0].spec
    per_layer = spec.entry_bytes // spec.num_layers
    token_row = tokens[0].spec.layer_bytes  # one layer's K + V of one token
    ps = -(-per_layer // token_row)
    ps = -(-ps // VLLM_PAGE_ALIGN) * VLLM_PAGE_ALIGN
    out = [dataclasses.replace(c, page_size=ps) for c in out]
    pad = ps * token_row - per_layer
    group = sum(c.spec.num_layers for c in out)
    padded = MambaSpec(
        num_layers=-(-spec.num_layers // group) * group,
        conv=(*spec.conv, StatePart((pad,), _uint8())) if pad else spec.conv,
        temporal=spec.temporal,
    )
    return out + [dataclasses.replace(mamba[0], spec=padded, layers=())]


def _uint8():
    import torch

    return torch.uint8


def mixed_workload(
    num: int, seed: int, short=(32, 1024), long=(4096, 16384), long_frac=0.3, out=(128, 512)
):
    """(prompt_len, output_len) pairs: a ``long_frac`` share of long prompts."""
    rng = np.random.default_rng(seed)
    is_long = rng.random(num) < long_frac
    prompts = np.where(is_long, rng.integers(*long, num), rng.integers(*short, num))
    outputs = rng.integers(*out, num)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


# scheme name -> (pool policy, layout transform or None)
SCHEME_RULES = {
    "unified": ("unified", None),
    "static_split": ("static_split", None),
    "equal_pages": ("equal_pages", None),
    "unified_padded": ("unified", pad_kv),
    "static_split_padded": ("static_split", pad_kv),
    "expanded_kv": ("unified", expand_mla),
}


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """One model's run: preset, byte budget (quick: ``quick_budget_gib``),
    ``mixed_workload`` arguments, schemes, and the scheme ratios are taken against."""

    name: str
    budget_gib: float
    quick_budget_gib: float
    workload: dict
    schemes: tuple[str, ...]
    baseline: str

    @property
    def preset(self) -> Path:
        return PRESETS / f"{self.name}.json"

    def hf(self) -> dict:
        return json.loads(self.preset.read_text())

    def budget(self, quick: bool) -> int:
        return int((self.quick_budget_gib if quick else self.budget_gib) * GIB)


MODELS = (
    ModelCase(
        "gpt-oss-20b",
        4,
        1,
        {"seed": 0},
        ("unified", "static_split", "equal_pages"),
        "static_split",
    ),
    ModelCase(
        "bamba-9b",
        8,
        2,
        {"seed": 1, "long_frac": 0.2},
        ("unified", "static_split", "equal_pages"),
        "static_split",
    ),
    # Granite-4.0-H-Small: 36 Mamba-2 layers (one state slot a request) beside 4 GQA
    # layers (8 KV heads of 128: 16 KiB a token in bf16); static split: SGLang's Mamba
    # ratio, as Bamba; equal_pages raises the attention page to the tokens whose rows hold
    # one Mamba layer's state.
    ModelCase(
        "granite-4.0-h-small",
        8,
        2,
        {"seed": 5, "long_frac": 0.2},
        ("unified", "static_split", "equal_pages"),
        "static_split",
    ),
    # Static split: the full region is 1 / (1 + 0.8 * 199680 / 23040) = 12.6 % of the
    # bytes; 6 GiB lets it hold one 16.9k-token request alone (padded too), so the
    # same budget serves in quick mode.
    ModelCase(
        "mimo-v2-flash",
        6,
        6,
        {"seed": 2},
        ("unified", "unified_padded", "static_split", "static_split_padded"),
        "static_split_padded",
    ),
    # Expanded K/V is 4,997,120 bytes per token (71x the latent row): 12 GiB holds
    # 2,578 expanded tokens, so the workload is short prompts only (at most 1,536
    # tokens a request) or no expanded request could run alone.
    # Kimi-Linear: 7 MLA layers (one 1,152-byte latent row each per token in bf16) and
    # 20 KDA layers (a 41.9 MiB state slot a request): MLA latents beside recurrent
    # state. equal_pages raises the MLA page to the tokens whose latent rows hold one
    # KDA layer's state (2.1 MiB: 1,920 tokens a page, a multiple of 16).
    ModelCase(
        "kimi-linear-48b-a3b",
        8,
        4,
        {"seed": 4, "long_frac": 0.2},
        ("unified", "static_split", "equal_pages"),
        "static_split",
    ),
    ModelCase(
        "deepseek-v3",
        12,
        12,
        {"seed": 3, "long_frac": 0.0},
        ("unified", "expanded_kv"),
        "expanded_kv",
    ),
)
