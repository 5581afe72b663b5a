"""Tiny DeepSeek-V3 checkpoints carrying an MTP layer in the released layout, and
transformers' own MTP module over them (the oracle of ``method: "mtp"``).

The released layout keeps MTP layer 0 at ``model.layers.{N}.*`` (N =
``num_hidden_layers``): the decoder layer's tensors under their usual names, plus
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head`` and
``embed_tokens``. The decoder-layer part is layer N of a transformers model one
layer deeper (so its names are exactly what ``save_pretrained`` writes for a MoE
layer); the rest are random tensors of the documented shapes.
"""

from __future__ import annotations

import os
import tempfile

import torch
from engine_fixtures import save_tiny_deepseek, tiny_deepseek_config
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"


def _tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, WEIGHTS), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not iterable)


def save_tiny_deepseek_mtp(path: str, seed: int = 0):
    """A random-init transformers DeepSeek-V3 (``save_tiny_deepseek(3, ...)``) saved
    to ``path`` with one MTP layer appended in the released layout; returns the
    fp32 eval transformers model (without the MTP layer)."""
    import transformers as tf

    hf = save_tiny_deepseek(3, path, seed)
    n = hf.config.num_hidden_layers
    assert hf.config.num_mtp_layers == 1, "fixture invariant: the config declares one MTP layer"
    torch.manual_seed(seed + 1)
    deeper = tf.AutoModelForCausalLM.from_config(
        tiny_deepseek_config(3, num_hidden_layers=n + 1), dtype=torch.float32
    )
    with torch.no_grad():
        for name, p in deeper.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape) * 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp)
        block = {k: v for k, v in _tensors(tmp).items() if k.startswith(f"model.layers.{n}.")}
    tensors = _tensors(path)
    hidden, g = hf.config.hidden_size, torch.Generator().manual_seed(seed + 2)
    prefix = f"model.layers.{n}."
    extra = {
        "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    }
    tensors.update(block)
    tensors.update({prefix + k: v.contiguous() for k, v in extra.items()})
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    return hf


def hf_mtp(path: str):
    """(transformers' model, its ``MtpModel`` over the checkpoint's MTP layer), both
    loaded by transformers' own loader from ``path`` (the main model's MTP-name
    pattern pointed at this checkpoint's depth)."""
    import transformers as tf
    from transformers.modeling_layers import MtpModel

    hf = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    n = hf.config.num_hidden_layers  # the instance's pattern set (made from the class's)
    hf._keys_to_ignore_on_load_unexpected = {rf"model\.layers\.{n}\..*"}
    mtp = MtpModel.from_pretrained(hf)
    return hf, mtp.float().eval()


@torch.no_grad()
def mtp_rows(hf, mtp, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """transformers' MTP layer over one sequence: row j takes ``hidden[j]`` (the
    previous hidden state) and token ``ids[j]``, at position j + 1, causal over the
    rows -> the layer's post-normed outputs (T, hidden)."""
    layer = mtp.layers[0]
    t = len(ids)
    x = hf.model.embed_tokens(torch.tensor([ids]))
    pos = torch.arange(1, t + 1)[None]
    rope = mtp.rotary_emb(x, position_ids=pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    return layer(x, hidden[None], rope, mask, pos, None)[0]
