"""The Python API: ``LLM(model_dir, ...)``, ``generate(prompts, params)`` and
``chat(messages, params)``.

``LLM`` is the user's handle and nothing more: its options make an
``EngineConfig`` (``engine/config.py``), ``build_engine`` (``engine/build.py``)
makes every piece from it, and requests run on the online engine loop
(``unikv.engine.online``): ``generate`` runs it in the caller's thread until its
requests end; ``unikv serve`` runs it in a thread of its own and submits
requests as they arrive.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Self

from unikv.engine.build import build_engine
from unikv.engine.config import EngineConfig
from unikv.engine.inline import Stats, run_inline
from unikv.engine.online import EngineLoop
from unikv.engine.outputs import RequestOutput
from unikv.engine.prompts import PromptMaker
from unikv.engine.request import Request
from unikv.engine.request_maker import RequestMaker
from unikv.engine.sampling import SamplingParams
from unikv.engine.tracks import RequestGroup

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "Stats"]


def engine_config_of(model, options: dict) -> EngineConfig:
    """``LLM``'s arguments as an EngineConfig: ``model`` a ready config (``options``
    then replace its fields), or the checkpoint with the fields by name."""
    if isinstance(model, EngineConfig):
        return model.replace(**options) if options else model
    return EngineConfig.of(model, **options)


class LLM:
    """A model served over unikv's unified pool.

    ``LLM(model_dir, **options)``: the options are ``EngineConfig``'s fields, by
    name; ``LLM(config)`` takes a ready ``EngineConfig`` (options given too replace
    its fields). ``tp_group`` is the one argument that is no config field (a live
    process group does not cross processes).

    Args:
        model_dir: local Hugging Face checkpoint (config.json + safetensors), or a
            repo id ("org/name") found in the local Hugging Face cache (HF_HUB_CACHE,
            else $HF_HOME/hub; never downloaded: ``models/hub.py``); ``model=`` is
            the same (vLLM's name); or an ``EngineConfig``.
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
        kv_backing: None, or the ``backing.Backing`` (not yet reserved) an elastic
            pool reserves its range in; ``MultiLLM`` hands each model a
            ``SliceBacking`` of one shared reservation. Needs ``kv_cache_max_bytes``.
        page_size: tokens per page (every attention sub-pool).
        max_num_seqs: running requests at most.
        max_num_batched_tokens: tokens per step at most (prefill chunk size).
        max_prefill_tokens_decoding: None, or prefill tokens per step at most while
            some request decodes (a step of prefills alone still takes
            ``max_num_batched_tokens``): an arriving prompt's prefill is spread
            over several steps instead of making one decode step many times
            longer (the inter-token latency tail of ``unikv serve``).
        admission_window_ms: ``unikv serve``'s engine process only (0: off): when
            nothing runs and requests arrive, it waits up to this long for more
            (again after each arrival, ten windows at most) before planning, so a
            burst that reaches it over some milliseconds is planned as few prefill
            steps (``engine_core.serve_all``).
        max_model_len: context length (default: the model's).
        cuda_graphs: decode under CUDA graphs (default: on with CUDA).
        prefill_graphs: extend steps under piecewise CUDA graphs (``engine/prefill_graphs.py``:
            the layers cut at the attention and recurrent ops, which run eagerly; token
            counts padded to 256, 512, 1024, 2048, then every 1024 up to
            max_num_batched_tokens); on the CPU the same pieces as plain calls. Default
            off. Not MLA models, not under TP.
        prefill_graph_tokens: with prefill_graphs, the largest captured token count
            (the sizes below it, then it; None: max_num_batched_tokens).
            Extend steps of more rows run eagerly: graphs pay where launches, not the
            GPU, bound a step (a few hundred rows).
        backend: None (by device), "torch" or "triton".
        seed: seeds requests whose SamplingParams give none.
        debug: allocator debug mode (tombstone reads raise).
        enable_prefix_caching: share the KV pages of common prompt prefixes
            across requests (whole pages; recurrent state through checkpoints).
            None (default): the model family's row of
            ``options.PREFIX_CACHING_DEFAULT``: on for full-attention and MLA
            models, off for sliding-window and recurrent ones, where it has not
            yet paid on the GPU (issue 41).
            Hit and eviction counters: ``llm.alloc.prefix.counters()``;
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
            built: ``ngram``, ``draft_model``, ``mtp`` and ``eagle3``, whose K/V are
            ``draft_*`` sub-pools of the same pool). Greedy outputs equal decoding
            without it; sampled ones keep the target's distribution (rejection
            sampling). Counters: ``llm.stats``
            (``spec_*``). Models with recurrent state hold k per-draft-position
            state slots per request. Refused under TP. ``force_accept`` (a
            benchmark mode) is refused here.
        speculative_disable_by_batch_size: None, or N: a step with more than N
            decoding requests does not speculate (vLLM's flag; it overrides the
            speculative config's ``disable_by_batch_size``, default 32).

    Generation stops at the config's EOS ids, those of ``generation_config.json``
    and the tokenizer's EOS (vLLM's default), unless ``ignore_eos``.
    """

    def __init__(self, model_dir=None, *, tp_group=None, kv_backing=None, **options) -> None:
        config = engine_config_of(model_dir, options)
        self.workers = None  # the tensor-parallel worker processes this LLM started
        if config.tensor_parallel_size != 1:  # spawn ranks 1.., then build rank 0 (tp_launch)
            from unikv.engine.tp_launch import launch

            core, self.workers = launch(config, tp_group)
        else:
            core = build_engine(config, tp_group, kv_backing)
        self.core, self.engine_config = core, config
        # the engine's pieces, read by callers and tests as the LLM's attributes
        self.device, self.dtype, self.kv_cache_dtype = core.device, core.dtype, core.kv_cache_dtype
        self.config, self.model, self.tokenizer = core.model_config, core.model, core.tokenizer
        self.tokenizer_lock = core.tokenizer_lock
        self.max_model_len, self.tp, self.backend = core.max_model_len, core.tp, core.backend
        self.pool, self.alloc, self.runner = core.pool, core.alloc, core.runner
        self.scheduler, self.speculative_config = core.scheduler, core.speculative_config
        self.prompts = PromptMaker(core.tokenizer, core.tokenizer_lock, core.model_config,
                                   core.max_model_len)  # fmt: skip
        self.requests = RequestMaker(core, self.prompts, config.seed)
        if self.workers is None:
            self.engine = EngineLoop(core, owner=self)
        else:  # rank 0's loop mirrors its inputs to the workers
            self.engine = self.workers.leader_loop(core, owner=self)
        self.stats = Stats()

    def get_tokenizer(self):
        """The checkpoint's transformers tokenizer (None without tokenizer files)."""
        return self.tokenizer

    # -- requests --------------------------------------------------------------------

    def make_requests(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Request]:
        """Validated Requests for ``generate``'s arguments (all checked before any
        is made), ``n`` consecutive ones per prompt; the disaggregated prefill
        worker starts from these too."""
        return [r for g in self.make_groups(prompts, sampling_params) for r in g.requests]

    def make_groups(self, prompts, sampling_params=None, *, sink=None) -> list[RequestGroup]:
        """One RequestGroup per prompt (``RequestMaker.make_groups``)."""
        return self.requests.make_groups(prompts, sampling_params, sink=sink)

    def make_group(self, ids: list[int], params: SamplingParams, **options) -> RequestGroup:
        """A RequestGroup of ``params.n`` requests (``RequestMaker.make_group``)."""
        return self.requests.make_group(ids, params, **options)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end every request unless ``ignore_eos`` (the engine's: settable)."""
        return self.core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.core.eos_token_ids = tuple(ids)

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
                self.stats = run_inline(self.engine, groups, use_tqdm, on_step)
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
        self.engine.call(self.core.reset_prefix_now).result()
        return True

    def resize_kv_cache(self, total_bytes: int) -> int:
        """Give the pool ``total_bytes`` (at most ``kv_cache_max_bytes``), between
        two steps of the loop (its thread does it); returns the pages moved.
        Growing commits chunks at the top; shrinking compacts the bands below the
        new top (waiting for the forward in flight) and releases the chunks above.
        A size below what the running requests hold raises ValueError with
        nothing changed (``allocator.room.Room.resize``)."""
        return self.engine.call(partial(self.core.resize_now, total_bytes)).result()

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

    def output_of(self, r: Request) -> RequestOutput:
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
