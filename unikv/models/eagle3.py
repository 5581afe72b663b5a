"""An EAGLE-3 draft head (``speculative_config={"method": "eagle3", "model": <dir>}``).

The released layout (a Llama-shaped ``config.json``, architectures
``LlamaForCausalLMEagle3``, ``num_hidden_layers`` 1, ``draft_vocab_size``):

    fc.weight                  (hidden, 3 * hidden): the three target hidden states -> one
    midlayer.input_layernorm   RMSNorm of the token's embedding
    midlayer.hidden_norm       RMSNorm of the hidden input
    midlayer.self_attn.{q,k,v,o}_proj   q/k/v over 2 * hidden ([embedding | hidden])
    midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
    norm.weight, lm_head.weight (draft_vocab, hidden)
    d2t                        (draft_vocab,) int64: target id = draft id + d2t[draft id]

One row, for a hidden input ``h`` (``fc`` of the target's three hidden states at
position p, or the head's own previous output when chaining) and the token
``t_{p+1}`` after it:

    x = [input_layernorm(embed(t)) | hidden_norm(h)]
    r = h + o_proj(attention(x))            (causal over the head's rows, rope at p)
    g = r + mlp(post_attention_layernorm(r))             (chained on as h)
    draft = argmax(lm_head(norm(g))) + d2t

The target exports the residual stream entering layers (2, L // 2, L - 3) (L its
layers), or, where the head's config names ``eagle_config.eagle_aux_hidden_state_layer_ids``,
the outputs of those layers. The embedding is the target's.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from torch import nn

from unikv.kernels.backend import building
from unikv.models.layers import Attention, GatedMLP, Linear, RMSNorm
from unikv.models.rope import Rotary

HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class Eagle3Head(nn.Module):
    """The head (module docstring), its parameters under the checkpoint's names.

    Args:
        config: the head's ``ModelConfig`` (Llama-shaped); draft_vocab: its head's
        rows; target_hidden: the target's hidden size; export_layers: the target
        layers whose entering residual streams ``fc`` reads; max_positions: rope.
    """

    def __init__(self, config, draft_vocab: int, target_hidden: int, export_layers, max_positions):
        super().__init__()
        hidden = config.hidden_size
        self.export_layers = tuple(export_layers)
        self.sm_scale = config.sm_scale
        self.q_per_kv = config.num_heads // config.num_kv_heads
        self.fc = Linear(len(self.export_layers) * target_hidden, hidden, bias=False)
        rotary = Rotary(config.rope, config.head_dim, max_positions)
        self.rotary = rotary
        mid = nn.Module()
        mid.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        mid.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        mid.self_attn = Attention(dataclasses.replace(config, hidden_size=2 * hidden), 0, rotary)
        mid.self_attn.o_proj = Linear(config.num_heads * config.head_dim, hidden, bias=False)
        mid.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        mid.mlp = GatedMLP(config)
        self.midlayer = mid
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))

    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """(T, 3 * target hidden) exported rows -> (T, hidden) the layer's input."""
        return self.fc(target_hidden)

    def forward(self, embeds, hidden, positions, attn) -> torch.Tensor:
        """embeds, hidden: (T, hidden); positions: (T,) int64 -> g (T, hidden)."""
        mid = self.midlayer
        x = torch.cat([mid.input_layernorm(embeds), mid.hidden_norm(hidden)], dim=-1)
        r = hidden + mid.self_attn(x, positions, attn)
        return r + mid.mlp(mid.post_attention_layernorm(r))

    def tokens(self, g: torch.Tensor, target, backend) -> torch.Tensor:
        """(N,) int64 greedy target ids of outputs g (N, hidden)."""
        draft = backend.argmax(self.lm_head(self.norm(g)))
        return draft + self.d2t[draft]


def _head_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"speculative_config: cannot read the EAGLE-3 head's {file}: {err}"
        ) from err
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in HEAD_ARCHITECTURES or cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"speculative_config: method 'eagle3' reads a one-layer Llama-shaped EAGLE-3 head "
            f"(architectures {list(HEAD_ARCHITECTURES)}); {path} declares {arch!r} with "
            f"{cfg.get('num_hidden_layers')} layers"
        )
    return cfg


def aux_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose entering residual streams the head reads (module doc)."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) + 1 for i in ids)
    return (2, num_layers // 2, num_layers - 3)


def load_eagle3(path: str, target, max_positions: int) -> Eagle3Head:
    """The EAGLE-3 head at ``path`` for ``target`` (on its device and dtype), with its
    ``hf_config`` (a Llama config dict of one layer: its sub-pool's spec);
    ValueError naming what does not fit."""
    from unikv.models.config import model_config_from_hf
    from unikv.models.mtp import load_named

    cfg = _head_config(path)
    tcfg = target.config
    if cfg.get("vocab_size", tcfg.vocab_size) != tcfg.vocab_size:
        raise ValueError(
            f"speculative_config: the EAGLE-3 head's vocab_size ({cfg['vocab_size']}) must be "
            f"the target's ({tcfg.vocab_size})"
        )
    layers = aux_layers(cfg, tcfg.num_layers)
    if not all(1 <= i <= tcfg.num_layers for i in layers):
        raise ValueError(
            f"speculative_config: the EAGLE-3 head reads the target's layers {layers} (its "
            f"eagle_aux_hidden_state_layer_ids + 1, or (2, L/2, L-3)); the target has "
            f"{tcfg.num_layers}: set eagle_config.eagle_aux_hidden_state_layer_ids"
        )
    hf = dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1)
    import transformers

    config = model_config_from_hf(transformers.LlamaConfig.from_dict(hf))
    draft_vocab = int(cfg.get("draft_vocab_size") or tcfg.vocab_size)
    param = next(target.parameters())
    with torch.device("meta"), building(target.ops):
        head = Eagle3Head(config, draft_vocab, tcfg.hidden_size, layers, max_positions)
    head = head.to(param.dtype).to_empty(device=param.device)
    head.rotary.build(param.device)
    load_named(head, path, lambda name: name, what="EAGLE-3 head")
    head.d2t.copy_(_d2t(path, draft_vocab))
    head.hf_config = hf
    return head.eval().requires_grad_(False)


def _d2t(path: str, draft_vocab: int) -> torch.Tensor:
    """The head's ``d2t`` offsets (zeros where the checkpoint has none: the draft
    vocabulary is the target's)."""
    from unikv.models.loader import _open_weights, checkpoint_index, weight_files

    index = checkpoint_index(weight_files(path))
    if "d2t" not in index:
        return torch.zeros(draft_vocab, dtype=torch.int64)
    with _open_weights(index["d2t"]) as f:
        d2t = f.get_tensor("d2t").to(torch.int64)
    if d2t.shape != (draft_vocab,):
        raise ValueError(
            f"EAGLE-3 head: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)"
        )
    return d2t
