"""The Python API: ``LLM(model_dir, ...)``, ``generate(prompts, params)`` and
``chat(messages, params)``.

Construction decides everything once: device and dtype, ONE kernel backend
(Triton on CUDA, torch references on CPU) handed to the pool, the allocator and
the runner, the unified pool sized from a memory budget (full-attention and SWA
sub-pools share its bytes), the allocator, the runner (its step planner and, on
CUDA, the decode CUDA graphs) and the scheduler, which writes decode steps'
tables into the planner's buffers. Requests run on
the online engine loop (``unikv.engine.online``): ``generate`` runs it in the
caller's thread until its requests end; ``unikv serve`` runs it in a thread of
its own and submits requests as they arrive.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Mapping
from functools import partial
from typing import Self

import torch

from unikv.engine.budget import (
    addressable_bytes,
    kv_budget_bytes,
    one_request_bytes,
    size_after_capture,
)
from unikv.engine.inline import Stats, run_inline
from unikv.engine.online import EngineLoop
from unikv.engine.options import (
    check_device,
    check_dtypes,
    check_kv_cache_bytes,
    check_prefix_host_bytes,
    check_swap,
    check_window_caching,
    derived_seed,
    fp8_kv_configs,
    merged_eos,
    model_dir_of,
    prefix_caching_for,
)
from unikv.engine.outputs import RequestOutput
from unikv.engine.prompts import PromptMaker
from unikv.engine.request import Request
from unikv.engine.runner import ModelRunner
from unikv.engine.sampling import SamplingParams
from unikv.engine.scheduler import Scheduler
from unikv.engine.tracks import RequestGroup
from unikv.engine.warmup import warm_linears, warm_sampling
from unikv.env import FLAGS
from unikv.hf_config import specs_from_hf_config
from unikv.kernels import get_backend
from unikv.kernels.runtime.widths import fit_backend
from unikv.models.loader import load_model, load_model_config, load_tokenizer
from unikv.models.moe import DENSE_MAX_TOKENS
from unikv.pool import UnifiedPool

__all__ = ["LLM", "RequestOutput", "SamplingParams", "Stats"]

# speculative verify steps of up to this many requests run under CUDA graphs
# (UNIKV_VERIFY_GRAPH_ROWS, fixed at import: 0 runs them eagerly, the A/B switch)
VERIFY_GRAPH_ROWS = FLAGS.verify_graph_rows


class LLM:
    """A model served over unikv's unified pool.

    Args:
        model_dir: local Hugging Face checkpoint (config.json + safetensors), or a
            repo id ("org/name") found in the local Hugging Face cache (HF_HUB_CACHE,
            else $HF_HOME/hub; never downloaded: ``models/hub.py``); ``model=`` is
            the same (vLLM's name).
        device: default CUDA when available, else CPU.
        dtype: weights and compute dtype (bf16, fp16 or fp32); default bf16 on
            CUDA, fp32 on CPU.
        kv_cache_dtype: "auto" (the KV cache holds ``dtype``), or "fp8" (= "fp8_e4m3")
            / "fp8_e5m2": attention K/V stored as fp8, half the bytes of bf16 (twice the
            tokens), quantised at store with scale 1 (clamped to the format's range,
            vLLM's default without checkpoint scales) and read back into ``dtype`` by
            the attention kernels. Recurrent state keeps its dtypes; MLA models refuse it.
        kv_cache_bytes: the pool's byte budget (> 0); default (None) from free
            memory (CUDA: ``memory_fraction`` of free memory after the weights,
            less an activation reserve; CPU: enough for ``max_num_seqs`` full
            contexts, at most 1 GiB).
        kv_cache_max_bytes: None (a fixed pool), or the most bytes
            ``resize_kv_cache`` may give the pool: its address range is reserved
            once and committed in chunks (an elastic pool, ``unikv.backing``);
            ``kv_cache_bytes`` (default: the budget below, capped at this) is the
            starting size. Not yet with host tiers or tensor parallelism.
        kv_cache_margin_bytes: None, or size the pool after capture (CUDA, an
            elastic pool): it starts as small as one worst-case request needs and,
            once the model is loaded, warmed up and its graphs captured, grows by
            the memory then free less this margin (up to ``kv_cache_max_bytes``,
            default the GPU's memory). Excludes ``kv_cache_bytes``.
        page_size: tokens per page (every attention sub-pool).
        max_num_seqs: running requests at most.
        max_num_batched_tokens: tokens per step at most (prefill chunk size).
        max_model_len: context length (default: the model's).
        cuda_graphs: decode under CUDA graphs (default: on with CUDA).
        backend: None (by device), "torch" or "triton".
        seed: seeds requests whose SamplingParams give none.
        debug: allocator debug mode (tombstone reads raise).
        enable_prefix_caching: share the KV pages of common prompt prefixes
            across requests (whole pages; recurrent state through checkpoints).
            None (default): on for full-attention and MLA models, off for
            sliding-window and recurrent ones, where it costs memory
            (``options.prefix_caching_for``).
            Hit and eviction counters: ``llm.alloc.parts.prefix.counters()``;
            ``llm.prefix_caching`` says whether it is on.
        prefix_host_bytes: host bytes behind the prefix cache (0: off): evicted cached
            pages and state checkpoints spill there and reload on a hit, when the cost
            rule says reloading beats recomputing (``io/prefix_host.py``).
        swap_host_bytes: host bytes that preempted requests swap into (0: off);
            their pages come back on readmission instead of being recomputed.
        preemption: "auto" (swap when the copies cost less than the recompute,
            ``io/swap.py``), "swap" (whenever the host slots have room) or
            "recompute". Counters: ``llm.scheduler.swap.counters()``.
        static_split: None (sub-pools share the pool's bytes, boundaries move), or
            ``{sub-pool name: fraction of the usable bytes}`` fixed at start-up,
            e.g. SGLang's hybrid default ``{"mamba": 0.9 / 1.9, "full": 1 / 1.9}``.
        tp_group: None (one process), or a torch.distributed process group
            (e.g. ``dist.group.WORLD``) over which the model is
            tensor-parallel: every rank of the group builds an ``LLM`` with the
            same arguments and calls ``generate`` with the same prompts; each
            holds 1/tp of the heads and a pool for its KV-head shard
            (``unikv.models.parallel``). CUDA graphs default to off under TP.
        tensor_parallel_size: 1 (one process), or N: this process is rank 0 and
            starts N-1 worker processes itself (torch.multiprocessing, spawn; NCCL
            with GPUs ``device``'s index .. + N-1, gloo on CPU), each building this
            LLM; every call made here runs on all ranks, and only this one returns
            outputs (``unikv.engine.tp_launch``). Refused before anything is spawned
            when the model cannot be split N ways. ``close()`` (or ``with LLM(...)``,
            or the interpreter's exit) stops the workers. Not with ``tp_group``.
        speculative_config: None, or vLLM's speculative config (a dict or its JSON),
            e.g. ``{"method": "ngram", "num_speculative_tokens": 3}``: pure decode
            steps verify draft tokens through the pool (``unikv.engine.speculative``;
            built: ``ngram`` and ``draft_model``, whose K/V are ``draft_*`` sub-pools of
            the same pool). Greedy outputs equal decoding without it; sampled ones keep
            the target's distribution (rejection sampling). Counters: ``llm.stats``
            (``spec_*``). Refused for models with recurrent state and under TP.

    Generation stops at the config's EOS ids, those of ``generation_config.json``
    and the tokenizer's EOS (vLLM's default), unless ``ignore_eos``.
    """

    def __init__(
        self,
        model_dir: str | None = None,
        *,
        model: str | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        kv_cache_dtype: str = "auto",
        kv_cache_bytes: int | None = None,
        kv_cache_max_bytes: int | None = None,
        kv_cache_margin_bytes: int | None = None,
        memory_fraction: float = 0.9,
        page_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        cuda_graphs: bool | None = None,
        backend: str | None = None,
        seed: int = 0,
        debug: bool = False,
        tp_group=None,
        tensor_parallel_size: int = 1,
        static_split: Mapping[str, float] | None = None,
        enable_prefix_caching: bool | None = None,
        prefix_host_bytes: int = 0,
        swap_host_bytes: int = 0,
        preemption: str = "auto",
        speculative_config: Mapping | str | None = None,
    ) -> None:
        if tensor_parallel_size != 1:  # spawn ranks 1.., then build rank 0 (tp_launch)
            options = dict(locals())  # the arguments, first: every rank builds with them
            from unikv.engine.tp_launch import launch

            launch(self, options)
            return
        from unikv.allocator import PoolAllocator
        from unikv.engine.speculative.config import check_speculation, speculative_config_of
        from unikv.models.parallel import TensorParallel, shard_subpool_configs

        self.workers = None  # the tensor-parallel worker processes this LLM started
        model_dir = model_dir_of(model_dir, model)
        for what, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{what} must be a positive int, got {value!r}")
        check_kv_cache_bytes(kv_cache_bytes)
        self.speculative_config = speculative_config_of(speculative_config)
        self.device = check_device(device)
        self.dtype, self.kv_cache_dtype = check_dtypes(dtype, kv_cache_dtype, self.device)
        self.config, hf_config = load_model_config(model_dir)
        limit = self.config.max_position_embeddings
        if max_model_len is not None and not 1 < max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be in [2, {limit}] (the model's context), got {max_model_len}"
            )
        self.max_model_len = max_model_len or limit
        self.tp = TensorParallel(tp_group) if tp_group is not None else None
        self.model = load_model(
            model_dir,
            device=self.device,
            dtype=self.dtype,
            max_positions=self.max_model_len,
            tp=self.tp,
            kernels=backend,  # the elementwise ops of the same backend as below
        )
        if hasattr(self.model, "logits_dtype"):  # greedy argmax without an fp32 vocab copy
            self.model.logits_dtype = None
        self.tokenizer = load_tokenizer(model_dir)
        self.tokenizer_lock = threading.Lock()  # the engine thread decodes, callers encode
        self.eos_token_ids = merged_eos(self.config, model_dir, self.tokenizer)
        configs = specs_from_hf_config(hf_config, page_size=page_size, dtype=self.dtype)
        configs = fp8_kv_configs(configs, self.kv_cache_dtype)
        if self.tp is not None:  # each rank caches its own KV heads and recurrent heads
            configs = shard_subpool_configs(configs, self.tp.size, self.config.state_dims)
        check_speculation(self.speculative_config, configs, tp_group)
        draft = self._draft_configs(configs, page_size, backend)  # its sub-pools join
        configs = configs + draft
        enable_prefix_caching = prefix_caching_for(enable_prefix_caching, configs)
        check_prefix_host_bytes(prefix_host_bytes, enable_prefix_caching, configs)
        check_swap(preemption, swap_host_bytes, configs, tp_group)
        # the kernels' width and alignment rules, once: torch ops where Triton cannot
        # take a width, a ValueError naming the field where nothing can (kernels/runtime/widths.py)
        self.backend = fit_backend(get_backend(self.device, backend), configs, self.config)
        if kv_cache_margin_bytes is not None:  # sized after capture (issue 44 item 2)
            if self.device.type != "cuda" or kv_cache_bytes is not None:
                raise ValueError(
                    "kv_cache_margin_bytes sizes the pool after capture: CUDA only, and "
                    "without kv_cache_bytes"
                )
            kv_cache_bytes = one_request_bytes(configs, self.max_model_len, max_num_batched_tokens)
            if kv_cache_max_bytes is None:  # the GPU's memory, as far as kernel ids reach
                device_bytes = torch.cuda.mem_get_info(self.device)[1]
                kv_cache_max_bytes = min(device_bytes, addressable_bytes(configs))
        total = kv_cache_bytes or kv_budget_bytes(
            configs,
            self.model,
            self.device,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            chunk=max_num_batched_tokens,
            memory_fraction=memory_fraction,
        )
        if self.tp is not None:  # one pool geometry on every rank: identical schedules
            total = self.tp.min_int(total, self.device)
        if kv_cache_max_bytes is not None and (swap_host_bytes or prefix_host_bytes or self.tp):
            raise ValueError(  # host tiers keep (num_pages, page_bytes) row views; TP ranks
                "kv_cache_max_bytes (an elastic pool) does not yet combine with "  # resize alike
                "swap_host_bytes, prefix_host_bytes or tp_group"
            )
        if kv_cache_max_bytes is not None and kv_cache_bytes is None:  # the default, capped
            total = min(total, kv_cache_max_bytes)
        self.pool = UnifiedPool(
            configs,
            total,
            self.device,
            max_request_tokens=self.max_model_len,
            chunk_tokens=max_num_batched_tokens,
            backend=self.backend,
            static_split=static_split,  # validated by the pool (unikv.static_split)
            max_bytes=kv_cache_max_bytes,  # validated by the pool
        )
        if enable_prefix_caching:
            check_window_caching(self.pool, self.max_model_len, max_num_batched_tokens)
        self.alloc = PoolAllocator(
            self.pool,
            max_requests=max_num_seqs,
            max_context=self.max_model_len,
            debug=debug,
            backend=self.backend,
        )
        if prefix_host_bytes:
            self._enable_prefix_host(prefix_host_bytes)
        use_graphs = self.device.type == "cuda" and self.tp is None
        use_graphs = use_graphs if cuda_graphs is None else cuda_graphs
        self.runner = ModelRunner(
            self.model,
            self.pool,
            self.alloc,
            self.backend,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            cuda_graphs=use_graphs,
            max_graph_batch=min(max_num_seqs, DENSE_MAX_TOKENS),  # MoE stays sync-free
            q_per_kv_of={c.name: self._draft_q_per_kv for c in draft},
        )
        if self.device.type == "cuda":  # load and compile the step's kernels now (warmup.py)
            warm_linears(self.model, max_logit_rows=max_num_seqs, max_tokens=max_num_batched_tokens)
            warm_sampling(self.backend, self.model, rows=max_num_seqs)
        if kv_cache_margin_bytes is not None:  # what the graphs and warm-ups left, measured
            torch.cuda.synchronize(self.device)
            free = torch.cuda.mem_get_info(self.device)[0]
            self.alloc.parts.room.resize(size_after_capture(self.pool, free, kv_cache_margin_bytes))
        self.scheduler = Scheduler(
            self.alloc,
            self.pool.subpools.values(),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            tables=self.runner.planner.tables,  # decode_step writes the planner's buffers
            prefix_caching=enable_prefix_caching,
            swap=self._swap_space(swap_host_bytes, preemption),
            speculator=self._speculator(max_num_batched_tokens),
            checkpoint_rule=self._checkpoint_rule() if enable_prefix_caching else None,
        )
        self._rng = random.Random(seed)
        self._next_id = 0
        self.prompts = PromptMaker(self)
        self.engine = EngineLoop(self)
        self.stats = Stats()

    def _enable_prefix_host(self, host_bytes: int) -> None:
        """The prefix cache's host tier, its reload rule from the measured H2D
        bandwidth and a prefill estimate of 2 FLOPs per weight per token."""
        from unikv.io.prefix_host import ReloadPolicy
        from unikv.io.prefix_host_setup import enable_prefix_host, measure_h2d_bytes_per_s

        policy = ReloadPolicy(
            h2d_bytes_per_s=measure_h2d_bytes_per_s(self.device),
            prefill_tokens_per_s=self._prefill_tokens_per_s(),
        )
        enable_prefix_host(self.alloc.parts, host_bytes, policy)

    def _prefill_tokens_per_s(self) -> float:
        """A prefill estimate of 2 FLOPs per weight per token at a sustained rate."""
        weights = sum(p.numel() for p in self.model.parameters())
        flops = 3e14 if self.device.type == "cuda" else 3e10  # sustained, roughly
        return flops / max(2 * weights, 1)

    def _checkpoint_rule(self):
        """The decode-checkpoint cost rule of a hybrid's prefix cache, its state-slot
        copy time measured once (``engine/checkpoint_rule.py``); None without state."""
        from unikv.engine.checkpoint_rule import CheckpointRule, measure_copy_s, state_tokens

        configs = list(self.pool.subpools.values())  # each with its spec and page size
        slot = [c.page_bytes for c in configs if c.spec.kind == "mamba"]
        if not slot:
            return None
        return CheckpointRule(
            copy_s=measure_copy_s(self.device, max(slot)),
            prefill_tokens_per_s=self._prefill_tokens_per_s(),
            state_tokens=state_tokens(configs),
        )

    def _swap_space(self, host_bytes: int, preemption: str):
        """The host slots preempted requests swap into (None: recompute only), with
        the measured pinned-copy bandwidths in its cost rule."""
        from unikv.io.prefix_host_setup import measure_h2d_bytes_per_s
        from unikv.io.swap import SwapPolicy, build_swap_space

        if not host_bytes or preemption == "recompute":
            return None
        policy = SwapPolicy(
            preemption,
            d2h_bytes_per_s=measure_h2d_bytes_per_s(self.device, to_device=False),
            h2d_bytes_per_s=measure_h2d_bytes_per_s(self.device),
            prefill_tokens_per_s=self._prefill_tokens_per_s(),
        )
        return build_swap_space(self.alloc, host_bytes, policy)

    def _draft_configs(self, configs, page_size: int, backend: str | None) -> list:
        """A draft model's sub-pool configs (method "draft_model"), else []; checks
        its vocabulary and context against the target's and loads it (before the
        pool is sized from the memory left)."""
        from unikv.engine.speculative.draft import draft_subpool_configs

        config = self.speculative_config
        if config is None or config.method != "draft_model":
            return []
        draft, _ = load_model_config(config.model)
        if draft.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"speculative_config: the draft model's vocabulary ({draft.vocab_size}) must "
                f"be the target's ({self.config.vocab_size})"
            )
        if draft.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"speculative_config: the draft model's context ({draft.max_position_embeddings})"
                f" is shorter than max_model_len ({self.max_model_len}); lower max_model_len"
            )
        self._draft_q_per_kv = draft.num_heads // draft.num_kv_heads
        out = draft_subpool_configs(config.model, configs, page_size, self.dtype)
        self._draft_model = load_model(config.model, device=self.device, dtype=self.dtype,
                                       max_positions=self.max_model_len, kernels=backend)  # fmt: skip
        if hasattr(self._draft_model, "logits_dtype"):  # argmax drafts, no fp32 vocab copy
            self._draft_model.logits_dtype = None
        return out

    def _speculator(self, max_num_batched_tokens: int):
        """The scheduler's speculation hook (None without ``speculative_config``), and
        a draft model over its sub-pools (method "draft_model")."""
        from unikv.engine.runner import check_soft_cap, layer_caches
        from unikv.engine.speculative.draft import DraftModel
        from unikv.engine.speculative.engine import Speculator

        config = self.speculative_config
        if config is None:
            return None
        self.runner.force_accept = config.force_accept  # benchmarks only
        spec = Speculator(config, max_num_batched_tokens)
        if config.method == "draft_model":
            model = self._draft_model  # loaded with its sub-pools' configs
            cap = check_soft_cap(self.backend, model.config.extra.get("attn_soft_cap", 0.0))
            caches, _ = layer_caches(self.pool, model.config.num_layers, cap, draft=True)
            spec.draft = self.runner.draft = DraftModel(
                model, caches, self.runner.planner, self.backend, model.config.sm_scale
            )
        if self.runner.graphs is not None and VERIFY_GRAPH_ROWS:  # decided once
            q = config.num_speculative_tokens + 1
            rows = min(VERIFY_GRAPH_ROWS, config.disable_by_batch_size, self.runner.planner.max_seqs,
                       DENSE_MAX_TOKENS // q)  # fmt: skip
            if rows >= 1 and rows * q <= self.runner.planner.max_tokens:
                self.runner.capture_verify(q, rows)
                spec.pad_drafts = True
        return spec

    def get_tokenizer(self):
        """The checkpoint's transformers tokenizer (None without tokenizer files)."""
        return self.tokenizer

    # -- requests --------------------------------------------------------------------

    def _request(
        self, ids: list[int], params: SamplingParams, seed: int, cache_salt: str | None = None
    ) -> Request:
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= set(self.eos_token_ids)
        request = Request(self._next_id, ids, params, seed, frozenset(stop), self.max_model_len)
        request.cache_salt = cache_salt
        self._next_id += 1
        return request

    def make_requests(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Request]:
        """Validated Requests for ``generate``'s arguments (all checked before any
        is made), ``n`` consecutive ones per prompt; the disaggregated prefill
        worker starts from these too."""
        return [r for g in self.make_groups(prompts, sampling_params) for r in g.requests]

    def make_groups(self, prompts, sampling_params=None, *, sink=None) -> list[RequestGroup]:
        """One RequestGroup per prompt (``generate``'s arguments, all validated
        before any is made); ``sink`` receives their deltas (``EngineLoop``)."""
        items = self.prompts.normalize(prompts, sampling_params)
        return [self.make_group(ids, sp, text=text, sink=sink) for ids, text, sp in items]

    def make_group(
        self,
        ids: list[int],
        params: SamplingParams,
        *,
        text=None,
        sink=None,
        cache_salt=None,
        detokenize: bool = True,
    ):
        """A RequestGroup of ``params.n`` requests sharing the (validated) prompt ids.
        Completion i > 0 of a seeded prompt gets a seed derived from (seed, i).
        ``cache_salt`` (a non-empty str or None, vLLM's): the prefix cache shares
        pages only between requests of the same salt. ``detokenize`` False: the
        group's tracks carry token ids alone (no text, no stop strings: the API
        process of ``unikv serve`` does those)."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty str or None, got {cache_salt!r:.40}")
        vocab = self.config.vocab_size
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            bad = [t for t in params.stop_token_ids if t >= vocab]
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad[:4]}")
        base = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seeds = [base] + [derived_seed(base, i) for i in range(1, params.n)]
        requests = [self._request(list(ids), params, seed, cache_salt) for seed in seeds]
        return RequestGroup(requests, text, sink, self.tokenizer if detokenize else None)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        on_step=None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a str, a list of token ids, or a list of
        either); returns one RequestOutput per prompt, in order, with
        ``SamplingParams.n`` completions each. Bad prompts or parameters raise
        before any work starts. ``on_step(llm, batch, logits)``, if given, is
        called after every step (the demo draws the pool with it). An exception
        in a step ends this call's requests (their pages freed) and is re-raised:
        the LLM serves the next call as usual. ``sampling_params`` None: vLLM's
        defaults (``SamplingParams()``: temperature 1.0, sampled)."""
        serving = self.engine.running  # a server's loop runs: submit and wait
        if serving and on_step is not None:
            raise ValueError("on_step needs the loop in this thread; the engine is serving")
        groups = self.make_groups(prompts, sampling_params, sink=_ignore if serving else None)
        if serving:
            self._wait_for(groups)
        else:
            try:
                self.stats = run_inline(self, groups, use_tqdm, on_step)
            except BaseException:
                self.engine.recover()  # this call's requests end; the LLM stays usable
                raise
        return [_output_of(g) for g in groups]

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """``generate`` on conversations rendered by the tokenizer's chat template
        (or ``chat_template``, with ``tools`` and ``chat_template_kwargs`` given to
        it; ``continue_final_message`` leaves the last message open): ``messages``
        is one conversation (a list of {"role", "content"} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kw = {"add_generation_prompt": add_generation_prompt, "chat_template": chat_template,
              "continue_final_message": continue_final_message, "tools": tools,
              "extra": chat_template_kwargs}  # fmt: skip
        prompts = [self.prompts.chat(c, **kw)[1] for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (``enable_prefix_caching`` resolved)."""
        return self.scheduler.prefix.enabled

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix no request holds: pages, state checkpoints and
        host-tier copies (vLLM's ``reset_prefix_cache``); the pages running requests
        reference stay cached. Runs between two steps of a serving loop (its thread
        does it). False, with nothing dropped, when prefix caching is off."""
        if not self.prefix_caching:
            return False
        self.engine.call(self._reset_prefix_now).result()
        return True

    def _reset_prefix_now(self) -> None:
        self.alloc.parts.prefix.reset()

    def resize_kv_cache(self, total_bytes: int) -> int:
        """Give the pool ``total_bytes`` (at most ``kv_cache_max_bytes``), between
        two steps of the loop (its thread does it); returns the pages moved.
        Growing commits chunks at the top; shrinking compacts the bands below the
        new top (waiting for the forward in flight) and releases the chunks above.
        A size below what the running requests hold raises ValueError with
        nothing changed (``allocator.room.Room.resize``)."""
        return self.engine.call(partial(self._resize_now, total_bytes)).result()

    def _resize_now(self, total_bytes: int) -> int:
        return self.alloc.parts.room.resize(total_bytes)

    def close(self) -> None:
        """Stop the serving loop if one runs and the tensor-parallel workers if this
        LLM started any (``tensor_parallel_size``); idempotent. ``with LLM(...) as
        llm:`` closes at the block's end."""
        if self.engine.running:
            self.engine.shutdown()
        if self.workers is not None:
            self.workers.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _output(self, r: Request) -> RequestOutput:
        """The RequestOutput of one finished request (e.g. handed off by P/D)."""
        return _output_of(RequestGroup([r], None, None, self.tokenizer))

    def _wait_for(self, groups: list[RequestGroup]) -> None:
        left = threading.Semaphore(0)
        for g in groups:
            g.on_done = lambda _: left.release()
            self.engine.submit(g, bounded=False)
        for _ in groups:
            left.acquire()


def _output_of(group: RequestGroup) -> RequestOutput:
    out = group.output()
    out.num_cached_tokens = group.requests[0].num_cached_tokens
    return out


def _ignore(delta) -> None:
    """The sink of a ``generate`` on a serving loop (it reads the requests at the end)."""
