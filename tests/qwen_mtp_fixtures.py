"""Tiny Qwen3.5 (dense, MoE) and Qwen3-Next checkpoints carrying an MTP layer in the
released layout, and a reference of that layer written from the checkpoint's tensors.

Released layout (``mtp.*``, beside the target's tensors; transformers drops it at
load): ``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``,
``mtp.fc.weight`` (hidden, 2 hidden) over [norm(embed) | norm(hidden)], one decoder
layer ``mtp.layers.0.*`` (gated full attention and the family's MLP / MoE, under the
names ``save_pretrained`` writes for a decoder layer), ``mtp.norm.weight``; every
norm zero-centred (weight ``1 + w``). The decoder-layer tensors are the last layer
of a transformers model one full-attention layer deeper (its own names and init);
the other four are random tensors of those shapes.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from engine_fixtures import save_tiny_hybrid, tiny_hybrid_config
from family_fixtures import save_tiny_qwen3_5_moe, tiny_qwen3_5_moe_config
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"
ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# the config.json field declaring the MTP layers: Qwen3.5's, Qwen3-Next's
COUNT_FIELD = {"qwen3_5": "mtp_num_hidden_layers", "qwen3_5_moe": "mtp_num_hidden_layers",
               "qwen3_next": "num_nextn_predict_layers"}  # fmt: skip


def _tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, WEIGHTS), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not iterable)


def _config(arch: str, **overrides):
    if arch == "qwen3_5_moe":
        return tiny_qwen3_5_moe_config(**overrides)
    return tiny_hybrid_config(arch, **overrides)


def save_tiny_qwen_mtp(arch: str, path: str, seed: int = 0, mm: bool = False):
    """The tiny transformers ``arch`` model saved to ``path`` with one MTP layer
    appended in the released layout and its count in config.json; returns (the fp32
    eval transformers model, the MTP decoder layer as a transformers module, the
    ``mtp.*`` tensors without their prefix). ``mm``: Qwen3.5's released multimodal
    wrapper instead (``family_fixtures.save_tiny_qwen3_5_mm``: the decoder under
    ``model.language_model.``, the count in ``text_config``, ``mtp.*`` at the top)."""
    import transformers as tf

    if mm:
        from family_fixtures import save_tiny_qwen3_5_mm

        hf = save_tiny_qwen3_5_mm(path, moe=arch == "qwen3_5_moe", seed=seed)
    elif arch == "qwen3_5_moe":
        hf = save_tiny_qwen3_5_moe(path, seed)
    else:
        hf = save_tiny_hybrid(arch, path, seed)
    text = hf.config.text_config if mm else hf.config
    n = text.num_hidden_layers
    types = list(text.layer_types) + ["full_attention"]
    torch.manual_seed(seed + 1)
    deeper = tf.AutoModelForCausalLM.from_config(
        _config(arch, num_hidden_layers=n + 1, layer_types=types), dtype=torch.float32
    )
    g = torch.Generator().manual_seed(seed + 2)
    block = deeper.model.layers[n].eval()
    with torch.no_grad():  # zero-centred norms init to 0: make them bite
        for name, p in block.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp)
        saved = _tensors(tmp)
    start = f"model.layers.{n}."
    mtp = {"layers.0." + k[len(start) :]: v for k, v in saved.items() if k.startswith(start)}
    hidden = text.hidden_size
    mtp.update({
        "pre_fc_norm_embedding.weight": 0.3 * torch.randn(hidden, generator=g),
        "pre_fc_norm_hidden.weight": 0.3 * torch.randn(hidden, generator=g),
        "fc.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
        "norm.weight": 0.3 * torch.randn(hidden, generator=g),
    })  # fmt: skip
    tensors = _tensors(path)
    tensors.update({"mtp." + k: v.contiguous() for k, v in mtp.items()})
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    (config["text_config"] if mm else config)[COUNT_FIELD[arch]] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return hf, block, mtp


def _zc_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm from its definition: x_hat * (1 + w), in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())).to(x.dtype)


@torch.no_grad()
def qwen_mtp_rows(hf, block, mtp: dict, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The MTP layer over one sequence: row j takes ``hidden[j]`` (the target's
    final-normed hidden state) and token ``ids[j]``, at position j, causal ->
    the layer's outputs after ``mtp.norm`` (T, hidden). The decoder layer is
    transformers' own module; the rest is written here from ``mtp``'s tensors."""
    eps = hf.config.rms_norm_eps
    t = len(ids)
    e = hf.model.embed_tokens(torch.tensor(ids))
    x = torch.cat(
        [_zc_rms(e, mtp["pre_fc_norm_embedding.weight"], eps),
         _zc_rms(hidden, mtp["pre_fc_norm_hidden.weight"], eps)], dim=-1,
    )  # fmt: skip
    x = (x @ mtp["fc.weight"].T)[None]
    pos = torch.arange(t)[None]
    rope_pos = pos if "Next" in type(hf).__name__ else pos[None].expand(3, 1, t)  # Qwen3.5: mrope
    rope = hf.model.rotary_emb(x, rope_pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = block(x, position_embeddings=rope, attention_mask=mask, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    return _zc_rms(out[0], mtp["norm.weight"], eps)
