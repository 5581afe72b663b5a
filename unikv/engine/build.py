"""The engine's only wiring: ``build_engine(config)`` makes every piece from an
``EngineConfig`` and hands them back as one ``Engine``.

Construction decides everything once: device and dtype, ONE kernel backend
(Triton on CUDA, torch references on CPU) handed to the pool, the allocator and
the runner, the unified pool sized from a memory budget (full-attention and SWA
sub-pools share its bytes), the allocator, the runner (its step planner and, on
CUDA, the decode CUDA graphs and warmed GEMMs) and the scheduler, which writes
decode steps' tables into the planner's buffers. ``LLM`` (the user API), the
engine loop, the tensor-parallel workers and ``unikv serve``'s engine process all
start from here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from unikv.engine.budget import (
    addressable_bytes,
    kv_budget_bytes,
    one_request_bytes,
    size_after_capture,
)
from unikv.engine.config import EngineConfig
from unikv.engine.options import (
    check_dtypes,
    check_prefix_host_bytes,
    check_swap,
    fp8_kv_configs,
    merged_eos,
    model_dir_of,
    prefix_caching_for,
)
from unikv.engine.runner import ModelRunner
from unikv.engine.scheduler import Scheduler
from unikv.engine.warmup import warm_linears, warm_sampling
from unikv.env import FLAGS
from unikv.hf_config import specs_from_hf_config
from unikv.kernels import get_backend
from unikv.kernels.runtime.widths import fit_backend
from unikv.models.loader import load_model, load_model_config, load_tokenizer
from unikv.models.moe import DENSE_MAX_TOKENS
from unikv.pool import UnifiedPool

# speculative verify steps of up to this many requests run under CUDA graphs
# (UNIKV_VERIFY_GRAPH_ROWS, fixed at import: 0 runs them eagerly, the A/B switch)
VERIFY_GRAPH_ROWS = FLAGS.verify_graph_rows


@dataclass(eq=False)
class Engine:
    """One built engine: its config and every piece made from it. The engine loop,
    the request maker and the serving layer take this (never the ``LLM``)."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype | None
    model_config: object  # unikv.models' ModelConfig
    model: torch.nn.Module
    tokenizer: object  # None without tokenizer files
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    tp: object  # unikv.models.parallel.TensorParallel, or None
    backend: object
    pool: UnifiedPool
    alloc: object  # unikv.allocator.PoolAllocator
    runner: ModelRunner
    scheduler: Scheduler
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def speculative_config(self):
        return self.config.speculative_config

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (``enable_prefix_caching`` resolved)."""
        return self.scheduler.prefix.enabled

    # the loop's thread runs these between two steps (a TP rank 0 mirrors them by name)
    def reset_prefix_now(self) -> None:
        self.alloc.prefix.reset()

    def resize_now(self, total_bytes: int) -> int:
        return self.alloc.resize(total_bytes)


def build_engine(config: EngineConfig, tp_group=None, backing=None) -> Engine:
    """Every piece of an engine for ``config``; ``tp_group``: None (one process), or
    the torch.distributed group this rank shares the model with (its shard, its pool);
    ``backing``: None, or the ``backing.Backing`` (not yet reserved) an elastic pool
    reserves its range in (``MultiLLM`` hands each model a ``SliceBacking``)."""
    from unikv.allocator import PoolAllocator
    from unikv.engine.speculative.config import check_speculation, draft_state_slots
    from unikv.models.parallel import TensorParallel, shard_subpool_configs

    c = config
    model_dir = model_dir_of(c.model, None)
    device = c.device
    dtype, kv_cache_dtype = check_dtypes(c.dtype, c.kv_cache_dtype, device)
    model_config, hf_config = load_model_config(model_dir)
    limit = model_config.max_position_embeddings
    if c.max_model_len is not None and not 1 < c.max_model_len <= limit:
        raise ValueError(
            f"max_model_len must be in [2, {limit}] (the model's context), got {c.max_model_len}"
        )
    max_model_len = c.max_model_len or limit
    tp = TensorParallel(tp_group) if tp_group is not None else None
    model = load_model(model_dir, device=device, dtype=dtype, max_positions=max_model_len, tp=tp,
                       kernels=c.backend)  # the elementwise ops of the same backend as below  # fmt: skip
    if hasattr(model, "logits_dtype"):  # greedy argmax without an fp32 vocab copy
        model.logits_dtype = None
    tokenizer = load_tokenizer(model_dir)
    configs = specs_from_hf_config(hf_config, page_size=c.page_size, dtype=dtype)
    configs = fp8_kv_configs(configs, kv_cache_dtype)
    if tp is not None:  # each rank caches its own KV heads and recurrent heads
        configs = shard_subpool_configs(configs, tp.size, model_config.state_dims)
    check_speculation(c.speculative_config, configs, tp_group)
    state_slots = 1 + draft_state_slots(c.speculative_config, configs)  # Mamba, per request
    draft = _Draft.load(c, model_config, max_model_len, dtype, configs, model, model_dir, hf_config)
    if draft.head is not None:  # every row's hidden states, copied by the target's forward
        rows = max(c.max_num_batched_tokens, c.max_num_seqs)  # (in its graphs too: set
        model.export_hidden(rows, draft.head.export_layers)  # before they are captured)
    configs = configs + draft.configs  # its sub-pools join
    caching = prefix_caching_for(c.enable_prefix_caching, configs, model_config.family)
    check_prefix_host_bytes(c.prefix_host_bytes, caching, configs)
    check_swap(c.preemption, c.swap_host_bytes, configs, tp_group)
    # the kernels' width and alignment rules, once: torch ops where Triton cannot
    # take a width, a ValueError naming the field where nothing can (kernels/runtime/widths.py)
    backend = fit_backend(get_backend(device, c.backend), configs, model_config)
    total, max_bytes = _pool_bytes(c, configs, model, device, max_model_len, tp, state_slots)
    if backing is not None and max_bytes is None:
        raise ValueError("kv_backing needs an elastic pool: pass kv_cache_max_bytes too")
    pool = UnifiedPool(
        configs,
        total,
        device,
        max_request_tokens=max_model_len,
        chunk_tokens=c.max_num_batched_tokens,
        state_slots=state_slots,  # k per-draft-position slots when speculating
        backend=backend,
        static_split=c.static_split,  # validated by the pool (unikv.static_split)
        max_bytes=max_bytes,  # validated by the pool
        backing=backing,  # None: the device's own
    )
    alloc = PoolAllocator(pool, max_requests=c.max_num_seqs, max_context=max_model_len,
                          debug=c.debug, backend=backend)  # fmt: skip
    prefill_rate = _prefill_tokens_per_s(model, device)
    if c.prefix_host_bytes:
        _enable_prefix_host(alloc, c.prefix_host_bytes, device, prefill_rate)
    use_graphs = device.type == "cuda" and tp is None
    if c.prefill_graphs and tp is not None:
        raise ValueError(
            "prefill_graphs is not yet tried under tensor parallelism: run with "
            "prefill_graphs=False (--no-prefill-graphs)"
        )
    stash = _hidden_stash(c, draft, model)  # (the decode graphs write it: before capture)
    runner = ModelRunner(
        model,
        pool,
        alloc,
        backend,
        max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        cuda_graphs=use_graphs if c.cuda_graphs is None else c.cuda_graphs,
        max_graph_batch=min(c.max_num_seqs, DENSE_MAX_TOKENS),  # MoE stays sync-free
        q_per_kv_of={d.name: draft.q_per_kv for d in draft.configs},
        prefill_graphs=c.prefill_graphs,
        prefill_graph_tokens=c.prefill_graph_tokens,
        hidden_stash=stash,
    )
    if device.type == "cuda":  # load and compile the step's kernels now (warmup.py)
        warm_linears(model, max_logit_rows=c.max_num_seqs, max_tokens=c.max_num_batched_tokens)
        warm_sampling(backend, model, rows=c.max_num_seqs)
    if c.kv_cache_margin_bytes is not None:  # what the graphs and warm-ups left, measured
        torch.cuda.synchronize(device)
        free = torch.cuda.mem_get_info(device)[0]
        alloc.resize(size_after_capture(pool, free, c.kv_cache_margin_bytes))
    chunk = c.max_num_batched_tokens
    rule = _checkpoint_rule(pool, device, model, chunk, prefill_rate, tp) if caching else None
    scheduler = Scheduler(
        alloc,
        pool.subpools.values(),
        max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        max_prefill_tokens_decoding=c.max_prefill_tokens_decoding,
        tables=runner.planner.tables,  # decode_step writes the planner's buffers
        prefix_caching=caching,
        swap=_swap_space(alloc, c.swap_host_bytes, c.preemption, device, prefill_rate),
        speculator=_speculator(c, runner, pool, backend, draft),
        checkpoint_rule=rule,
    )
    if runner.draft is not None and scheduler.has_state and scheduler.prefix.enabled:
        runner.draft.lazy_ok = False  # a hybrid's cache shares pages decodes complete
    return Engine(config=c, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                  model_config=model_config, model=model, tokenizer=tokenizer,
                  eos_token_ids=merged_eos(model_config, model_dir, tokenizer),
                  max_model_len=max_model_len, tp=tp, backend=backend, pool=pool, alloc=alloc,
                  runner=runner, scheduler=scheduler)  # fmt: skip


def _pool_bytes(c: EngineConfig, configs, model, device, max_model_len: int, tp, state_slots=1):
    """(the pool's starting bytes, its most bytes or None for a fixed pool);
    ``state_slots``: Mamba slots per request (1 + k when speculating)."""
    kv_cache_bytes, max_bytes = c.kv_cache_bytes, c.kv_cache_max_bytes
    if c.kv_cache_margin_bytes is not None:  # sized after capture (issue 44 item 2)
        kv_cache_bytes = one_request_bytes(
            configs, max_model_len, c.max_num_batched_tokens, state_slots
        )
        if max_bytes is None:  # the GPU's memory, as far as kernel ids reach
            device_bytes = torch.cuda.mem_get_info(device)[1]
            max_bytes = min(device_bytes, addressable_bytes(configs))
    total = kv_cache_bytes or kv_budget_bytes(
        configs,
        model,
        device,
        max_num_seqs=c.max_num_seqs,
        max_model_len=max_model_len,
        chunk=c.max_num_batched_tokens,
        memory_fraction=c.memory_fraction,
        state_slots=state_slots,
    )
    if tp is not None:  # one pool geometry on every rank: identical schedules
        total = tp.min_int(total, device)
    if max_bytes is not None and (c.swap_host_bytes or c.prefix_host_bytes or tp):
        raise ValueError(  # host tiers keep (num_pages, page_bytes) row views; TP ranks
            "kv_cache_max_bytes (an elastic pool) does not yet combine with "  # resize alike
            "swap_host_bytes, prefix_host_bytes or tp_group"
        )
    if max_bytes is not None and kv_cache_bytes is None:  # the default, capped
        total = min(total, max_bytes)
    return total, max_bytes


def _prefill_tokens_per_s(model, device) -> float:
    """A prefill estimate of 2 FLOPs per weight per token at a sustained rate."""
    weights = sum(p.numel() for p in model.parameters())
    flops = 3e14 if device.type == "cuda" else 3e10  # sustained, roughly
    return flops / max(2 * weights, 1)


def _enable_prefix_host(alloc, host_bytes: int, device, prefill_rate: float) -> None:
    """The prefix cache's host tier, its reload rule from the measured H2D bandwidth
    and the prefill estimate."""
    from unikv.io.prefix_host import ReloadPolicy
    from unikv.io.prefix_host_setup import enable_prefix_host, measure_h2d_bytes_per_s

    policy = ReloadPolicy(
        h2d_bytes_per_s=measure_h2d_bytes_per_s(device), prefill_tokens_per_s=prefill_rate
    )
    enable_prefix_host(alloc, host_bytes, policy)


def _checkpoint_rule(pool, device, model, chunk: int, prefill_rate: float, tp=None):
    """The decode-checkpoint cost rule of a hybrid's prefix cache, its state-slot
    copy time and recompute rate measured once (``engine/checkpoint_rule.py``; CPU:
    ``prefill_rate``, the estimate); None without state. Under tensor parallelism
    every rank takes the slowest rank's figures: the rule steers the schedule, which
    must be one on every rank."""
    from unikv.engine.checkpoint_rule import (
        CheckpointRule,
        measure_copy_s,
        measure_prefill_tokens_per_s,
        state_tokens,
    )

    configs = list(pool.subpools.values())  # each with its spec and page size
    slot = [c.page_bytes for c in configs if c.spec.kind == "mamba"]
    if not slot:
        return None
    rate = measure_prefill_tokens_per_s(model, device, chunk, prefill_rate)
    copy_s = measure_copy_s(device, max(slot))
    if tp is not None:  # integers over the group: tokens/s, and copy nanoseconds
        rate = float(tp.min_int(int(rate), device))
        copy_s = -tp.min_int(-round(copy_s * 1e9), device) / 1e9
    return CheckpointRule(copy_s=copy_s, prefill_tokens_per_s=rate,
                          state_tokens=state_tokens(configs))  # fmt: skip


def _swap_space(alloc, host_bytes: int, preemption: str, device, prefill_rate: float):
    """The host slots preempted requests swap into (None: recompute only), with
    the measured pinned-copy bandwidths in its cost rule."""
    from unikv.io.prefix_host_setup import measure_h2d_bytes_per_s
    from unikv.io.swap import SwapPolicy, build_swap_space

    if not host_bytes or preemption == "recompute":
        return None
    policy = SwapPolicy(
        preemption,
        d2h_bytes_per_s=measure_h2d_bytes_per_s(device, to_device=False),
        h2d_bytes_per_s=measure_h2d_bytes_per_s(device),
        prefill_tokens_per_s=prefill_rate,
    )
    return build_swap_space(alloc, host_bytes, policy)


@dataclass
class _Draft:
    """A draft model (speculative method "draft_model") or a draft head over the
    target's hidden states ("mtp", "eagle3"), its sub-pool configs and its query
    heads per KV head; empty otherwise."""

    configs: list
    model: object = None
    q_per_kv: int = 1
    head: object = None  # models.mtp.MTPLayer / models.eagle3.Eagle3Head

    @classmethod
    def load(
        cls, c: EngineConfig, target, max_model_len: int, dtype, configs, model=None,
        model_dir=None, hf_config=None,
    ) -> _Draft:  # fmt: skip
        """Checks the draft's vocabulary and context against the target's and loads it
        (before the pool is sized from the memory left)."""
        from unikv.engine.speculative.draft import draft_subpool_configs

        spec = c.speculative_config
        if spec is not None and spec.method in ("mtp", "eagle3"):
            return cls._head(c, target, max_model_len, dtype, configs, model, model_dir, hf_config)
        if spec is None or spec.method != "draft_model":
            return cls([])
        draft, _ = load_model_config(spec.model)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config: the draft model's vocabulary ({draft.vocab_size}) must "
                f"be the target's ({target.vocab_size})"
            )
        if draft.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config: the draft model's context ({draft.max_position_embeddings})"
                f" is shorter than max_model_len ({max_model_len}); lower max_model_len"
            )
        out = draft_subpool_configs(spec.model, configs, c.page_size, dtype)
        model = load_model(spec.model, device=c.device, dtype=dtype,
                           max_positions=max_model_len, kernels=c.backend)  # fmt: skip
        if hasattr(model, "logits_dtype"):  # argmax drafts, no fp32 vocab copy
            model.logits_dtype = None
        return cls(out, model, draft.num_heads // draft.num_kv_heads)

    @classmethod
    def _head(cls, c, target, max_model_len, dtype, configs, model, model_dir, hf_config):
        """Method "mtp": the checkpoint's MTP layer (``models/mtp.py``; a family without
        a known layout, or a checkpoint without the layer's tensors, is refused by
        name); "eagle3": the head at ``model`` (``models/eagle3.py``). Their K/V: one
        ``draft_*`` sub-pool (``speculative/mtp.py``)."""
        from unikv.engine.speculative.mtp import eagle3_subpool_configs, mtp_subpool_configs
        from unikv.models.eagle3 import load_eagle3
        from unikv.models.fp8 import fp8_format
        from unikv.models.mtp import load_mtp

        spec = c.speculative_config
        if spec.method == "mtp":
            head = load_mtp(model_dir, model, fp8_format(hf_config))
            out = mtp_subpool_configs(configs, head.cache_kind)
            return cls(out, None, target.num_heads // target.num_kv_heads, head)
        head = load_eagle3(spec.model, model, max_model_len)
        return cls(
            eagle3_subpool_configs(head, configs, c.page_size, dtype), None, head.q_per_kv, head
        )


def _hidden_stash(c: EngineConfig, draft: _Draft, model):
    """A draft head's stash for its lazy steps past the batch-size rule, where the
    rule may apply (``speculative/stash.py``), else None."""
    spec_config = c.speculative_config
    if draft.head is None or spec_config.disable_by_batch_size >= c.max_num_seqs:
        return None
    from unikv.engine.speculative.stash import HiddenStash

    return HiddenStash(model.hidden_out, c.max_num_seqs + 1)  # + 1: padded lanes' slot


def _speculator(c: EngineConfig, runner, pool, backend, draft: _Draft):
    """The scheduler's speculation hook (None without ``speculative_config``), and
    a draft model over its sub-pools (method "draft_model")."""
    from unikv.engine.runner import check_soft_cap, layer_caches
    from unikv.engine.speculative.draft import DraftModel
    from unikv.engine.speculative.engine import Speculator

    spec_config = c.speculative_config
    if spec_config is None:
        return None
    runner.force_accept = spec_config.force_accept  # benchmarks only
    spec = Speculator(spec_config, c.max_num_batched_tokens)
    if draft.head is not None:  # mtp / eagle3: a head over the target's hidden states
        from unikv.engine.speculative.mtp import HiddenDraft

        caches, _ = layer_caches(pool, 1, 0.0, draft=True)
        spec.draft = runner.draft = HiddenDraft(
            runner.model, draft.head, caches, runner.planner, backend, draft.head.sm_scale,
            runner.planner.max_seqs,
        )  # fmt: skip
        if runner.hidden_stash is not None:  # the rule may apply: lazy
            spec.draft.enable_lazy(spec.within_rule, runner.hidden_stash, counters=spec.counters)
        k = spec_config.num_speculative_tokens  # its chain: one plan, a graph per lane count
        chain_rows = min(VERIFY_GRAPH_ROWS, spec_config.disable_by_batch_size,
                         runner.planner.max_seqs, DENSE_MAX_TOKENS // k)  # fmt: skip
        graphed = runner.graphs is not None and chain_rows >= 1
        spec.draft.enable_chain(k, chain_rows if graphed else 0, capture=graphed)
    if spec_config.method == "draft_model":
        model = draft.model  # loaded with its sub-pools' configs
        cap = check_soft_cap(backend, model.config.extra.get("attn_soft_cap", 0.0))
        caches, _ = layer_caches(pool, model.config.num_layers, cap, draft=True)
        spec.draft = runner.draft = DraftModel(
            model, caches, runner.planner, backend, model.config.sm_scale
        )
        spec.draft.rule = spec.within_rule  # past the rule: lazy (``DraftModel.lazy``)
    if runner.graphs is not None and VERIFY_GRAPH_ROWS:  # decided once
        q = spec_config.num_speculative_tokens + 1
        rows = min(VERIFY_GRAPH_ROWS, spec_config.disable_by_batch_size, runner.planner.max_seqs,
                   DENSE_MAX_TOKENS // q)  # fmt: skip
        if rows >= 1 and rows * q <= runner.planner.max_tokens:
            runner.capture_verify(q, rows)
            spec.pad_drafts = True
            if draft.head is not None:  # the head's rows after each verify graph: graphs too
                spec.draft.capture_verify_rows(runner.verify_graphs)
    return spec
