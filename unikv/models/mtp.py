"""A checkpoint's multi-token-prediction (MTP) layer, built and loaded as a draft.

Layouts: DeepSeek-V3's (below), MiMo-V2-Flash's (``mtp_layout``: the same parts
under ``model.mtp.layers.0.``, a sliding-window attention layer with a dense MLP) and
Qwen3.5's / Qwen3-Next's (``mtp.*``: ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
``fc``, one gated full-attention decoder layer ``layers.0`` with the family's MLP or
MoE, ``norm``; every norm zero-centred, the embedding and head the target's).

DeepSeek-V3 (``num_nextn_predict_layers``; transformers calls it ``num_mtp_layers``)
keeps MTP layer i after the last decoder layer, at ``model.layers.{N + i}.*``
(N = ``num_hidden_layers``):

    enorm, hnorm        RMSNorms of the token's embedding and the previous hidden state
    eh_proj             (hidden, 2 * hidden): the projection of [enorm(e) | hnorm(h)]
    (a decoder layer)   the family's own layer under its usual names (MLA, MoE, norms)
    shared_head.norm    the output norm
    shared_head.head    a copy of lm_head; embed_tokens: a copy of the embedding

The embedding and the head are the target's (as transformers' ``MtpModel`` ties them);
the copies under the MTP prefix are not read. One row of the layer, for the target's
hidden state ``h_p`` (after its final norm) and the token ``t_{p+1}`` after it:

    x   = eh_proj([enorm(embed(t_{p+1})) | hnorm(h_p)])
    g_p = shared_head.norm(layer(x))          (the layer's residual stream out)
    logits = lm_head(g_p)                     (a guess at t_{p+2})

Chained drafts feed ``g_p`` back as the next row's hidden state (transformers'
``MtpModel`` passes its post-normed output on the same way). Its K/V (the layer's
attention) sit at position p, in the draft's own sub-pools; the attention is causal
over the layer's rows 0..p (rope is relative, so rows at p instead of
transformers' p + 1 attend identically).

Only the first MTP layer is built (DeepSeek-V3 ships one): every draft position
chains it, as vLLM does with one layer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from unikv.kernels.backend import building
from unikv.models.layers import Linear, RMSNorm


class MTPLayer(nn.Module):
    """One MTP layer (module docstring); ``block``: the family's decoder layer (its
    attention reads cache layer 0 of the draft's sub-pools).

    The draft-head interface (``speculative/mtp.HiddenDraft``): ``export_layers``
    (None: the target's final hidden state), ``project`` (the target's exported rows
    to the layer's hidden input), ``forward`` and ``tokens`` (greedy draft ids)."""

    export_layers = None

    def __init__(
        self, hidden: int, eps: float, block: nn.Module, sm_scale: float, norm: type = RMSNorm
    ) -> None:
        super().__init__()
        self.sm_scale = sm_scale
        self.enorm = norm(hidden, eps)
        self.hnorm = norm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.shared_head = nn.Module()
        self.shared_head.norm = norm(hidden, eps)

    def forward(self, embeds, hidden, positions, attn) -> torch.Tensor:
        """embeds: (T, hidden) the next tokens' embeddings; hidden: (T, hidden) the
        previous hidden states; positions: (T,) int64 -> (T, hidden) post-normed g."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        h, residual = self.block(x, None, positions, attn)
        return self.shared_head.norm(h + residual)

    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    def tokens(self, g: torch.Tensor, target, backend) -> torch.Tensor:
        """(N,) int64 greedy target ids from outputs g (N, hidden): the target's head."""
        return backend.argmax(target.lm_head(g))


def mtp_count(hf_config) -> int:
    """The MTP layers a checkpoint's config declares (0: none): DeepSeek-V3's and
    Qwen3-Next's ``num_nextn_predict_layers``, transformers' ``num_mtp_layers``,
    Qwen3.5's ``mtp_num_hidden_layers``."""
    for name in ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 0


# MiMo-V2-Flash's names where they differ from its decoder layer's / MTPLayer's
MIMO_NAMES = {"block.post_attention_layernorm.": "pre_mlp_layernorm.",
              "shared_head.norm.": "final_layernorm."}  # fmt: skip
# Qwen3.5's / Qwen3-Next's names under ``mtp.`` for MTPLayer's
QWEN_NAMES = {"enorm.": "pre_fc_norm_embedding.", "hnorm.": "pre_fc_norm_hidden.",
              "eh_proj.": "fc.", "shared_head.norm.": "norm.", "block.": "layers.0."}  # fmt: skip


def _renamed(names: dict[str, str], prefix: str):
    """A checkpoint-name function: an MTPLayer name's first matching ``names`` prefix
    replaced, under ``prefix``."""

    def rename(name: str) -> str:
        for ours, theirs in names.items():
            if name.startswith(ours):
                return prefix + theirs + name[len(ours) :]
        return prefix + name

    return rename


def mtp_layout(target) -> tuple[callable, callable, str, type]:
    """(the checkpoint name of an MTPLayer parameter, a builder of its decoder layer,
    the target sub-pool kind its attention caches like, its norms' class) for a
    target model; ValueError for a family whose MTP layout unikv does not know.

    - DeepSeek-V3: ``model.layers.{N}.*`` (module docstring); a MoE layer, MLA.
    - MiMo-V2-Flash: ``model.mtp.layers.0.*``: enorm, hnorm, eh_proj, a sliding-window
      attention layer (the sliding layers' heads, window, sinks and rope) with a dense
      MLP, its norms ``input_layernorm`` and ``pre_mlp_layernorm``, and
      ``final_layernorm`` (the output norm).
    - Qwen3.5 (dense and MoE) and Qwen3-Next: ``mtp.*`` (``QWEN_NAMES``): a gated
      full-attention layer (the target's heads, q/k norms, partial rope) with the
      family's MLP for layer 0 (Qwen3-Next: the sparse MoE unless layer 0 is in
      ``mlp_only_layers``; Qwen3.5-MoE: the MoE), zero-centred norms; it caches like
      the target's ``full`` sub-pool."""
    from unikv.models import deepseek, mimo_v2, qwen3_5

    config = target.config
    if isinstance(target, deepseek.DeepseekForCausalLM) and config.extra["version"] == 3:
        n = config.num_layers
        extra = dict(config.extra, first_k_dense_replace=0)  # MTP layers are MoE layers
        layer_config = dataclasses.replace(config, extra=extra)
        rotary = target.stack.rotary

        def make():
            block = deepseek.DecoderLayer(layer_config, n, rotary)
            block.self_attn.layer = 0  # the draft's cache layer, not the target's
            return block

        return (
            (lambda name: f"model.layers.{n}." + name.removeprefix("block.")),
            make,
            "mla",
            RMSNorm,
        )
    if isinstance(target, mimo_v2.MiMoV2FlashForCausalLM):
        extra = dict(config.extra, layer_types=("sliding_attention",), mlp_layer_types=("dense",))
        layer_config = dataclasses.replace(config, extra=extra)
        rotary = target.stack.rotary["sliding_attention"]

        names = {**MIMO_NAMES, "block.": ""}
        make = lambda: mimo_v2.DecoderLayer(layer_config, 0, rotary)
        return _renamed(names, "model.mtp.layers.0."), make, "swa", RMSNorm
    if isinstance(target, qwen3_5.Qwen3_5ForCausalLM):  # Qwen3-Next, Qwen3.5-MoE too
        extra = dict(config.extra, layer_types=("full_attention",))
        layer_config = dataclasses.replace(config, extra=extra)
        rotary, family = target.stack.rotary, type(target)

        def make_qwen():
            mlp = family.make_mlp(layer_config, 0)
            return qwen3_5.DecoderLayer(layer_config, 0, rotary, family.mixer, mlp)

        norm = qwen3_5.ZeroCenteredRMSNorm
        return _renamed(QWEN_NAMES, "mtp."), make_qwen, "full", norm
    raise ValueError(
        f"speculative_config: method 'mtp' knows the MTP layouts of DeepSeek-V3 and "
        f"MiMo-V2-Flash, and of Qwen3.5 and Qwen3-Next; {config.architecture} is not built: use "
        "'ngram' or 'draft_model'"
    )


def load_mtp(model_dir: str, target, fp8=None) -> MTPLayer:
    """MTP layer 0 of the checkpoint at ``model_dir``, on the target's device and
    dtype, its weights read from the checkpoint (FP8 weights dequantised);
    ValueError naming the tensors missing."""
    rename, make, kind, norm = mtp_layout(target)
    param = next(target.parameters())
    config = target.config
    with torch.device("meta"), building(target.ops):
        layer = MTPLayer(config.hidden_size, config.rms_norm_eps, make(), config.sm_scale, norm)
    layer.cache_kind = kind
    layer = layer.to(param.dtype).to_empty(device=param.device)
    for name, p in layer.named_parameters():
        if name.endswith(tuple(getattr(target, "fp32_params", ()))):
            p.data = p.data.float()
    load_named(layer, model_dir, rename, fp8)
    return layer.eval().requires_grad_(False)


def load_named(layer: nn.Module, model_dir: str, ckpt, fp8=None, what="MTP layer") -> None:
    """Every parameter of ``layer`` from checkpoint tensor ``ckpt(name)`` (a fused
    parameter from its parts, FP8 pairs dequantised), then the modules' fused paths
    re-derived; ValueError naming what is missing or mis-shaped."""
    from unikv.models.loader import (
        _open_weights,
        _source_tensor,
        _sources,
        _tensor,
        checkpoint_index,
        packed_params,
        weight_files,
    )

    files = weight_files(model_dir)
    index = checkpoint_index(files)
    sources = _sources(index, (), fp8)
    packed = packed_params(layer)
    params = dict(layer.named_parameters())
    wanted = {n: [ckpt(part) for part in packed.get(n, (n,))] for n in params}
    missing = sorted(c for parts in wanted.values() for c in parts if c not in sources)
    if missing:
        where = ckpt("")
        raise ValueError(
            f"speculative_config: the draft needs the checkpoint's {what}"
            + (f" under {where!r}" if where else "")
            + f"; {model_dir} lacks {missing[:6]}{'...' if len(missing) > 6 else ''}"
        )
    handles = {path: _open_weights(path) for path in files}
    with torch.no_grad():
        for name, p in params.items():
            parts = []
            for part in wanted[name]:
                tensors = [_tensor(handles, index[n], n) for n in sources[part]]
                parts.append(_source_tensor(sources[part], tensors, p, fp8))
            source = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if tuple(source.shape) != tuple(p.shape):
                raise ValueError(
                    f"{what} tensor {ckpt(name)}: expected shape {tuple(p.shape)}, given "
                    f"{tuple(source.shape)}; config.json and the weights disagree"
                )
            p.copy_(source)
    for module in layer.modules():
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    for module in layer.modules():  # fused paths re-derived, as DecoderLM.rebind does
        for block in getattr(module, "blocks", ()):
            block.bind()
        if module is not layer and hasattr(module, "rebind"):
            module.rebind()
