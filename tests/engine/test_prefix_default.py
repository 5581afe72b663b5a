"""Prefix caching's default per family (``engine/options.PREFIX_CACHING_DEFAULT``): one
row per family of ``models/family.FAMILIES``, each row's stated reason true of the
family's built-in presets (a family off by default has windows or recurrent state; a
row left to the pool's kinds decides by them), an explicit choice wins, and a family
the table lacks is named."""

from __future__ import annotations

import json

import pytest

from unikv.engine.options import PREFIX_CACHING_DEFAULT, prefix_caching_for
from unikv.hf_config import specs_from_hf_config
from unikv.inspect import PRESET_DIR
from unikv.models import family as families


def _presets():
    for path in sorted(PRESET_DIR.glob("*.json")):
        cfg = json.loads(path.read_text())
        fam = families.of_model_type(cfg.get("model_type"))
        if fam is not None:
            yield path.stem, fam.name, cfg


def test_every_family_has_one_row():
    assert set(PREFIX_CACHING_DEFAULT) == {f.name for f in families.FAMILIES}


@pytest.mark.parametrize("name, family, cfg", list(_presets()), ids=lambda x: str(x)[:24])
def test_each_row_holds_for_the_presets(name, family, cfg, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    configs = specs_from_hf_config(tmp_path, page_size=16)
    kinds = {c.spec.kind for c in configs}
    shares_only = kinds <= {"full", "mla"}  # a hit costs no copy and holds no extra bytes
    row = PREFIX_CACHING_DEFAULT[family]
    on = prefix_caching_for(None, configs, family)
    if row is None:
        assert on == shares_only, (name, kinds)
    else:
        assert on is row
    if row is False:  # the reason the table gives: windows or state cost memory
        assert kinds & {"swa", "mamba"}, (name, kinds)
    assert prefix_caching_for(True, configs, family) is True  # an explicit choice wins
    assert prefix_caching_for(False, configs, family) is False


def test_a_family_without_a_row_is_named(tmp_path):
    cfg = json.loads((PRESET_DIR / "llama-3.2-1b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    configs = specs_from_hf_config(tmp_path, page_size=16)
    with pytest.raises(KeyError, match="PREFIX_CACHING_DEFAULT"):
        prefix_caching_for(None, configs, "new_family")
    assert prefix_caching_for(None, configs) is True  # no family named: by the kinds
