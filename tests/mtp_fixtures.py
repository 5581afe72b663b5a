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


# -- EAGLE-3 heads ---------------------------------------------------------------------


def save_tiny_eagle3(path: str, target_config, draft_vocab: int = 128, seed: int = 0) -> dict:
    """A random EAGLE-3 head for a tiny Llama target, saved to ``path`` in the
    released layout (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``;
    a one-layer Llama-shaped config.json of architectures LlamaForCausalLMEagle3);
    returns its tensors. ``d2t`` maps the draft vocabulary onto a random subset of
    the target's."""
    import json

    g = torch.Generator().manual_seed(seed)
    hidden, heads, kv = target_config.hidden_size, 4, 2
    head_dim, inter, vocab = hidden // heads, 96, target_config.vocab_size

    def w(*shape, scale=0.1):
        return scale * torch.randn(*shape, generator=g)

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    targets = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    tensors = {
        "fc.weight": w(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": norm(hidden),
        "midlayer.hidden_norm.weight": norm(hidden),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": norm(hidden),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "norm.weight": norm(hidden),
        "lm_head.weight": w(draft_vocab, hidden, scale=0.5),
        "d2t": targets - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "rms_norm_eps": target_config.rms_norm_eps, "vocab_size": vocab,
        "draft_vocab_size": draft_vocab, "max_position_embeddings": 512,
        "rope_theta": 10000.0, "torch_dtype": "float32",
    }  # fmt: skip
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, WEIGHTS))
    return tensors


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta=10000.0):
    """NeoX rotate-half rope of x (T, H, D) at positions (T,), written out here."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv[None, :]
    cos, sin = (
        torch.cat([angles.cos()] * 2, -1)[:, None],
        torch.cat([angles.sin()] * 2, -1)[:, None],
    )
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin


@torch.no_grad()
def eagle3_rows(t: dict, embeds, hidden, eps: float, heads=4, kv=2, holes=()):
    """The EAGLE-3 layer over one sequence, from its definition: row j takes the
    token embedding ``embeds[j]`` and the hidden input ``hidden[j]``, at position
    j, causal -> its outputs g (T, hidden) (before the final norm). ``holes``:
    positions whose K and V (after rope) read as zeros (a lazy head's holes)."""
    n = embeds.shape[0]
    x = torch.cat(
        [_rms(embeds, t["midlayer.input_layernorm.weight"], eps),
         _rms(hidden, t["midlayer.hidden_norm.weight"], eps)], dim=-1,
    )  # fmt: skip
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, -1)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv, -1)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv, -1)
    pos = torch.arange(n)
    q, k = _rope(q, pos), _rope(k, pos)
    if len(holes):
        k, v = k.clone(), v.clone()
        k[list(holes)], v[list(holes)] = 0, 0
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, -1)
    r = hidden + out @ t["midlayer.self_attn.o_proj.weight"].T
    y = _rms(r, t["midlayer.post_attention_layernorm.weight"], eps)
    gate = y @ t["midlayer.mlp.gate_proj.weight"].T
    up = y @ t["midlayer.mlp.up_proj.weight"].T
    return r + (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T


def eagle3_token(t: dict, g: torch.Tensor, eps: float) -> int:
    """The head's greedy target id for one output row g (hidden,)."""
    draft = int((_rms(g, t["norm.weight"], eps) @ t["lm_head.weight"].T).argmax())
    return draft + int(t["d2t"][draft])


# -- MiMo-V2-Flash ---------------------------------------------------------------------

MIMO_PREFIX = "model.mtp.layers.0."


def mimo_mtp_block_config(config):
    """The transformers config of MiMo's MTP decoder layer: one sliding-window layer
    with a dense MLP (the released MTP layers' kind)."""
    import copy

    c = copy.deepcopy(config)
    c.layer_types, c.mlp_layer_types, c.num_hidden_layers = ["sliding_attention"], ["dense"], 1
    return c


def save_tiny_mimo_mtp(path: str, seed: int = 0):
    """A tiny transformers MiMo-V2-Flash (``test_engine_mimo.save_tiny_mimo``) saved
    to ``path`` with one MTP layer in the released layout (``model.mtp.layers.0.*``:
    enorm, hnorm, eh_proj, input_layernorm, self_attn.{q,k,v,o}_proj and
    attention_sink_bias, pre_mlp_layernorm, mlp.{gate,up,down}_proj,
    final_layernorm) and ``num_nextn_predict_layers`` 1 in config.json; returns
    (the transformers model, the MTP layer's transformers decoder layer, the MTP
    tensors by released name)."""
    import json

    import transformers as tf
    from test_engine_mimo import save_tiny_mimo

    hf = save_tiny_mimo(path, seed)
    torch.manual_seed(seed + 1)
    cfg = mimo_mtp_block_config(hf.config)
    block = tf.models.mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashDecoderLayer(cfg, 0)
    block = block.float().eval()
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    names = {"self_attn.sinks": "self_attn.attention_sink_bias",
             "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"}  # fmt: skip
    hidden = hf.config.hidden_size
    mtp = {names.get(k, k): v.detach().clone() for k, v in block.state_dict().items()}
    mtp.update({
        "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
        "final_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
    })  # fmt: skip
    tensors = _tensors(path)
    tensors.update({MIMO_PREFIX + k: v.contiguous() for k, v in mtp.items()})
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return hf, block, mtp


@torch.no_grad()
def mimo_mtp_rows(hf, block, mtp: dict, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """MiMo's MTP layer over one sequence, its decoder layer transformers' own: row j
    takes ``hidden[j]`` and token ``ids[j]`` at position j, causal within the sliding
    window -> the layer's outputs after ``final_layernorm`` (T, hidden)."""
    eps = hf.config.rms_norm_eps
    t = len(ids)
    e = hf.model.embed_tokens(torch.tensor(ids))
    x = torch.cat([_rms(e, mtp["enorm.weight"], eps), _rms(hidden, mtp["hnorm.weight"], eps)], -1)
    x = (x @ mtp["eh_proj.weight"].T)[None]
    pos = torch.arange(t)[None]
    rope = hf.model.rotary_emb(x, pos, "sliding_attention")
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    visible = (j <= i) & (j > i - hf.config.sliding_window)
    mask = torch.zeros(t, t).masked_fill(~visible, float("-inf"))[None, None]
    out = block(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)[0]
    return _rms(out, mtp["final_layernorm.weight"], eps)
