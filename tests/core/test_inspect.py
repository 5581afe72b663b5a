"""`unikv inspect`: printed numbers against pools built here from hand-written
specs of the published architectures, on the meta device (no memory)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from unikv import cli
from unikv.inspect import PRESET_DIR, main, parse_bytes, presets
from unikv.pool import SubPoolConfig, UnifiedPool, worst_case_pages
from unikv.specs import MambaSpec, MHASpec, MLASpec, StatePart

BF16 = torch.bfloat16
GIB = 2**30


def F32(shape: tuple[int, ...]) -> StatePart:
    return StatePart(shape, torch.float32)


# the published architectures, written out by hand: (name, spec, page_size)
HAND = {
    "llama-3.2-1b": [("full", MHASpec(16, 8, 64), 16)],
    "qwen3-0.6b": [("full", MHASpec(28, 8, 128), 16)],
    "gpt-oss-20b": [
        ("full", MHASpec(12, 8, 64), 16),
        ("swa", MHASpec(12, 8, 64, sliding_window=128), 16),
    ],
    "gemma-2-2b": [
        ("full", MHASpec(13, 4, 256), 16),
        ("swa", MHASpec(13, 4, 256, sliding_window=4096), 16),
    ],
    "deepseek-v2-lite": [("mla", MLASpec(27, 512, 64), 16)],
    "deepseek-v3": [("mla", MLASpec(61, 512, 64), 16)],  # 61 MLA layers, rank 512 + rope 64
    "gemma-3-27b": [  # 62 layers, five sliding per full one: 10 full, 52 sliding
        ("full", MHASpec(10, 16, 128), 16),
        ("swa", MHASpec(52, 16, 128, sliding_window=1024), 16),
    ],
    "mimo-v2-flash": [  # 48 layers, full on 0 and every sixth: 9 full (4 KV heads), 39 sliding (8)
        ("full", MHASpec(9, 4, 192, 128), 16),
        ("swa", MHASpec(39, 8, 192, 128, sliding_window=128), 16),
    ],
    "bamba-9b": [
        ("full", MHASpec(3, 8, 128), 16),
        (
            "mamba",
            MambaSpec(29, (StatePart((8192 + 2 * 128, 4), BF16),), StatePart((128, 64, 128))),
            1,
        ),
    ],
    # hybrids, from the published numbers (see each preset's _source): conv channels x kernel,
    # state (heads, key dim, value dim) for Gated DeltaNet, (heads, head dim, state) for Mamba-2
    "qwen3.5-27b": [  # 64 layers, every 4th full; DeltaNet 16 key / 48 value heads of 128
        ("full", MHASpec(16, 4, 256), 16),
        (
            "mamba",
            MambaSpec(48, (StatePart((2 * 16 * 128 + 48 * 128, 4), BF16),), F32((48, 128, 128))),
            1,
        ),
    ],
    "qwen3-next-80b-a3b": [  # 48 layers, every 4th full; DeltaNet 16 key / 32 value heads
        ("full", MHASpec(12, 2, 256), 16),
        (
            "mamba",
            MambaSpec(36, (StatePart((2 * 16 * 128 + 32 * 128, 4), BF16),), F32((32, 128, 128))),
            1,
        ),
    ],
    "nemotron-h-8b": [  # 24 M, 4 *, 24 - ; Mamba-2 128 heads of 64, 8 groups, state 128
        ("full", MHASpec(4, 8, 128), 16),
        (
            "mamba",
            MambaSpec(24, (StatePart((128 * 64 + 2 * 8 * 128, 4), BF16),), F32((128, 64, 128))),
            1,
        ),
    ],
    "nemotron-3-nano-30b-a3b": [  # 23 M, 6 *, 23 E; head_dim 128 (not hidden / heads = 84)
        ("full", MHASpec(6, 2, 128), 16),
        (
            "mamba",
            MambaSpec(23, (StatePart((64 * 64 + 2 * 8 * 128, 4), BF16),), F32((64, 64, 128))),
            1,
        ),
    ],
    "jamba-v0.1": [  # attention on layers 4, 12, 20, 28; Mamba-1 width 2 x 4096, state 16
        ("full", MHASpec(4, 8, 128), 16),
        ("mamba", MambaSpec(28, (StatePart((8192, 4), BF16),), F32((8192, 16))), 1),
    ],
    "qwen3.5-35b-a3b": [  # 40 layers, every 4th full; DeltaNet 16 key / 32 value heads of 128
        ("full", MHASpec(10, 2, 256), 16),
        (
            "mamba",
            MambaSpec(30, (StatePart((2 * 16 * 128 + 32 * 128, 4), BF16),), F32((32, 128, 128))),
            1,
        ),
    ],
    "lfm2-2.6b": [  # 22 short-conv layers (a conv window alone) + 8 attention, 8 KV heads of 64
        ("full", MHASpec(8, 8, 64), 16),
        ("mamba", MambaSpec(22, (StatePart((2048, 3), BF16),), None), 1),
    ],
    "granite-4.0-h-small": [  # attention on 5, 15, 25, 35 (8 KV heads of 128); 36 Mamba-2
        ("full", MHASpec(4, 8, 128), 16),  # layers of 128 heads x 64, state 128, 1 group
        ("mamba", MambaSpec(36, (StatePart((8192 + 2 * 128, 4), BF16),), F32((128, 64, 128))), 1),
    ],
    "falcon-h1-7b": [  # all 44 layers in both sub-pools; Mamba-2 d_ssm 3072 = 24 x 128, state 256
        ("full", MHASpec(44, 2, 128), 16),
        ("mamba", MambaSpec(44, (StatePart((3072 + 2 * 256, 4), BF16),), F32((24, 128, 256))), 1),
    ],
}
HYBRIDS = [p for p in HAND if any(n == "mamba" for n, _, _ in HAND[p])]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def hand_pool(preset: str, budget: int) -> UnifiedPool:
    return UnifiedPool(
        [SubPoolConfig(n, s, ps) for n, s, ps in HAND[preset]], budget, device="meta"
    )


def test_the_published_model_presets_exist() -> None:
    assert set(HAND) <= set(presets())


@pytest.mark.parametrize("preset", sorted(HAND))
def test_plan_numbers_match_a_pool_built_by_hand(capsys, preset: str) -> None:
    code, out, _ = run(capsys, preset, "--budget", "4GiB", "--json")
    assert code == 0
    plan = json.loads(out)
    pool = hand_pool(preset, 4 * GIB)
    assert plan["budget_bytes"] == 4 * GIB
    assert plan["tail_pad_bytes"] == pool.buffer.numel() - 4 * GIB
    assert set(plan["subpools"]) == set(pool.subpools)
    for name, sub in pool.subpools.items():
        got = plan["subpools"][name]
        assert got["entry_bytes"] == sub.spec.entry_bytes
        assert got["page_bytes"] == sub.page_bytes == sub.page_size * sub.spec.entry_bytes
        assert got["pages_alone"] == sub.usable_pages
        assert got["tokens_alone"] == sub.usable_pages * sub.page_size
        assert got["kernel_id_headroom"] == 2**31 - sub.kernel_id_limit
        assert len(got["model_layers"]) == sub.spec.num_layers


def test_gpt_oss_text_shows_the_numbers(capsys) -> None:
    code, out, _ = run(capsys, "--budget", "4GiB")  # gpt-oss-20b is the default model
    assert code == 0 and out.startswith("model gpt-oss-20b (gpt_oss): 24 layers: 12 swa, 12 full")
    entry = 12 * 2 * 8 * 64 * 2  # layers x (K, V) x heads x head_dim x bf16
    pages = 4 * GIB // (16 * entry) - 1  # minus the sink page
    assert (
        f"full: full, 12 layers, grows down, page_size 16, entry {entry} B, page {16 * entry} B"
        in out
    )
    assert f"swa: swa, window 128, 12 layers, grows up, page_size 16, entry {entry} B" in out
    assert f"all to full: full {pages} pages = {16 * pages} tokens; swa 0 pages" in out
    assert f"all to swa: swa {pages} pages = {16 * pages} tokens; full 0 pages" in out
    limit = (pages + 1) * 2 * 12 * 16
    assert f"full: ids below {limit}; headroom {2**31 - limit}" in out
    assert "sink: page 0 of every sub-pool" in out and "<- full grows down" in out
    assert re.search(r"\|#+ swa ->\s+<- full \|\+\|", out)


def test_longest_request_and_concurrency_agree_with_fits(capsys) -> None:
    code, out, _ = run(capsys, "llama-3.2-1b", "--budget", "1GiB", "--max-tokens", "5000", "--json")
    assert code == 0
    plan = json.loads(out)
    pool = hand_pool("llama-3.2-1b", GIB)
    longest = plan["longest_request_alone"]

    def need(tokens: int, times: int = 1) -> dict:
        return {"full": times * worst_case_pages(pool["full"].spec, 16, tokens)}

    assert pool.fits(need(longest)) and not pool.fits(need(longest + 1))
    assert longest == pool["full"].usable_pages * 16  # one full band, all of it for one request
    k = plan["concurrent_requests"]
    assert plan["worst_case_pages"] == {"full": -(-5000 // 16)}
    assert pool.fits(need(5000, k)) and not pool.fits(need(5000, k + 1))


def test_a_request_longer_than_the_pool_fails_with_advice(capsys) -> None:
    code, _, err = run(capsys, "llama-3.2-1b", "--budget", "1GiB", "--max-tokens", "100000")
    assert code == 2 and "cannot run alone" in err and "raise total_bytes" in err


def test_plot_writes_a_png(capsys, tmp_path) -> None:
    target = tmp_path / "plan.png"
    code, out, _ = run(capsys, "bamba-9b", "--budget", "8GiB", "--plot", str(target))
    assert code == 0 and f"wrote {target}" in out
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(target))
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 200


def test_model_directory_and_cli_dispatch(capsys, tmp_path) -> None:
    shutil.copy(PRESET_DIR / "qwen3-0.6b.json", tmp_path / "config.json")
    code, out, _ = run(
        capsys, str(tmp_path), "--budget", "512MiB", "--page-size", "4", "--dtype", "fp8"
    )
    assert code == 0
    entry = 28 * 2 * 8 * 128 * 1  # fp8: one byte per element
    assert f"entry {entry} B, page {4 * entry} B" in out
    assert cli.main(["inspect", "qwen3-0.6b", "--budget", "512MiB"]) == 0
    assert "model qwen3-0.6b (qwen3): 28 layers: 28 full" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no-such-model"], "no model 'no-such-model'"),
        (["--budget", "4 parsecs"], "a byte size must be a positive number"),
        (["--budget", "0"], "a byte size must be a positive number"),
        (["--dtype", "int3"], "dtype must be one of"),
        (["--budget", "600KiB"], "fits no real page"),  # gpt-oss pages are 384 KiB
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, argv, message) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_parse_bytes_units() -> None:
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1000000") == 1_000_000
    assert parse_bytes("2kib") == 2048


@pytest.mark.parametrize("preset", presets())
def test_presets_are_valid_transformers_configs(preset: str) -> None:
    """Each preset loads into transformers' own config class, and the specs of
    that object equal the specs unikv reads from the raw JSON."""
    transformers = pytest.importorskip("transformers")
    from unikv.hf_config import specs_from_hf_config

    raw = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    fields = {k: v for k, v in raw.items() if not k.startswith("_")}
    config = transformers.AutoConfig.for_model(**fields)
    if not _in_the_table(raw):  # a preset ahead of its family (Kimi-Linear): refused alike
        for source in (config, raw):
            with pytest.raises(ValueError, match="unknown architecture"):
                specs_from_hf_config(source)
        return
    assert specs_from_hf_config(config) == specs_from_hf_config(raw)


def _in_the_table(raw: dict) -> bool:
    """Whether the family table knows the preset's model_type (its text config's, for a
    multimodal wrapper)."""
    from unikv.models import family

    types = [raw.get("model_type"), raw.get("text_config", {}).get("model_type")]
    return any(family.of_model_type(t) for t in types if t)


# -- hybrids: the Mamba sub-pool -------------------------------------------------------


def _mamba_numbers(preset: str) -> dict:
    """A hybrid preset's numbers, written from its config fields (not from unikv's
    specs): per layer conv channels x kernel (bf16) and state elements (fp32)."""
    c = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    c = c.get("text_config", c)
    t = c.get("model_type")
    if t in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
        kinds = c.get("layer_types") or [
            "full_attention" if (i + 1) % c["full_attention_interval"] == 0 else "x"
            for i in range(c["num_hidden_layers"])
        ]
        layers = sum(k != "full_attention" for k in kinds)
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        conv, state = (2 * hk * dk + hv * dv) * c["linear_conv_kernel_dim"], hv * dk * dv
        attn_layers, kv_heads, head_dim = len(kinds) - layers, c["num_key_value_heads"], 256
    elif t == "nemotron_h":
        pattern = c["hybrid_override_pattern"]
        layers, inner = pattern.count("M"), c["mamba_num_heads"] * c["mamba_head_dim"]
        conv = (inner + 2 * c["n_groups"] * c["ssm_state_size"]) * c["conv_kernel"]
        state = inner * c["ssm_state_size"]
        attn_layers, kv_heads = pattern.count("*"), c["num_key_value_heads"]
        head_dim = c.get("head_dim") or c["attention_head_dim"]
    elif t == "jamba":
        period = c["attn_layer_period"]
        attn_layers = len(range(c["attn_layer_offset"], c["num_hidden_layers"], period))
        layers, inner = c["num_hidden_layers"] - attn_layers, 2 * c["hidden_size"]
        conv, state = inner * c["mamba_d_conv"], inner * c["mamba_d_state"]
        kv_heads = c["num_key_value_heads"]
        head_dim = c["hidden_size"] // c["num_attention_heads"]
    elif t == "bamba":
        attn_layers = len(c["attn_layer_indices"])
        layers, inner = c["num_hidden_layers"] - attn_layers, c["mamba_expand"] * c["hidden_size"]
        conv = (inner + 2 * c["mamba_n_groups"] * c["mamba_d_state"]) * c["mamba_d_conv"]
        state = inner * c["mamba_d_state"]
        kv_heads = c["num_key_value_heads"]
        head_dim = c["hidden_size"] // c["num_attention_heads"]
    elif t == "lfm2":  # short convs: a conv window of L_cache inputs, no temporal state
        layers, attn_layers = (
            c["layer_types"].count("conv"),
            c["layer_types"].count("full_attention"),
        )
        conv, state = c["hidden_size"] * c["conv_L_cache"], 0
        kv_heads, head_dim = c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"]
    elif t == "granitemoehybrid":
        attn_layers = c["layer_types"].count("attention")
        layers, inner = c["num_hidden_layers"] - attn_layers, c["mamba_n_heads"] * c["mamba_d_head"]
        conv = (inner + 2 * c["mamba_n_groups"] * c["mamba_d_state"]) * c["mamba_d_conv"]
        state = inner * c["mamba_d_state"]
        kv_heads = c["num_key_value_heads"]
        head_dim = c["hidden_size"] // c["num_attention_heads"]
    else:  # falcon_h1: every layer has both
        layers = attn_layers = c["num_hidden_layers"]
        conv = (c["mamba_d_ssm"] + 2 * c["mamba_d_state"]) * c["mamba_d_conv"]
        state = c["mamba_d_ssm"] * c["mamba_d_state"]
        kv_heads, head_dim = c["num_key_value_heads"], c["head_dim"]
    return {
        "slot": layers * (conv * 2 + state * 4),
        "token": attn_layers * 2 * kv_heads * head_dim * 2,
        "layers": layers,
    }


@pytest.mark.parametrize("preset", HYBRIDS)
def test_hybrid_presets_mamba_slot_from_the_config_fields(capsys, preset: str) -> None:
    """Slot and page bytes against the config fields; requests at once against a
    brute-force packing: k slots above a one-slot sink, k requests' pages below the top."""
    want = _mamba_numbers(preset)
    budget, tokens = 8 * GIB, 20000
    code, out, _ = run(capsys, preset, "--budget", "8GiB", "--max-tokens", str(tokens), "--json")
    assert code == 0
    plan = json.loads(out)
    mamba, full = plan["subpools"]["mamba"], plan["subpools"]["full"]
    slot, page = want["slot"], 16 * want["token"]
    assert (mamba["entry_bytes"], mamba["page_bytes"], full["page_bytes"]) == (slot, slot, page)
    assert mamba["page_size"] == 1 and len(mamba["model_layers"]) == want["layers"]
    assert plan["sink_bytes"] == slot and mamba["sink_pages"] == 1  # the sink is one slot
    assert full["sink_pages"] == -(-slot // page)
    assert mamba["pages_alone"] == mamba["tokens_alone"] == budget // slot - 1
    per_request = -(-tokens // 16)
    top = budget // page

    def fits(k: int) -> bool:  # mamba [slot, (k + 1) slot) below full [(top - k n) page, top)
        return (k + 1) * slot <= (top - k * per_request) * page

    k = max(k for k in range(budget // slot) if fits(k))
    assert plan["concurrent_requests"] == k
    assert plan["worst_case_pages"] == {"full": per_request, "mamba": 1}


@pytest.mark.parametrize("preset", HYBRIDS)
def test_hybrid_text_shows_slots_requests_and_the_one_slot_sink(capsys, preset: str) -> None:
    want = _mamba_numbers(preset)
    code, out, _ = run(capsys, preset, "--budget", "8GiB")
    assert code == 0
    slots = 8 * GIB // want["slot"] - 1
    assert f"one slot per request whatever its length: slot {want['slot']} B" in out
    assert f"all to mamba: mamba {slots} slots = {slots} requests; full 0 pages" in out
    assert re.search(r"all to full: full \d+ pages = \d+ tokens; mamba 0 slots", out)
    assert f"(it spans {-(-want['slot'] // (16 * want['token']))} full pages, 1 mamba slot)" in out
    assert f"sink {want['slot']} B" in out
    assert f"as many bytes as {want['slot'] / want['token']:.0f} tokens of full K/V" in out


def test_qwen3_5_preset_is_the_multimodal_wrapper_read_through_its_text_config(capsys) -> None:
    raw = json.loads((PRESET_DIR / "qwen3.5-27b.json").read_text())
    assert raw["model_type"] == "qwen3_5" and raw["text_config"]["model_type"] == "qwen3_5_text"
    code, out, _ = run(capsys, "qwen3.5-27b", "--budget", "8GiB")
    assert code == 0 and out.startswith(
        "model qwen3.5-27b (qwen3_5_text): 64 layers: 48 mamba, 16 full"
    )


def test_falcon_h1_layers_are_in_both_sub_pools(capsys) -> None:
    code, out, _ = run(capsys, "falcon-h1-7b", "--budget", "8GiB", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["layer_kinds"] == ["full+mamba"] * 44
    assert plan["subpools"]["full"]["model_layers"] == plan["subpools"]["mamba"]["model_layers"]
    assert plan["subpools"]["mamba"]["model_layers"] == list(range(44))


# -- asymmetric K/V: bytes per token padded vs exact -----------------------------------


def test_kv_layout_bytes_of_the_192_128_shape() -> None:
    """The issue's example: 9 layers of one 192/128 head in bf16 hold 5,760 bytes of
    data per token, 6,912 when both rows are padded to 192 (20 % more)."""
    from unikv.inspect import kv_layout_bytes

    got = kv_layout_bytes(MHASpec(9, 1, 192, 128))
    assert (got["padded"], got["exact"]) == (6912, 5760)
    assert got["stored"] == MHASpec(9, 1, 192, 128).entry_bytes
    fp8 = kv_layout_bytes(MHASpec(3, 2, 20, 36, torch.float8_e4m3fn))  # V wider than K
    assert (fp8["padded"], fp8["exact"]) == (3 * 2 * 2 * 36, 3 * 2 * 56)
    same = kv_layout_bytes(MHASpec(4, 2, 64))
    assert same["padded"] == same["exact"] == same["stored"] == 4 * 2 * 2 * 64 * 2


def test_mimo_v2_flash_padded_and_exact_from_its_config(capsys) -> None:
    """Bytes per token and tokens in the budget under both layouts, from the preset's
    own fields (layer pattern counted here, widths read from the JSON)."""
    c = json.loads((PRESET_DIR / "mimo-v2-flash.json").read_text())
    full_layers = c["hybrid_layer_pattern"].count(0)
    swa_layers = c["num_hidden_layers"] - full_layers
    d, dv = c["head_dim"], c["v_head_dim"]
    want = {
        "full": (full_layers * c["num_key_value_heads"], c["num_key_value_heads"]),
        "swa": (swa_layers * c["swa_num_key_value_heads"], c["swa_num_key_value_heads"]),
    }
    budget = 80 * GIB
    code, out, _ = run(capsys, "mimo-v2-flash", "--budget", "80GiB", "--json")
    assert code == 0
    layout = json.loads(out)["kv_layout"]
    totals = {"padded": 0, "exact": 0}
    for name, (layer_heads, _) in want.items():
        padded, exact = layer_heads * 2 * max(d, dv) * 2, layer_heads * (d + dv) * 2
        got = layout["subpools"][name]
        assert (got["bytes_per_token"]["padded"], got["bytes_per_token"]["exact"]) == (
            padded,
            exact,
        )
        assert got["tokens_in_budget"]["padded"] == budget // (16 * padded) * 16
        assert got["tokens_in_budget"]["exact"] == budget // (16 * exact) * 16
        totals = {"padded": totals["padded"] + padded, "exact": totals["exact"] + exact}
    assert (
        {k: layout["bytes_per_token"][k] for k in totals}
        == totals
        == {
            "padded": 267264,
            "exact": 222720,
        }
    )
    code, out, _ = run(capsys, "mimo-v2-flash", "--budget", "80GiB")
    assert "full: padded 27648 B, exact 23040 B (16.7% less)" in out
    assert "every token sub-pool: padded 267264 B, exact 222720 B (16.7% less)" in out


def test_a_symmetric_model_prints_no_padding_section(capsys) -> None:
    code, out, _ = run(capsys, "gemma-3-27b", "--budget", "8GiB")
    assert code == 0 and out.startswith("model gemma-3-27b (gemma3_text): 62 layers: 52 swa")
    assert "asymmetric K/V" not in out
    code, out, _ = run(capsys, "deepseek-v3", "--budget", "8GiB", "--json")
    layout = json.loads(out)["kv_layout"]
    assert layout["bytes_per_token"] == dict.fromkeys(("padded", "exact", "stored"), 61 * 576 * 2)


# -- whether the engine runs it -------------------------------------------------------


def _table_verdict(raw: dict) -> tuple[bool, str]:
    """(runs, the family table's words) for a preset, read from models/family.py's
    entries here: a family listing the architecture with a model class runs it; a
    family of its model_type without a model gives pool specs only; else none knows it."""
    from unikv.models import family

    arch = raw["architectures"][0]
    for f in family.FAMILIES:
        if arch in f.architectures and f.model is not None:
            return True, f"runs it (family {f.name!r}"
    types = [raw.get("model_type"), raw.get("text_config", {}).get("model_type")]
    for f in family.FAMILIES:
        if any(t in f.model_types for t in types) and f.model is None:
            return False, f"family {f.name!r} has no unikv model"
    return False, f"no family in models/family.py knows architecture {arch!r}"


def test_presets_list_says_whether_the_engine_runs_each(capsys) -> None:
    code, out, _ = run(capsys, "--presets")
    assert code == 0
    lines = dict(line.split(": ", 1) for line in out.splitlines())
    assert sorted(lines) == presets()
    for preset, line in lines.items():
        raw = json.loads((PRESET_DIR / f"{preset}.json").read_text())
        runs, words = _table_verdict(raw)
        assert line.startswith(raw["architectures"][0] + ": ")
        assert words in line and ("does not run it" not in line) == runs, (preset, line)
    for preset in ("qwen3.5-35b-a3b", "lfm2-2.6b", "gemma-3-27b"):  # this families
        assert "runs it" in lines[preset]
    assert "pool specs only" in lines["jamba-v0.1"]  # a family with no model class


@pytest.mark.parametrize("preset", ["lfm2-2.6b", "jamba-v0.1", "gemma-3-27b"])
def test_every_plan_carries_the_verdict(capsys, preset) -> None:
    raw = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    runs, words = _table_verdict(raw)
    code, out, _ = run(capsys, preset, "--json")
    assert code == 0
    engine = json.loads(out)["engine"]
    assert engine["runs"] == runs and (engine["why_not"] is None) == runs
    code, out, _ = run(capsys, preset)
    line = out.splitlines()[1]
    assert code == 0 and line.startswith("engine: " + ("runs it" if runs else "does")), line
    assert words in line


def test_a_config_ahead_of_its_family_says_why_and_plans_nothing(capsys, tmp_path) -> None:
    """A config no family of the table knows (as Kimi-Linear's preset was before its
    family): the verdict names the table, and no pool can be planned (exit 2)."""
    raw = {"architectures": ["AcmeLinearForCausalLM"], "model_type": "acme_linear"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    code, out, err = run(capsys, str(tmp_path))
    assert code == 2
    assert out.strip() == (
        "engine: does not run it: no family in models/family.py knows architecture "
        "'AcmeLinearForCausalLM' or model_type 'acme_linear'"
    )
    assert "unknown architecture 'acme_linear'" in err


def test_the_verdict_follows_the_table_when_it_changes(capsys, monkeypatch) -> None:
    """A family whose model class is taken out of the table (a copy): the same preset
    is then refused for it, by the table's words."""
    import dataclasses

    from unikv.models import family

    table = tuple(
        dataclasses.replace(f, model=None, architectures=()) if f.name == "lfm2" else f
        for f in family.FAMILIES
    )
    monkeypatch.setattr(family, "FAMILIES", table)
    code, out, _ = run(capsys, "lfm2-2.6b", "--budget", "1GiB")
    assert code == 0
    assert "engine: does not run it: family 'lfm2' has no unikv model" in out


def test_a_refused_feature_is_the_why_not(capsys, tmp_path) -> None:
    """The family's own config checks: a Gemma-3 text config with bidirectional
    attention is planned (its pool is known) but not run, with the family's reason."""
    pytest.importorskip("transformers")
    raw = json.loads((PRESET_DIR / "gemma-3-27b.json").read_text())["text_config"]
    raw.update(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    code, out, _ = run(capsys, str(tmp_path), "--json")
    assert code == 0
    engine = json.loads(out)["engine"]
    assert not engine["runs"] and engine["family"] == "gemma"
    assert "use_bidirectional_attention=True" in engine["why_not"]
