"""The step objects the model calls: every layer reads the StepPlan, nothing more.

``DecodeAttention`` when every request feeds one token, ``ExtendAttention``
otherwise; the runner picks one per step from the plan. Both are the model's
``AttentionFn`` and, for recurrent layers (Gated DeltaNet, Mamba-2), its
``StateFn``: the state ops read and update each request's state slot in place
through the layer's pool views. No layer translates, allocates or branches on the
device; decode attention's launch plan is the planner's (``StepPlan.decode``).

MLA layers (DeepSeek-V2/V3) store the step's latent rows ``[c | k_rope]`` and attend
in one of two forms (the same math), chosen ONCE per step on the host
(``expands_mla``; decode steps always absorb):

- absorbed (``mla``): queries come in W_UK-absorbed (rank wide) and attend over the
  cached latent rows as one shared KV head; the model applies W_UV after.
- expanded (``mla_expanded``, extend steps): every context row of the batch is
  gathered from the layer's latent view with one index built once per step (the
  block table's rows, padded to the widest request: ``B * Lmax`` rows, no host
  sync), K_nope and V of every head come out of ONE kv_b_proj GEMM, K = [K_nope |
  k_rope], and unikv's extend kernel attends causally over a temporary dense "pool"
  of those rows (block table = the row offsets).

The rule (``mla_prefill_costs``, host ints of the plan: T new tokens, B requests,
the block table's span Lmax, max_q_len). Per head, in FLOPs, with P the attended
(query, key) pairs, estimated ``T * (Lmax - max_q_len / 2)`` (exact for equal
requests), and N = B * Lmax gathered rows:

    absorbed = S * 2P(2 rank + rope) + 2T rank (nope + v)    attention + W_UK, W_UV
    expanded = 2N rank (nope + v)    + 2P (nope + rope + v)  up-projection + attention

S = ``ABSORBED_SLOWDOWN`` = 2.5, fitted to ``benchmarks/bench_mla_prefill.py`` on the
H200 (docs/perf.md, ``benchmarks/results/mla_prefill_h200.json``; DeepSeek-V3's layer, 128
heads, bf16, both forms through unikv's kernels): the absorbed MLA kernel ran at 83-96
TFLOP/s, the expanded gather + GEMM + extend kernel at 175-225, and at 8 x (4k cached +
n new) the measured time ratio crossed 1 between n = 32 (absorbed 1.57x faster) and
64 (expanded 1.19x faster); S = 2.5 predicts 1.63x and 0.88 there (0.50 against 0.51
at n = 128) and picks the faster form on every measured shape but the launch-bound
1k fresh prefill, which it expands either way. (The first anchor, 4.5, was a 4k
prefill whose expanded attention was torch SDPA.)
Expanded runs when it costs less and its transient K/V (``N * H * (2 nope + rope +
v)`` elements) fits ``EXPANDED_MAX_BYTES``. At DeepSeek-V3 widths: expanded once
requests bring more than ~55 new tokens each over a 4k context; decodes and small
chunks over long contexts stay absorbed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unikv.engine.plan import StepPlan
from unikv.kernels.backend import KernelBackend
from unikv.layout import entry_kernel_ids


@dataclass(frozen=True)
class LayerCache:
    """Where one model layer keeps its K/V (built once at start-up).

    k: (N, H, D), v: (N, H, D) dense per-layer views of the pool indexed by
    kernel id, in the K/V dtype the attention kernels read; store_k / store_v: the
    same bytes in the storage dtype the store bit-copies into (uint8 for an fp8
    cache, else k / v themselves); window: 0 = full attention, else the sliding
    window W; soft_cap: attention logit soft-cap ``cap * tanh(x / cap)`` (0 = off,
    Gemma-2). Built by ``LayerCache.of``."""

    subpool: str
    k: torch.Tensor
    v: torch.Tensor
    store_k: torch.Tensor
    store_v: torch.Tensor
    window: int
    page_size: int
    soft_cap: float = 0.0

    @classmethod
    def of(cls, subpool, k, v, dtype, window, page_size, soft_cap=0.0) -> LayerCache:
        """From the sub-pool's storage views ``k`` / ``v`` and its spec's logical K/V
        ``dtype`` (fp8 is stored as uint8: attention reads an fp8 view)."""
        return cls(subpool, k.view(dtype), v.view(dtype), k, v, window, page_size, soft_cap)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """The step's K or V rows as the cache holds them: unchanged in the model
        dtype, or fp8 with scale 1, clamped to the format's finite range (no NaN from
        overflow)."""
        if x.dtype == self.k.dtype:
            return x
        bound = torch.finfo(self.k.dtype).max
        return x.clamp(-bound, bound).to(self.k.dtype)


@dataclass(frozen=True)
class MLALayerCache:
    """Where one MLA model layer keeps its latent rows (built once at start-up).

    latent: (N, kv_lora_rank + rope) dense per-layer view of the MLA sub-pool
    indexed by kernel id; V is its first kv_lora_rank columns."""

    subpool: str
    latent: torch.Tensor
    page_size: int


# decode steps rotate and store inside the attention's launch (a settled A/B, no longer
# a switch: docs/history.md, "one request, eleventh session")
ABSORBED_SLOWDOWN = 2.5  # per FLOP, absorbed MLA attention vs expanded GEMM + attention
EXPANDED_MAX_BYTES = 8 << 30  # transient K/V of one expanded layer at most
MLA_FORMS = ("absorbed", "expanded")


def mla_prefill_costs(
    *, num_tokens: int, num_rows: int, max_q_len: int, max_len: int,
    heads: int, rank: int, rope: int, nope: int, v_dim: int,
) -> tuple[float, float]:  # fmt: skip
    """(absorbed, expanded) cost of one MLA layer's step, in absorbed-kernel-equivalent
    FLOPs (the module docstring's rule). Host ints: num_tokens T, num_rows N = B *
    Lmax (the rows the expanded form gathers), max_q_len, max_len Lmax."""
    pairs = max(num_tokens * (max_len - max_q_len / 2), num_tokens)
    absorbed = ABSORBED_SLOWDOWN * 2 * pairs * (2 * rank + rope)
    absorbed += 2 * num_tokens * rank * (nope + v_dim)
    expanded = 2 * num_rows * rank * (nope + v_dim) + 2 * pairs * (nope + rope + v_dim)
    return heads * absorbed, heads * expanded


@dataclass(frozen=True)
class MLAContext:
    """One step's expanded-form gather over an MLA sub-pool (built once per step).

    row_ids: (B * Lmax,) int64 kernel ids (rows of every layer's latent view) of each
    request's context positions 0..Lmax-1, request-major (rows past a request's
    seq_len are read, clamped into the view, but never attended); block_table:
    (B, Lmax / ps) int32 entries of the temporary dense K/V rows (request b's
    position i is row b * Lmax + i)."""

    row_ids: torch.Tensor
    block_table: torch.Tensor
    page_size: int

    @classmethod
    def of(cls, block_table: torch.Tensor, page_size: int, num_rows: int) -> MLAContext:
        """From the sub-pool's (B, P) int32 block table of kernel page entries and
        the rows of its latent views."""
        bsz, pages = block_table.shape
        slots = torch.arange(page_size, device=block_table.device)
        row_ids = entry_kernel_ids(block_table.long()[:, :, None], slots, page_size).view(-1)
        row_ids.clamp_(0, num_rows - 1)
        table = torch.arange(bsz * pages, dtype=torch.int32, device=block_table.device)
        return cls(row_ids, table.view(bsz, pages), page_size)


@dataclass(frozen=True)
class LayerState:
    """Where one recurrent model layer keeps its state (built once at start-up).

    conv: (S, C, K) and temporal: (S, *shape) per-layer views of the Mamba
    sub-pool, indexed by physical state slot; temporal None for a conv-only slot
    (LFM2's short convolutions)."""

    conv: torch.Tensor
    temporal: torch.Tensor | None


class DecodeAttention:
    """AttentionFn and StateFn of a decode step: one query per request (q rows =
    requests). ``layers[i]`` / ``states[i]``: model layer i's K/V cache or
    recurrent state (None where the layer has none). ``feedback``: the plan's buffer
    of the previous step's tokens (``StepPlan.feedback``), or None."""

    def __init__(
        self,
        layers: list[LayerCache | None],
        plan: StepPlan,
        backend: KernelBackend,
        sm_scale: float,
        states: list[LayerState | None] | None = None,
    ):
        self.layers, self.plan, self.backend, self.sm_scale = layers, plan, backend, sm_scale
        self.states = states
        self.feedback = getattr(plan, "feedback", None)  # (a test's plan may lack it)
        # a verify step's per-draft-position state slots (B, k), else None
        self.draft_slots = getattr(plan, "draft_slots", None)
        # per request a second destination of its final state (B,), else None: a
        # prefill chunk that ends at a prefix-cache checkpoint writes it there too (with
        # ``ckpt_at``: the state after that row, a checkpoint inside the chunk; the scans
        # also take fla-core's split of the lanes at those rows)
        self.ckpt, self.scan_ckpt = {}, {}
        if getattr(plan, "ckpt_slots", None) is not None:
            self.ckpt = {"ckpt_slots": plan.ckpt_slots}
            if getattr(plan, "ckpt_at", None) is not None:
                self.ckpt["ckpt_at"] = plan.ckpt_at
            self.scan_ckpt = dict(self.ckpt)
            if getattr(plan, "ckpt_split", None) is not None:
                self.scan_ckpt["ckpt_split"] = plan.ckpt_split
        # a chunked step's q_indptr in int64 and fla-core's chunk list (the plan's, on
        # CUDA with fla-core: ``StepPlan.state_chunks``), else the plan's q_indptr
        indptr = getattr(plan, "state_indptr", None)
        self.state_indptr = getattr(plan, "q_indptr", None) if indptr is None else indptr
        self.state_chunks = getattr(plan, "state_chunks", None)
        # the row-shaped ops' plans (the decoder runs the step under ``rows_plan``, the LM
        # head under ``logit_rows_plan``; the runner replaces it where it asks more rows)
        self.rows_plan = getattr(plan, "rows", None)
        self.logit_rows_plan = getattr(plan, "logit_rows", None)

    # -- recurrent state (StateFn) ----------------------------------------------------

    def causal_conv1d(self, layer, x, weight, bias, activation):
        """x: (T, C) -> (T, C); the layer's conv state continues in its slot."""
        plan = self.plan
        return self.backend.causal_conv1d(
            x,
            self.states[layer].conv,
            plan.state_slots,
            plan.q_indptr,
            weight,
            bias,
            max_q_len=plan.max_q_len,
            activation=activation,
            draft_slots=self.draft_slots,
            **self.ckpt,
        )

    def gated_delta_rule(self, layer, q, k, v, g, beta, *, scale, use_qk_l2norm, gating=None):
        """q, k: (T, Hk, Dk), v: (T, H, Dv), g, beta: (T, H) (raw a, b with ``gating``)
        -> (T, H, Dv)."""
        plan = self.plan
        state = self.states[layer].temporal
        return self.backend.gated_delta_rule(
            q, k, v, g, beta, state, plan.state_slots, self.state_indptr,
            max_q_len=plan.max_q_len, scale=scale, use_qk_l2norm=use_qk_l2norm, gating=gating,
            draft_slots=self.draft_slots, chunks=self.state_chunks,
            **self.scan_ckpt,
        )  # fmt: skip

    def mamba2_ssd(self, layer, x, dt, A, B, C, D, dt_bias, *, dt_softplus, dt_limit):
        """x: (T, H, P), dt: (T, H), B, C: (T, G, N) -> (T, H, P)."""
        plan = self.plan
        state = self.states[layer].temporal
        return self.backend.mamba2_ssd(
            x, dt, A, B, C, D, dt_bias, state, plan.state_slots, self.state_indptr,
            max_q_len=plan.max_q_len, dt_softplus=dt_softplus, dt_limit=dt_limit,
            draft_slots=self.draft_slots,
            **self.scan_ckpt,
        )  # fmt: skip

    # -- multi-head latent attention (DeepSeek-V2/V3) ---------------------------------

    def expands_mla(self, layer, *, heads, rank, rope, nope, v_dim) -> bool:
        """Whether this step's MLA layers run ``mla_expanded`` (host bool): never
        for a decode step."""
        return False

    def _store_mla(self, layer, latent, rope):
        cache = self.layers[layer]
        step = self.plan.subpools[cache.subpool]
        self.backend.store_mla(cache.latent, step.write_ids.data, latent, rope)
        return cache, step

    def mla(self, layer, q_latent, q_rope, latent, rope, sm_scale):
        """Store this step's latent rows of MLA ``layer`` and attend over them in the
        absorbed form. q_latent: (T, H, rank), q_rope: (T, H, rope); latent: (T, rank)
        (normalised c), rope: (T, rope) (rotated k_rope) -> (T, H, rank). A decode step
        stores inside the attention's launch (``store_mla_attention``)."""
        cache, plan = self.layers[layer], self.plan
        step = plan.subpools[cache.subpool]
        return self.backend.store_mla_attention(
            cache.latent, step.write_ids.data, q_latent, q_rope, latent, rope,
            step.block_table, plan.q_indptr, plan.seq_lens, max_q_len=plan.max_q_len,
            page_size=cache.page_size, sm_scale=sm_scale,
        )  # fmt: skip

    # -- attention (AttentionFn) ------------------------------------------------------

    fuses_rope = True  # __call__ takes rope=(rotary, positions): one launch rotates and stores

    def _store(self, layer: int, q, k: torch.Tensor, v: torch.Tensor, rope=None):
        """Write the step's new K/V rows of ``layer`` at its sub-pool's write ids,
        rotating q and k first when ``rope`` = (a ``models.rope.Rotary``, positions)
        is given (one launch, ``rope_store_kv``, unless the cache is fp8: that
        rounds the rotated rows, so it rotates, then quantises and stores). Returns
        the layer's cache, its sub-pool's step metadata and the (rotated) q and k."""
        cache = self.layers[layer]
        step = self.plan.subpools[cache.subpool]
        ids = step.write_ids.data
        if rope is not None:
            rotary, positions = rope
            if cache.store_k.dtype == k.dtype:
                q, k = self.backend.rope_store_kv(
                    cache.store_k, cache.store_v, ids, q, k, v, rotary.cos, rotary.sin, positions
                )
                return cache, step, q, k
            q, k = rotary(positions, q, k)
        kq, vq = cache.quantize(k), cache.quantize(v)  # fp8: bit-copied into the uint8 bytes
        self.backend.store_kv(cache.store_k, cache.store_v, ids, kq, vq)
        return cache, step, q, k

    def __call__(self, layer, q, k, v, sinks=None, rope=None):
        """q: (B, Hq, D), k/v: (B, H, D) -> (B, Hq, D); rope: None (q and k come
        rotated, or take no rope) or (rotary, positions) to rotate them here. The K/V
        store runs inside the attention's launch (``rope_store_decode_attention``,
        ``store_decode_attention``) unless the cache is fp8."""
        cache = self.layers[layer]
        launch = self.plan.decode[cache.subpool].launch  # splits, workspace: once per step
        kw = {"page_size": cache.page_size, "sm_scale": self.sm_scale, "window": cache.window,
              "sinks": sinks, "soft_cap": cache.soft_cap, **launch}  # fmt: skip
        if cache.store_k.dtype == k.dtype:
            step = self.plan.subpools[cache.subpool]
            if rope is None:
                return self.backend.store_decode_attention(
                    cache.k, cache.v, step.write_ids.data, q, k, v, step.block_table,
                    self.plan.seq_lens, **kw,
                )  # fmt: skip
            rotary, positions = rope
            return self.backend.rope_store_decode_attention(
                cache.k, cache.v, step.write_ids.data, q, k, v, rotary.cos, rotary.sin,
                positions, step.block_table, self.plan.seq_lens, **kw,
            )  # fmt: skip
        cache, step, q, k = self._store(layer, q, k, v, rope)
        return self.backend.decode_attention(
            q, cache.k, cache.v, step.block_table, self.plan.seq_lens, **kw
        )


class ExtendAttention(DecodeAttention):
    """AttentionFn of a step with ragged new tokens (prefill chunks, mixed with decodes).

    mla_form: None (MLA layers take the cheaper form by ``mla_prefill_costs``),
    "absorbed" or "expanded" (forced: tests and benchmarks); once the first MLA
    layer asked, it holds the step's form."""

    def __init__(self, layers, plan, backend, sm_scale, states=None, *, mla_form=None):
        super().__init__(layers, plan, backend, sm_scale, states)
        if mla_form not in (None, *MLA_FORMS):
            raise ValueError(f"mla_form must be None or one of {MLA_FORMS}, got {mla_form!r}")
        self.mla_form = mla_form
        self._mla_contexts: dict[str, MLAContext] = {}

    def expands_mla(self, layer, *, heads, rank, rope, nope, v_dim) -> bool:
        """Decided on the first MLA layer's call from host ints (shapes of the plan and
        the model's MLA widths), then kept for every layer of the step."""
        if self.mla_form is None:
            cache, plan = self.layers[layer], self.plan
            table = plan.subpools[cache.subpool].block_table
            num_rows = table.shape[0] * table.shape[1] * cache.page_size
            absorbed, expanded = mla_prefill_costs(
                num_tokens=plan.input_ids.shape[0], num_rows=num_rows,
                max_q_len=plan.max_q_len, max_len=table.shape[1] * cache.page_size,
                heads=heads, rank=rank, rope=rope, nope=nope, v_dim=v_dim,
            )  # fmt: skip
            nbytes = num_rows * heads * (2 * nope + rope + v_dim) * cache.latent.element_size()
            cheaper = expanded < absorbed and nbytes <= EXPANDED_MAX_BYTES
            self.mla_form = MLA_FORMS[cheaper]
        return self.mla_form == "expanded"

    def mla_expanded(self, layer, q, latent, rope, kv_b_weight, sm_scale):
        """Store this step's latent rows of MLA ``layer``, then attend in the expanded
        form over every request's context (module docstring). q: (T, H, nope + rope)
        (q_nope | rotated q_rope); latent: (T, rank), rope: (T, rope); kv_b_weight:
        (H * (nope + v), rank), kv_b_proj's weight -> (T, H, v) in q's dtype."""
        cache, step = self._store_mla(layer, latent, rope)
        ctx = self._mla_contexts.get(cache.subpool)
        if ctx is None:  # one gather index per step and sub-pool, shared by the layers
            ctx = self._mla_contexts[cache.subpool] = MLAContext.of(
                step.block_table, cache.page_size, cache.latent.shape[0]
            )
        rank, heads, nope = latent.shape[1], q.shape[1], q.shape[2] - rope.shape[1]
        rows = cache.latent.index_select(0, ctx.row_ids).to(q.dtype)  # (N, rank + rope)
        kv = F.linear(rows[:, :rank], kv_b_weight).view(rows.shape[0], heads, -1)  # (N, H, nope+v)
        k_rope = rows[:, None, rank:].expand(-1, heads, -1)  # (N, H, rope), one shared head
        k = torch.cat([kv[..., :nope], k_rope], dim=-1)  # (N, H, nope + rope)
        plan = self.plan
        return self.backend.extend_attention(
            q, k, kv[..., nope:], ctx.block_table, plan.q_indptr, plan.seq_lens,
            max_q_len=plan.max_q_len, page_size=ctx.page_size, sm_scale=sm_scale,
        )  # fmt: skip

    def __call__(self, layer, q, k, v, sinks=None, rope=None):
        """q: (T, Hq, D), k/v: (T, H, D) -> (T, Hq, D); rope as in DecodeAttention."""
        cache, step, q, k = self._store(layer, q, k, v, rope)
        plan = self.plan
        # a fresh prompt's rows are the ones just stored (an fp8 cache rounds them: read it)
        own = cache.k.dtype == q.dtype
        kw = {"page_size": cache.page_size, "sm_scale": self.sm_scale, "window": cache.window,
              "sinks": sinks, "soft_cap": cache.soft_cap}  # fmt: skip
        split = plan.split if own else None
        # the fresh prompts' variant (Gluon kernel, SDPA) for their length: the step's plan
        extend = getattr(plan, "extend", None)  # (a test's plan may lack it)
        fresh_kw = extend[cache.subpool].launch if extend else {}
        if split is None:
            if not (plan.fresh and own):
                return self.backend.extend_attention(
                    q, cache.k, cache.v, step.block_table, plan.q_indptr, plan.seq_lens,
                    max_q_len=plan.max_q_len, **kw,
                )  # fmt: skip
            return self.backend.extend_attention(
                q, cache.k, cache.v, step.block_table, plan.q_indptr, plan.seq_lens,
                max_q_len=plan.max_q_len, fresh_kv=(k, v), **kw, **fresh_kw,
            )  # fmt: skip
        # two parts: requests with a cached prefix through the block table, then the
        # fresh prompts (the last requests) over their own rows, into one output
        first, row = split.first, split.row
        out = q.new_empty(q.shape[0], q.shape[1], cache.v.shape[-1])
        self.backend.extend_attention(
            q[:row], cache.k, cache.v, step.block_table[:first], plan.q_indptr[: first + 1],
            plan.seq_lens[:first], max_q_len=split.max_q_cached, out=out[:row], **kw,
        )  # fmt: skip
        self.backend.extend_attention(
            q[row:], cache.k, cache.v, step.block_table[first:], split.q_indptr,
            plan.seq_lens[first:], max_q_len=split.max_q_fresh, out=out[row:],
            fresh_kv=(k[row:], v[row:]), **kw, **fresh_kw,
        )  # fmt: skip
        return out
