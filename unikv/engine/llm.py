"""The Python API: ``LLM(model_dir, ...)`` and ``generate(prompts, params)``.

Construction decides everything once: device and dtype, the kernel backend
(Triton on CUDA, torch references on CPU), the unified pool sized from a
memory budget (full-attention and SWA sub-pools share its bytes), the
allocator, the scheduler and, on CUDA, the decode CUDA graphs.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from unikv.engine.budget import kv_budget_bytes
from unikv.engine.request import Request
from unikv.engine.runner import ModelRunner
from unikv.engine.sampling import SamplingParams
from unikv.engine.scheduler import Scheduler
from unikv.hf_config import specs_from_hf_config
from unikv.kernels import get_backend
from unikv.models.gpt_oss import DENSE_MAX_TOKENS
from unikv.models.loader import load_model, load_model_config, load_tokenizer
from unikv.pool import UnifiedPool


@dataclass
class RequestOutput:
    """The result of one prompt."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None
    finish_reason: str
    num_preemptions: int


@dataclass
class Stats:
    """Counters of the last ``generate`` call."""

    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    seconds: float = 0.0
    peak_pages: dict[str, int] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLM:
    """A model served over unikv's unified pool.

    Args:
        model_dir: local Hugging Face checkpoint (config.json + safetensors).
        device: default CUDA when available, else CPU.
        dtype: weights and KV dtype; default bf16 on CUDA, fp32 on CPU.
        kv_cache_bytes: the pool's byte budget; default from free memory
            (CUDA: ``memory_fraction`` of free memory after the weights, less an
            activation reserve; CPU: enough for ``max_num_seqs`` full contexts,
            at most 1 GiB).
        page_size: tokens per page (every attention sub-pool).
        max_num_seqs: running requests at most.
        max_num_batched_tokens: tokens per step at most (prefill chunk size).
        max_model_len: context length (default: the model's).
        cuda_graphs: decode under CUDA graphs (default: on with CUDA).
        backend: None (by device), "torch" or "triton".
        seed: seeds requests whose SamplingParams give none.
        debug: allocator debug mode (tombstone reads raise).
        static_split: None (sub-pools share the pool's bytes, boundaries move), or
            ``{sub-pool name: fraction of the usable bytes}`` fixed at start-up,
            e.g. SGLang's hybrid default ``{"mamba": 0.9 / 1.9, "full": 1 / 1.9}``.
        tp_group: None (one process), or a torch.distributed process group
            (e.g. ``dist.group.WORLD``) over which the model is
            tensor-parallel: every rank of the group builds an ``LLM`` with the
            same arguments and calls ``generate`` with the same prompts; each
            holds 1/tp of the heads and a pool for its KV-head shard
            (``unikv.models.parallel``). CUDA graphs default to off under TP.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        kv_cache_bytes: int | None = None,
        memory_fraction: float = 0.9,
        page_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        cuda_graphs: bool | None = None,
        backend: str | None = None,
        seed: int = 0,
        debug: bool = False,
        static_split: Mapping[str, float] | None = None,
        tp_group=None,
    ) -> None:
        from unikv.allocator import PoolAllocator
        from unikv.models.parallel import TensorParallel, shard_subpool_configs

        for what, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{what} must be a positive int, got {value!r}")
        self.device = torch.device(device) if device is not None else _default_device()
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
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
        )
        self.tokenizer = load_tokenizer(model_dir)
        configs = specs_from_hf_config(hf_config, page_size=page_size, dtype=self.dtype)
        if self.tp is not None:  # each rank caches its own KV heads
            configs = shard_subpool_configs(configs, self.tp.size)
        self._check_windows(configs)
        self.backend = get_backend(self.device, backend)
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
        self.pool = UnifiedPool(
            configs,
            total,
            self.device,
            max_request_tokens=self.max_model_len,
            chunk_tokens=max_num_batched_tokens,
            copy_pages=self.backend.copy_pages,
            static_split=static_split,  # validated by the pool (unikv.static_split)
        )
        self.alloc = PoolAllocator(
            self.pool,
            max_requests=max_num_seqs,
            max_context=self.max_model_len,
            debug=debug,
            build_block_table=self.backend.build_block_table,
        )
        self.scheduler = Scheduler(
            self.alloc,
            self.pool.subpools.values(),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        use_graphs = self.device.type == "cuda" and self.tp is None
        use_graphs = use_graphs if cuda_graphs is None else cuda_graphs
        self.runner = ModelRunner(
            self.model,
            self.pool,
            self.alloc,
            self.backend,
            cuda_graphs=use_graphs,
            max_graph_batch=min(max_num_seqs, DENSE_MAX_TOKENS),  # MoE stays sync-free
        )
        if self.runner.graphs is not None:  # decode_step writes the graphs' inputs directly
            self.scheduler.step_buffers = self.runner.graphs.step_buffers()
        self._rng = random.Random(seed)
        self._next_id = 0
        self.stats = Stats()

    def _check_windows(self, configs) -> None:
        for c in configs:
            for layer in c.layers:
                assert self.config.windows[layer] == c.spec.sliding_window, (
                    f"layer {layer}: model window {self.config.windows[layer]} != sub-pool "
                    f"{c.name!r} window {c.spec.sliding_window} (hf_config and models disagree)"
                )

    # -- requests --------------------------------------------------------------------

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this checkpoint has no tokenizer files, so prompts must be lists of token "
                    "ids, got a str"
                )
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError(
                f"a prompt is a str or a list of int token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("a prompt must hold at least one token, got an empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got {bad[:8]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens is too long: the model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate; "
                "shorten the prompt (or raise max_model_len up to the model's limit)"
            )
        return ids

    def _request(self, ids: list[int], params: SamplingParams) -> Request:
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= set(self.config.eos_token_ids)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = Request(self._next_id, ids, params, seed, frozenset(stop), self.max_model_len)
        self._next_id += 1
        return request

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        on_step=None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a str, a list of token ids, or a list of
        either); returns one RequestOutput per prompt, in order. Bad prompts or
        parameters raise before any work starts. ``on_step(llm, batch, logits)``,
        if given, is called after every step (the demo draws the pool with it)."""
        requests = self.make_requests(prompts, sampling_params)
        self._run(requests, use_tqdm, on_step)
        return [self._output(r) for r in requests]

    def make_requests(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Request]:
        """Validated Requests for ``generate``'s arguments (all checked before any
        is made); the disaggregated prefill worker starts from these too."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        bad = [type(sp).__name__ for sp in params if not isinstance(sp, SamplingParams)]
        if bad:
            raise TypeError(f"sampling_params must be SamplingParams, got {bad[:3]}")
        token_ids = [self._prompt_ids(p) for p in prompts]  # validate all before any state
        return [self._request(ids, sp) for ids, sp in zip(token_ids, params)]

    def _output(self, r: Request) -> RequestOutput:
        text = self.tokenizer.decode(r.output_ids) if self.tokenizer is not None else None
        return RequestOutput(
            r.prompt_ids, list(r.output_ids), text, r.finish_reason, r.num_preemptions
        )

    def _run(self, requests: list[Request], use_tqdm: bool, on_step=None) -> None:
        stats = Stats(
            num_requests=len(requests), prompt_tokens=sum(len(r.prompt_ids) for r in requests)
        )
        stats.peak_pages = {name: 0 for name in self.pool.subpools}
        preempted_before = self.scheduler.num_preemptions
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(
                total=sum(r.params.max_tokens for r in requests), unit="tok", desc="generate"
            )
        for r in requests:
            self.scheduler.add(r)
        start = time.perf_counter()
        # One step in flight while the next is planned: step N is enqueued, then
        # step N-1's tokens are read (N-1 is done by then or soon), then N's
        # bookkeeping runs with placeholders for its samples, which step N+1
        # reads on the device. The host never waits for the step it just queued.
        prev = None
        while self.scheduler.has_work():
            batch = self.scheduler.schedule()
            self._track_pages(stats)
            launched = self.runner.launch(batch, prev)
            if prev is not None:
                self._settle(prev)
            finished = self.scheduler.complete_ahead(batch)
            made = self.scheduler.num_appended
            stats.steps += 1
            stats.decode_steps += batch.is_decode
            stats.output_tokens += made
            if on_step is not None:
                on_step(self, batch, launched.logits)
            if bar is not None:
                bar.update(made + sum(r.params.max_tokens - len(r.output_ids) for r in finished))
            prev = launched
        if prev is not None:
            self._settle(prev)
        stats.seconds = time.perf_counter() - start
        stats.preemptions = self.scheduler.num_preemptions - preempted_before
        if bar is not None:
            bar.close()
        self.stats = stats

    def _settle(self, launched) -> None:
        """Write a finished step's sampled values into its placeholders; a stop
        token cuts its request's outputs there."""
        self.scheduler.resolve(launched.batch, launched.tokens())

    def _track_pages(self, stats: Stats) -> None:
        for name in self.pool.subpools:
            stats.peak_pages[name] = max(stats.peak_pages[name], self.alloc.subpool(name).num_live)
