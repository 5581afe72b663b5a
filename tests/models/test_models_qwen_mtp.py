"""Qwen3.5 (dense and MoE) and Qwen3-Next MTP layers (``models/mtp.py``, the
``mtp.*`` layout) against a reference written from the checkpoint's tensors (fp32,
CPU): the zero-centred pre-fc norms, ``fc``, transformers' own decoder layer (loaded
from the same ``mtp.layers.0.*`` tensors, eager attention) and ``mtp.norm`` in torch
(``qwen_mtp_fixtures.qwen_mtp_rows``). unikv's layer runs over the dense step object
in two chunks (its K/V carried between them), as the engine feeds it.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import DenseStepFn, one_thread  # noqa: F401
from qwen_mtp_fixtures import ARCHS, qwen_mtp_rows, save_tiny_qwen_mtp

from unikv.models.loader import load_model, load_model_config
from unikv.models.mtp import load_mtp, mtp_count

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_qwen_mtp_logits_match_reference(arch, tmp_path):
    hf, block, mtp = save_tiny_qwen_mtp(arch, str(tmp_path))
    target = load_model(str(tmp_path))
    layer = load_mtp(str(tmp_path), target)
    assert layer.cache_kind == "full"
    assert mtp_count(load_model_config(str(tmp_path))[1]) == 1
    ids = torch.randint(0, hf.config.vocab_size, (11,), generator=torch.Generator().manual_seed(3))
    ids = ids.tolist()
    hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
    want = hf.lm_head(qwen_mtp_rows(hf, block, mtp, ids[1:], hidden[:-1]))
    embeds = target.stack.embed(torch.tensor(ids[1:]))
    step = DenseStepFn({0: None}, target.config.sm_scale)
    got = target.lm_head(layer(embeds[:6], hidden[:6], torch.arange(6), step))
    later = layer(embeds[6:], hidden[6:-1], torch.arange(6, 10), step)
    got = torch.cat([got, target.lm_head(later)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert want.argmax(-1).unique().numel() > 1  # the layer's tokens vary with its input


def test_qwen_checkpoint_without_mtp_tensors_is_refused(tmp_path):
    """A Qwen3.5 checkpoint whose weights lack ``mtp.*``: a clear error naming them."""
    from engine_fixtures import save_tiny_hybrid

    from unikv.engine import LLM

    save_tiny_hybrid("qwen3_5", str(tmp_path))
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match=r"lacks \['mtp\.fc\.weight'"):
        LLM(str(tmp_path), device="cpu", dtype=torch.float32, max_model_len=32,
            speculative_config=spec)  # fmt: skip
