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
    "bamba-9b": [
        ("full", MHASpec(3, 8, 128), 16),
        (
            "mamba",
            MambaSpec(29, (StatePart((8192 + 2 * 128, 4), BF16),), StatePart((128, 64, 128))),
            1,
        ),
    ],
}


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
    assert specs_from_hf_config(config) == specs_from_hf_config(raw)
