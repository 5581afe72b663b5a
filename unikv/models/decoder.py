"""The one decoder every model family runs on: ``DecoderLM``.

A family gives its layers (``make_layers``) and, optionally, hooks; the decoder
gives the rest, the same for every family:

- the embedding, inside the first layer's first GEMM where that GEMM takes its
  pre-norm (``embed_rms_norm_linear``: the gather inside the GEMV's loads at small
  batch), placeholder ids of the step's feedback buffer resolved there;
- the layer loop, each residual add fused into the next pre-norm (``RMSNorm.add``),
  or into the GEMM after it where the block has one (``RMSNorm.linear``);
- logits only for the rows sampled (``logits_indices``);
- the final norm inside the LM head's GEMM, and with ``greedy=True`` the argmax
  inside it too (written into the feedback buffer when the step has one).

A layer is a list of residual ``Block`` s, each ``x + post(body(norm(x)))``: a token
mixer (attention, gated attention, MLA, Gated DeltaNet, Mamba-2) or an MLP (dense
or MoE). The residual stream is carried beside each block's output (``h``) and added
inside the next norm, so a layer maps ``(h, residual) -> (h, residual)``.

Hooks (host values fixed at construction, never per step):

- ``scale_embedding(h)`` where ``scales_embedding`` (Gemma's sqrt(hidden), Falcon-H1's
  muP multiplier): the first GEMM then takes the embedding unfused;
- ``finish_logits(logits)`` where ``finishes_logits`` (Gemma's final soft-cap,
  Falcon-H1's LM head multiplier): the greedy argmax then runs after it (the
  backend's ``argmax``), not inside the head, since the soft-capped logits may tie;
- ``fp32_params``: parameter-name suffixes kept fp32 in every model dtype (``build``).

Tensor parallelism: a family that shards (``tensor_parallel``) passes ``tp`` to its
blocks (``models/parallel.py``); the embedding, norms and LM head are replicated.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch
from torch import nn

from unikv import env
from unikv.kernels.backend import KernelBackend, building, resolve_feedback, step_rows, stepping
from unikv.models.config import ModelConfig
from unikv.models.layers import Linear, RMSNorm
from unikv.models.parallel import check_tp_config, refuse_tp
from unikv.models.rope import Rotary


class Block:
    """One residual block of a layer: ``out = post(body(norm(h + residual)))``.

    norm: the pre-norm (an ``RMSNorm``); body: the mixer or MLP module; ``mixes``:
    the body is called ``body(x, positions, attn)`` (a token mixer), else ``body(x)``;
    post: None or a callable on the body's output (Gemma's sandwich norms, Granite's
    scale). Where the body offers ``input_linear()`` (a plain ``Linear``: q|k|v,
    gate|up), the norm runs inside that GEMM and ``body.from_input`` does the rest;
    where it is an FP8 linear (``fp8``), the norm quantises its x at the rows its
    prefill variant quantises (``RMSNorm.fp8_linear``; ``UNIKV_FP8_NORM_QUANT=0``:
    never, the A/B switch), then ``from_input``.
    A plain object: the modules are registered under the family's names by its layer.

    ``chain`` links consecutive blocks where a block's post is an RMSNorm the next
    block's pre-norm can fuse (``RMSNorm.fuses_post``): the first then returns its
    body's output un-normed (``defers``) and the next runs that post-norm, the residual
    add and its own pre-norm in one op (``before``: ``RMSNorm.sandwich``), its GEMM
    after it unfused. Host structure fixed at load, never per step."""

    __slots__ = ("before", "body", "defers", "fp8", "linear", "mixes", "norm", "post")

    def __init__(
        self, norm: RMSNorm, body: nn.Module, *, mixes: bool, post: nn.Module | None = None
    ) -> None:
        self.norm, self.body, self.post, self.mixes = norm, body, post, mixes
        self.before: RMSNorm | None = None  # the previous block's post-norm, run here
        self.defers = False  # this block's post runs in the next block (``chain``)
        self.bind()

    def bind(self) -> None:
        """Take the body's ``input_linear`` (again, after its modules were replaced):
        a plain ``nn.Linear`` (the norm reads its weight) as ``linear``, an FP8 one
        (``fuses_norm``) as ``fp8`` where ``env.FLAGS.fp8_norm_quant``, else None."""
        fused = getattr(self.body, "input_linear", None)
        linear = fused() if fused is not None else None
        self.linear = linear if isinstance(linear, nn.Linear) else None
        fp8 = env.FLAGS.fp8_norm_quant and getattr(linear, "fuses_norm", False)
        self.fp8 = linear if fp8 else None

    def __call__(self, h, residual, positions, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """h: (T, hidden), the previous block's output (the embeddings with residual
        None); residual: (T, hidden) or None -> (this block's output, the residual
        stream before it)."""
        if self.before is not None:  # (structural, ``chain``) h is the last block's body out
            x, residual = self.norm.sandwich(h, residual, self.before)
            if self.linear is not None:
                return self.after(self.linear(x), residual, positions, attn)
        elif self.linear is not None:
            y, residual = self.norm.linear(h, residual, self.linear, step_rows())
            return self.after(y, residual, positions, attn)
        elif self.fp8 is not None:  # (structural, ``bind``) the norm may quantise its x
            y, residual = self.norm.fp8_linear(h, residual, self.fp8)
            return self.after(y, residual, positions, attn)
        elif residual is None:  # the first block: a structural None, not a device branch
            residual, x = h, self.norm(h)
        else:
            x, residual = self.norm.add(h, residual)
        out = self.body(x, positions, attn) if self.mixes else self.body(x)
        return self.finish(out), residual

    def after(self, y, residual, positions, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """The block from its ``input_linear`` GEMM's output ``y`` on."""
        return self.finish(self.body.from_input(y, positions, attn)), residual

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """The body's output through ``post``, unless the next block runs it."""
        return out if self.post is None or self.defers else self.post(out)


def chain(blocks: list[Block]) -> None:
    """Link consecutive ``blocks`` (a model's, in order, across its layers): each
    post-norm the next block's pre-norm fuses (``RMSNorm.fuses_post``) moves into
    that block's ``sandwich``. The last block keeps its post (nothing follows it).
    ``UNIKV_SANDWICH_NORM=0`` (``env.FLAGS.sandwich_norm``, the A/B switch) links none."""
    for block in blocks:
        block.before, block.defers = None, False
    if not env.FLAGS.sandwich_norm:
        return
    uses = Counter(id(block) for block in blocks)  # a block shared by layers (Zamba2's) stays
    for block, nxt in itertools.pairwise(blocks):
        once = uses[id(block)] == uses[id(nxt)] == 1
        if once and block.post is not None and nxt.norm.fuses_post(block.post):
            block.defers, nxt.before = True, block.post


class DecoderLayer(nn.Module):
    """A layer of residual blocks. A family's layer registers its modules under the
    checkpoint's names and sets ``blocks`` (in order) from them."""

    blocks: list[Block]

    def forward(self, h, residual, positions, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) as ``Block``: the previous layer's last block output and the
        residual stream before it -> this layer's."""
        for block in self.blocks:
            h, residual = block(h, residual, positions, attn)
        return h, residual

    def after_input(self, y, residual, positions, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its first block's ``input_linear`` output on (the decoder's
        embedding inside that GEMM)."""
        h, residual = self.blocks[0].after(y, residual, positions, attn)
        for block in self.blocks[1:]:
            h, residual = block(h, residual, positions, attn)
        return h, residual


class Backbone(nn.Module):
    """The embedding, the layers and the final norm, under the family's names
    (``names``: the embedding's and the final norm's; the layers are ``layers``);
    ``rotary``: the rope table (a module), tables by layer type (a dict, kept out of
    the parameters) or None."""

    def __init__(
        self,
        embed: nn.Embedding,
        layers: list[nn.Module],
        norm: RMSNorm,
        rotary: nn.Module | dict | None = None,
        names: tuple[str, str] = ("embed_tokens", "norm"),
    ) -> None:
        super().__init__()
        self.names = names
        self.add_module(names[0], embed)
        if rotary is not None:
            self.rotary = rotary
        self.layers = nn.ModuleList(layers)
        self.add_module(names[1], norm)

    @property
    def embed(self) -> nn.Embedding:
        return self._modules[self.names[0]]

    @property
    def final_norm(self) -> RMSNorm:
        return self._modules[self.names[1]]

    def rotaries(self) -> list[nn.Module]:
        rotary = getattr(self, "rotary", None)
        if isinstance(rotary, dict):
            return list(rotary.values())
        return [] if rotary is None else [rotary]


def rms_backbone(
    config: ModelConfig,
    layers: list[nn.Module],
    rotary: nn.Module | None = None,
    names: tuple[str, str] = ("embed_tokens", "norm"),
) -> Backbone:
    """A Backbone over ``layers`` in the shape most families share: a plain token
    embedding and an ``RMSNorm`` at ``config.rms_norm_eps`` (made after the layers,
    the norm first)."""
    norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    return Backbone(embed, layers, norm, rotary, names)


def typed_rope_backbone(
    config: ModelConfig, max_positions: int, layer_types, make_layer, norm: RMSNorm
) -> Backbone:
    """A Backbone whose layers take one rope table per layer type (Gemma-3, MiMo):
    ``make_layer(config, i, rotary)``; the tables are kept out of the parameter names."""
    ropes, types = config.extra["rope_by_type"], config.extra["layer_types"]
    rotary = {t: Rotary(ropes[t], config.head_dim, max_positions) for t in layer_types}
    layers = [make_layer(config, i, rotary[types[i]]) for i in range(config.num_layers)]
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    return Backbone(embed, layers, norm, rotary)


class DecoderLM(nn.Module):
    """A causal LM on the shared decoder (module docstring).

    Args:
        config: the model's hyper-parameters.
        max_positions: length of the rope tables (the engine's max context).
        tp: None, or a ``models.parallel.TensorParallel`` for a family that shards
            (``tensor_parallel``); the others refuse it.
        ops: the kernel backend every module calls, fixed at construction (None: the
            enclosing ``backend.building``'s, the torch references outside any).

    A family sets ``backbone_name`` (its checkpoint's prefix, "model") and gives
    ``make_backbone``. ``logits_dtype``: the dtype ``forward`` returns logits in (fp32
    by default); None keeps lm_head's. ``resolves_feedback``: ``forward`` reads
    ``attn.feedback`` when the step has one (placeholder ids -(1 + lane) are the
    tokens there) and a greedy step writes its tokens into it.
    """

    resolves_feedback = True
    tensor_parallel = False
    backbone_name = "model"
    scales_embedding = False
    finishes_logits = False
    fp32_params: tuple[str, ...] = ()
    dense_linears = ("lm_head",)  # read as a matrix (the final norm's GEMV): never FP8

    def __init__(
        self, config: ModelConfig, max_positions: int, tp=None, *, ops: KernelBackend | None = None
    ) -> None:
        super().__init__()
        self.check(config, tp)
        self.config, self.tp = config, tp
        with building(ops):
            backbone = self.make_backbone(config, max_positions, tp)
            self.add_module(self.backbone_name, backbone)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_dtype: torch.dtype | None = torch.float32
        # (max_tokens, width) or None: every row's hidden states are copied here for a
        # speculative draft that reads them (set once, ``export_hidden``)
        self.hidden_out: torch.Tensor | None = None
        self._exports: dict[int, list[slice]] | None = None
        self.ops = backbone.final_norm.ops
        self.rebind()

    def rebind(self) -> None:
        """Re-derive what depends on the modules' kinds, after the loader replaced some
        (``fp8_linear.keep_fp8``): each block's fused GEMM, each module's own (its
        ``rebind``), and the embedding inside the first GEMM (where that GEMM takes its
        pre-norm and the embedding is not scaled first)."""
        for module in self.modules():
            for block in getattr(module, "blocks", ()):
                block.bind()
            if module is not self and hasattr(module, "rebind"):
                module.rebind()
        chain([block for layer in self.stack.layers for block in getattr(layer, "blocks", ())])
        first = self.stack.layers[0].blocks[0]
        self.embeds_in_gemm = first.linear is not None and not self.scales_embedding

    def export_hidden(self, rows: int, layers: tuple[int, ...] | None = None) -> torch.Tensor:
        """From now on every forward copies each token row's hidden state into
        ``hidden_out`` (rows, width), returned: ``layers`` None, the final hidden
        state after the final norm (an MTP draft's input); else the residual stream
        entering each of ``layers`` (``num_layers``: after the last layer, before the
        final norm), concatenated in that order (an EAGLE-3 head's input). Set before
        any CUDA graph is captured; the copies are then inside the graphs."""
        n, hidden = self.config.num_layers, self.config.hidden_size
        if layers is not None and not all(1 <= i <= n for i in layers):
            raise ValueError(f"hidden states are exported from layers 1..{n}, asked for {layers}")
        width = hidden * (1 if layers is None else len(layers))
        param = next(self.parameters())
        self.hidden_out = torch.zeros(rows, width, dtype=param.dtype, device=param.device)
        if layers is not None:
            self._exports = {}
            for j, i in enumerate(layers):
                self._exports.setdefault(i, []).append(slice(j * hidden, (j + 1) * hidden))
        return self.hidden_out

    def _export(self, index: int, h: torch.Tensor, residual: torch.Tensor) -> None:
        """The residual stream entering layer ``index`` into its ``hidden_out`` columns
        (h through the post-norm the layer's first block runs, where ``chain`` moved
        one there)."""
        layers = self.stack.layers
        blocks = getattr(layers[index], "blocks", None) if index < len(layers) else None
        before = blocks[0].before if blocks else None
        for columns in self._exports.get(index, ()):
            h_out = h if before is None else before(h)
            self.hidden_out[: h.shape[0], columns].copy_(h_out + residual)

    # -- the family's part ---------------------------------------------------------

    def check(self, config: ModelConfig, tp) -> None:
        """ValueError for what the family cannot run (before anything is built): tp
        where the family does not shard, or a tp size its head counts refuse."""
        if not self.tensor_parallel:
            refuse_tp(config, tp)
        elif tp is not None:
            check_tp_config(config, tp.size)

    def make_backbone(self, config: ModelConfig, max_positions: int, tp) -> Backbone:
        raise NotImplementedError

    @classmethod
    def tp_dims(cls, config: ModelConfig) -> dict[str, int]:
        """HF field name -> its value, for every field a tensor-parallel size must
        divide (``parallel.check_tp_config``, before any weight loads). A family that
        shards more (recurrent heads, experts, MLA heads) extends this."""
        return {
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "intermediate_size": config.intermediate_size,
        }

    def scale_embedding(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    # -- shared ----------------------------------------------------------------------

    @property
    def stack(self) -> Backbone:
        """The backbone, under ``backbone_name``."""
        return self._modules[self.backbone_name]

    def build(self, device: torch.device) -> None:
        """After ``to(dtype).to_empty``, before the weights load: the rope tables on
        ``device``; the ``fp32_params`` back to fp32."""
        for rotary in self.stack.rotaries():
            rotary.build(device)
        if self.fp32_params:
            for name, param in self.named_parameters():
                if name.endswith(self.fp32_params):
                    param.data = param.data.float()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn,
        logits_indices: torch.Tensor | None = None,
        greedy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids: (T,) int64 token ids; positions: (T,) int64; attn: the step
        object (``AttentionFn``, and ``StateFn`` / MLA ops where the family needs them);
        logits_indices: (N,) int64 rows of the step whose logits are wanted (None: all).
        Returns logits (N, vocab) in ``logits_dtype``; greedy: (logits, (N,) int64
        greedy tokens), into ``attn.feedback`` when the step has one.

        The step runs under its row plan (``attn.rows_plan``, ``kernels.backend.stepping``):
        every linear, MoE and FP8 GEMM of the layers takes it; the LM head takes
        ``attn.logit_rows_plan`` where only ``logits_indices`` rows reach it. A step object
        without them (a model test's): the ops plan by their shapes."""
        rows = getattr(attn, "rows_plan", None)
        head = rows if logits_indices is None else getattr(attn, "logit_rows_plan", None)
        with stepping(rows):
            return self._forward(input_ids, positions, attn, logits_indices, greedy, head)

    def _forward(self, input_ids, positions, attn, logits_indices, greedy, head):
        h, residual = self.run_body(input_ids, positions, attn)
        return self.run_head(h, residual, attn, logits_indices, greedy, head)

    def run_body(self, input_ids, positions, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding and the layers (and the hidden-state exports): every token
        row's (h, residual) after the last layer, before the final norm. Row-wise
        but for the step object's ops (``attn``): a prefill graph's pieces
        (``engine/prefill_graphs.py``) are this, split at those ops."""
        backbone = self.stack
        layers = backbone.layers
        feedback = getattr(attn, "feedback", None)  # placeholder ids' tokens (graphs)
        if self.embeds_in_gemm:  # the embedding inside the first GEMM's loads
            first = layers[0].blocks[0]
            y, residual = first.norm.embed_linear(
                input_ids, backbone.embed.weight, first.linear, feedback
            )
            h, residual = layers[0].after_input(y, residual, positions, attn)
            layers, start = layers[1:], 1
        else:
            h = backbone.embed(resolve_feedback(input_ids, feedback))
            if self.scales_embedding:  # a host bool of the family
                h = self.scale_embedding(h)
            residual, start = None, 0
        exports = self._exports  # host values fixed at start-up (``export_hidden``)
        for i, layer in enumerate(layers, start):
            if exports is not None and i in exports:
                self._export(i, h, residual)
            h, residual = layer(h, residual, positions, attn)
        if exports is not None:
            self._export(len(backbone.layers), h, residual)
        elif self.hidden_out is not None:
            self._export_final(h, residual)
        return h, residual

    def _export_final(self, h: torch.Tensor, residual: torch.Tensor) -> None:
        """The final hidden state after the final norm into ``hidden_out`` (an MTP
        draft's input: ``export_hidden`` with no layers)."""
        self.hidden_out[: h.shape[0]].copy_(self.stack.final_norm(h + residual))

    def run_head(self, h, residual, attn, logits_indices=None, greedy=False, head=None):
        """``forward`` from ``run_body``'s (h, residual) on: the rows ``logits_indices``
        (None: all), the final norm inside the LM head, the greedy argmax."""
        backbone = self.stack
        feedback = getattr(attn, "feedback", None)
        if logits_indices is not None:
            h, residual = (
                h.index_select(0, logits_indices),
                residual.index_select(0, logits_indices),
            )
        norm = backbone.final_norm
        if greedy and not self.finishes_logits:  # the argmax inside the head's GEMV
            out = None if feedback is None else feedback[: h.shape[0]]  # where the step reads it
            logits, tokens = norm.linear_argmax(h, residual, self.lm_head, out, head)
            return self._cast(logits), tokens
        logits, _ = norm.linear(h, residual, self.lm_head, head)
        if self.finishes_logits:
            logits = self.finish_logits(logits)
        logits = self._cast(logits)
        if not greedy:
            return logits
        tokens = self.ops.argmax(logits)
        if feedback is not None:
            tokens = feedback[: h.shape[0]].copy_(tokens)
        return logits, tokens

    def _cast(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.logits_dtype is None else logits.to(self.logits_dtype)
