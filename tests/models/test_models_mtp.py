"""DeepSeek-V3's MTP layer (``models/mtp.py``) against transformers' own ``MtpModel``
on the same tiny checkpoint (fp32, CPU).

The checkpoint carries the layer in the released layout (``mtp_fixtures``), and
transformers' loader reads it with its own renaming rules: the two load paths
agree on the layout. The oracle is transformers' ``MtpLayer`` (its DeepSeek-V3
decoder layer, eager attention and experts) over the target's final hidden states;
unikv's layer runs over the dense MLA step object, in both MLA forms.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import DenseMLAStep
from mtp_fixtures import hf_mtp, mtp_rows, save_tiny_deepseek_mtp

from unikv.models.loader import load_model
from unikv.models.mtp import load_mtp, mtp_count


class Absorbed(DenseMLAStep):
    def expands_mla(self, layer, **widths) -> bool:
        return False


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("deepseek_mtp"))
    save_tiny_deepseek_mtp(path)
    hf, mtp = hf_mtp(path)
    target = load_model(path)
    return hf, mtp, target, load_mtp(path, target)


@torch.no_grad()
def test_mtp_logits_match_transformers(saved):
    hf, mtp, target, layer = saved
    assert mtp_count(hf.config) == 1
    ids = torch.randint(0, hf.config.vocab_size, (11,), generator=torch.Generator().manual_seed(3))
    ids = ids.tolist()
    hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    # row j: the hidden state at j and the token after it (transformers: position j + 1)
    want = hf.lm_head(mtp_rows(hf, mtp, ids[1:], hidden[:-1]))
    embeds = target.model.embed_tokens(torch.tensor(ids[1:]))
    step = Absorbed()
    got = target.lm_head(layer(embeds[:6], hidden[:6], torch.arange(6), step))
    got = torch.cat(
        [got, target.lm_head(layer(embeds[6:], hidden[6:-1], torch.arange(6, 10), step))]
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_checkpoint_without_the_layer_is_refused(saved, tmp_path):
    from engine_fixtures import save_tiny_deepseek, save_tiny_model

    from unikv.engine import LLM

    spec = {"method": "mtp", "num_speculative_tokens": 1}
    kw = {"device": "cpu", "dtype": torch.float32, "max_model_len": 32}
    save_tiny_deepseek(3, str(tmp_path / "v3"))  # the config declares one, the weights lack it
    with pytest.raises(ValueError, match=r"MTP layer under 'model\.layers\.3\.'"):
        LLM(str(tmp_path / "v3"), speculative_config=spec, **kw)
    save_tiny_model("llama", str(tmp_path / "llama"))  # a family with no MTP layout
    with pytest.raises(ValueError, match="knows the MTP layouts of DeepSeek-V3 and MiMo"):
        LLM(str(tmp_path / "llama"), speculative_config=spec, **kw)


@torch.no_grad()
def test_mimo_mtp_logits_match_transformers_layer(tmp_path):
    """MiMo-V2-Flash's layout (``model.mtp.layers.0.*``, no transformers MTP module):
    the oracle is transformers' own MiMo decoder layer (sliding window, sinks, partial
    rope, value scale) between enorm/hnorm/eh_proj and final_layernorm in torch."""
    from engine_fixtures import DenseAttention
    from mtp_fixtures import mimo_mtp_rows, save_tiny_mimo_mtp

    hf, block, mtp = save_tiny_mimo_mtp(str(tmp_path))
    target = load_model(str(tmp_path))
    layer = load_mtp(str(tmp_path), target)
    assert layer.cache_kind == "swa"
    ids = torch.randint(0, hf.config.vocab_size, (13,), generator=torch.Generator().manual_seed(3))
    ids = ids.tolist()
    hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    want = hf.lm_head(mimo_mtp_rows(hf, block, mtp, ids[1:], hidden[:-1]))
    embeds = target.model.embed_tokens(torch.tensor(ids[1:]))
    step = DenseAttention({0: hf.config.sliding_window}, target.config.sm_scale)
    got = target.lm_head(layer(embeds, hidden[:-1], torch.arange(len(ids) - 1), step))
    assert len(ids) - 1 > hf.config.sliding_window  # the window bites
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
