"""Save -> restore: byte-identical into other pages of a fresh pool of the same
specs; other specs or page sizes refused naming both fingerprints; corruption
anywhere in the file detected; on every error the pool is unchanged."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from test_io_support import CONFIGS, assert_same_contents, make_pool, naive_expected, page_contents

from unikv.ids import PhysicalPageIds
from unikv.io import PageIntegrityError, SpecMismatchError, load_manifest, restore_pages, save_pages
from unikv.pool import SubPoolConfig
from unikv.specs import MHASpec

SRC = {"full": [3, 7, 5], "mamba": [9, 14]}
DST = {"full": [8, 2, 10], "mamba": [15, 11]}


def _ids(pages: dict[str, list[int]]) -> dict[str, PhysicalPageIds]:
    return {n: PhysicalPageIds(torch.tensor(p, dtype=torch.int32), n) for n, p in pages.items()}


@pytest.fixture
def saved(tmp_path):
    pool = make_pool(seed=1)
    path = tmp_path / "pages.safetensors"
    save_pages(path, pool, _ids(SRC), metadata={"request": "42"})
    return pool, path


def _data_range(path, tensor: str) -> tuple[int, int]:
    """Byte range of a tensor's data in a safetensors file (from its JSON header)."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + size])[tensor]["data_offsets"]
    return 8 + size + begin, 8 + size + end


def test_restore_into_other_pages_is_byte_identical(saved) -> None:
    source, path = saved
    subpools, user = load_manifest(path)
    assert user == {"request": "42"}
    assert {n: m["fingerprint"] for n, m in subpools.items()} == {
        n: source[n].spec.fingerprint() for n in SRC
    }
    target = make_pool(seed=2)
    before = target.buffer.clone()
    restore_pages(path, target, _ids(DST))
    want = before
    for name, src in SRC.items():  # the full and mamba destinations are byte-disjoint here
        got = page_contents(target, name, DST[name])
        assert_same_contents(got, page_contents(source, name, src))
        want = naive_expected(want, source.buffer, source[name].page_bytes, src, DST[name])
    assert torch.equal(target.buffer, want)


@pytest.mark.parametrize("change", ["spec", "page_size"])
def test_other_specs_are_refused_naming_both_fingerprints(saved, change: str) -> None:
    source, path = saved
    full = CONFIGS[0]
    other = (
        SubPoolConfig("full", MHASpec(2, 2, 8, dtype=torch.float16), page_size=full.page_size)
        if change == "spec"
        else SubPoolConfig("full", full.spec, page_size=2 * full.page_size)
    )
    target = make_pool([other, *CONFIGS[1:]], seed=3)
    before = target.buffer.clone()
    with pytest.raises(SpecMismatchError) as err:
        restore_pages(path, target, _ids(DST))
    message = str(err.value)
    assert source["full"].spec.fingerprint() in message
    assert other.spec.fingerprint() in message and "'full'" in message
    assert torch.equal(target.buffer, before)


@pytest.mark.parametrize("tensor", ["mamba.pages", "full.pages", "full.checksums"])
def test_a_flipped_byte_is_detected_and_nothing_is_restored(saved, tensor: str) -> None:
    _, path = saved
    begin, end = _data_range(path, tensor)
    raw = bytearray(path.read_bytes())
    raw[(begin + end) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    target = make_pool(seed=4)
    before = target.buffer.clone()
    with pytest.raises(PageIntegrityError, match="checksum"):
        restore_pages(path, target, _ids(DST))
    assert torch.equal(target.buffer, before)


def test_a_damaged_or_foreign_file_is_refused(saved, tmp_path) -> None:
    _, path = saved
    raw = bytearray(path.read_bytes())
    raw[12] = ord("}")  # break the JSON header
    path.write_bytes(bytes(raw))
    target = make_pool(seed=5)
    before = target.buffer.clone()
    with pytest.raises(PageIntegrityError, match="cannot read"):
        restore_pages(path, target, _ids(DST))
    import safetensors.torch as st

    foreign = tmp_path / "model.safetensors"
    st.save_file({"w": torch.zeros(2)}, foreign)
    with pytest.raises(PageIntegrityError, match="not a unikv page file"):
        restore_pages(foreign, target, _ids(DST))
    assert torch.equal(target.buffer, before)


def test_wrong_destination_count_or_missing_subpool_is_refused(saved) -> None:
    _, path = saved
    target = make_pool(seed=6)
    before = target.buffer.clone()
    with pytest.raises(ValueError, match="one per saved page"):
        restore_pages(path, target, _ids({"full": [2, 4], "mamba": [15, 11]}))
    with pytest.raises(SpecMismatchError, match="missing"):
        restore_pages(path, target, _ids({"swa": [20]}))
    with pytest.raises(ValueError, match="sink"):
        restore_pages(path, target, _ids({"full": [0, 2, 4], "mamba": [15, 11]}))
    assert torch.equal(target.buffer, before)
