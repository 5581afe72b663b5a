"""Shared fixtures of the engine tests: tiny random-initialised transformers
models saved to a temp dir, and transformers' own greedy tokens and logits.

The models are transformers' (``AutoModelForCausalLM.from_config``), so every
comparison checks unikv against an independent implementation of the same
architecture. ``initializer_range`` is raised from 0.02 so that the logits of
a random model are not near-uniform (near-ties would make greedy comparisons
depend on rounding, not on correctness).
"""

from __future__ import annotations

import pytest
import torch

from unikv.engine.demo import hf_greedy  # noqa: F401  (re-exported for the engine tests)

VOCAB = 256
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}


def tiny_hf_config(arch: str, **overrides):
    """A tiny transformers config of ``arch`` (llama, qwen2, qwen3, mistral, gpt_oss)."""
    import transformers as tf

    kw = dict(TINY)
    if arch == "llama":
        kw["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cls = tf.LlamaConfig
    elif arch == "qwen2":
        cls = tf.Qwen2Config
    elif arch == "qwen3":
        kw.update(head_dim=32, tie_word_embeddings=True, num_hidden_layers=3)
        cls = tf.Qwen3Config
    elif arch == "mistral":
        kw.update(sliding_window=7)
        cls = tf.MistralConfig
    elif arch == "gpt_oss":
        kw.update(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=6,
            num_hidden_layers=4,
            intermediate_size=64,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
            },
        )
        cls = tf.GptOssConfig
    else:
        raise ValueError(arch)
    kw.update(overrides)
    return cls(**kw)


def save_tiny_model(arch: str, path: str, seed: int = 0, **overrides):
    """Build a random-init transformers model of ``arch``, save it to ``path``,
    return the (fp32, eval) transformers model."""
    return save_random_model(tiny_hf_config(arch, **overrides), path, seed)


def pack_gpt_oss_experts(path: str, seed: int, scales: tuple[int, int] = (122, 128)) -> dict:
    """Replace a saved gpt-oss checkpoint's dense experts (``save_tiny_model``) by
    random MXFP4 pairs, as released checkpoints store them (``*_blocks``: uniform codes;
    ``*_scales``: exponents in [lo, hi)); rewrites the safetensors file and returns its
    tensors."""
    from safetensors.torch import load_file, save_file

    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors.pop(name).shape  # transformers' (E, in, out)
        tensors[name + "_blocks"] = torch.randint(
            0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g
        )
        tensors[name + "_scales"] = torch.randint(
            *scales, (experts, rows, cols // 32), dtype=torch.uint8, generator=g
        )
    save_file(tensors, file)
    return tensors


def save_random_model(config, path: str, seed: int = 0):
    """A random-init (``torch.manual_seed(seed)``) fp32 transformers model of
    ``config`` saved to ``path``; returns it in eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval().save_pretrained(path)
    return model


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' fp32 logits (len(tokens), vocab) of one full forward."""
    with torch.no_grad():
        return model(torch.tensor([tokens], device=model.device)).logits[0].float().cpu()


def dense_attention(q, k, v, window, sinks, sm_scale):
    """Contiguous causal attention of one sequence, written from the definition.

    q: (T, Hq, D), k/v: (T, H, D); window None or W; sinks None or (Hq,)."""
    t, hq, _ = q.shape
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = torch.einsum("thd,shd->hts", q, k) * sm_scale
    pos = torch.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks[:, None, None].expand(hq, t, 1)], dim=-1)
    probs = torch.softmax(logits.float(), dim=-1)[..., :t]
    return torch.einsum("hts,shd->thd", probs, v.float()).to(q.dtype)


class DenseAttention:
    """An ``AttentionFn`` for one whole sequence with no cache (model tests)."""

    def __init__(self, windows, sm_scale):
        self.windows, self.sm_scale = windows, sm_scale

    def __call__(self, layer, q, k, v, sinks=None):
        return dense_attention(q, k, v, self.windows[layer], sinks, self.sm_scale)


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread avoids
    oversubscription (10x faster here); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- Qwen3.5 / Qwen3-Next (hybrid Gated DeltaNet + gated attention) -------------------

HYBRID_LAYERS = ["linear_attention", "linear_attention", "full_attention"]
HYBRID_LAYERS += ["linear_attention", "full_attention"]  # an irregular pattern, 5 layers


def tiny_hybrid_config(arch: str, **overrides):
    """A tiny ``qwen3_5`` (text) or ``qwen3_next`` config with odd shapes: head dim
    24 with partial rotary, linear key/value head dims 12/20, Hv = 2 Hk, conv
    kernel 4, the irregular ``HYBRID_LAYERS``; Qwen3-Next adds 4 experts (top 2,
    renormalised), a shared expert and one dense-MLP layer."""
    import transformers as tf

    kw = dict(TINY)
    kw.update(
        num_hidden_layers=len(HYBRID_LAYERS),
        layer_types=list(HYBRID_LAYERS),
        head_dim=24,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=12,
        linear_value_head_dim=20,
        linear_conv_kernel_dim=4,
    )
    if arch == "qwen3_5":
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
        kw["rope_parameters"]["partial_rotary_factor"] = 0.25
        cls = tf.Qwen3_5TextConfig
    elif arch == "qwen3_next":
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
        kw["rope_parameters"]["partial_rotary_factor"] = 0.5
        kw.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
        cls = tf.Qwen3NextConfig
    else:
        raise ValueError(arch)
    kw.update(overrides)
    return cls(**kw)


def save_tiny_hybrid(arch: str, path: str, seed: int = 0, **overrides):
    """As ``save_tiny_model`` for ``tiny_hybrid_config(arch)``; eager attention."""
    config = tiny_hybrid_config(arch, **overrides)
    config._attn_implementation = "eager"
    return save_random_model(config, path, seed)


def _cached_attention(q, k, v, window, sinks, sm_scale):
    """Causal attention of T new queries (the last T positions) over all L keys.

    q: (T, Hq, D), k/v: (L, H, D), L >= T."""
    t, hq, _ = q.shape
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = torch.einsum("thd,shd->hts", q, k) * sm_scale
    qpos = torch.arange(k.shape[0] - t, k.shape[0])
    kpos = torch.arange(k.shape[0])
    mask = kpos[None, :] <= qpos[:, None]
    if window is not None:
        mask &= kpos[None, :] > qpos[:, None] - window
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks[:, None, None].expand(hq, t, 1)], dim=-1)
    probs = torch.softmax(logits.float(), dim=-1)[..., : k.shape[0]]
    return torch.einsum("hts,shd->thd", probs, v.float()).to(q.dtype)


class DenseStepFn:
    """A step object (``AttentionFn`` and ``StateFn``) for ONE sequence, dense and
    written from the ops' definitions (causal softmax attention, a depthwise causal
    conv, the delta rule token by token), independent of unikv's kernels.

    It keeps every layer's K/V, conv state (C, K) and delta-rule state (H, Dk, Dv)
    between calls, so one sequence may be fed in several steps (chunks, decode);
    states start at zero. ``conv[layer]`` / ``ssm[layer]`` expose them."""

    def __init__(self, windows, sm_scale):
        self.windows, self.sm_scale = windows, sm_scale
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}

    def __call__(self, layer, q, k, v, sinks=None):
        if layer in self.kv:
            k, v = torch.cat([self.kv[layer][0], k]), torch.cat([self.kv[layer][1], v])
        self.kv[layer] = (k, v)
        return _cached_attention(q, k, v, self.windows[layer], sinks, self.sm_scale)

    def causal_conv1d(self, layer, x, weight, bias, activation):
        """x: (T, C); weight: (C, K) -> (T, C): out[j] = act(sum_k w[:, k] seq[:, j+1+k] + b)."""
        c, kernel = weight.shape
        state = self.conv.get(layer, torch.zeros(c, kernel, dtype=x.dtype))
        seq = torch.cat([state, x.t()], dim=1)  # (C, K + T), oldest first
        out = torch.stack(
            [(weight * seq[:, j + 1 : j + 1 + kernel]).sum(-1) for j in range(x.shape[0])]
        )
        if bias is not None:
            out = out + bias
        if activation == "silu":
            out = torch.nn.functional.silu(out)
        self.conv[layer] = seq[:, -kernel:].clone()
        return out.to(x.dtype)

    def gated_delta_rule(self, layer, q, k, v, g, beta, *, scale, use_qk_l2norm, gating=None):
        """q, k: (T, Hk, Dk); v: (T, H, Dv); g, beta: (T, H) (raw a, b with ``gating`` =
        (A_log, dt_bias)) -> (T, H, Dv), token by token."""
        if gating is not None:  # transformers' gates, written out here
            a_log, dt_bias = gating
            g = -a_log.float().exp() * torch.nn.functional.softplus(g.float() + dt_bias)
            beta = beta.sigmoid()
        rep = v.shape[1] // q.shape[1]
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        h, dk, dv = q.shape[1], q.shape[2], v.shape[2]
        s = self.ssm.get(layer, torch.zeros(h, dk, dv))
        outs = []
        for t in range(q.shape[0]):
            qt, kt, vt = q[t].float(), k[t].float(), v[t].float()
            if use_qk_l2norm:
                qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
            qt = qt * scale
            s = s * g[t].float().exp()[:, None, None]
            kv = torch.einsum("hkv,hk->hv", s, kt)
            delta = (vt - kv) * beta[t].float()[:, None]
            s = s + kt[:, :, None] * delta[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", s, qt))
        self.ssm[layer] = s
        return torch.stack(outs).to(v.dtype)


# -- NemotronH (Mamba-2 / attention / MLP / MoE hybrid) ----------------------------------


def save_tiny_nemotron_h(path: str, pattern: str, seed: int = 0, **overrides):
    """A random-init transformers NemotronH of ``hybrid_override_pattern`` (M Mamba-2,
    * attention, - MLP, E MoE) saved to ``path``; returns the fp32 eval model (eager
    attention and experts). Odd shapes: attention head_dim 24, 6 mamba heads of dim
    12 in 2 groups, state size 10, conv kernel 4, chunk size 16; 6 experts in 2
    routing groups. D and the router's correction bias are drawn away from their
    trivial init (ones, zeros)."""
    import transformers as tf

    kw = {
        "vocab_size": VOCAB,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "mamba_num_heads": 6,
        "mamba_head_dim": 12,
        "n_groups": 2,
        "ssm_state_size": 10,
        "conv_kernel": 4,
        "chunk_size": 16,
        "n_routed_experts": 6,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "moe_intermediate_size": 40,
        "moe_shared_expert_intermediate_size": 24,
        "routed_scaling_factor": 1.5,
        "max_position_embeddings": 512,
        "initializer_range": 0.1,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
    }
    torch.manual_seed(seed)
    config = tf.NemotronHConfig(hybrid_override_pattern=pattern, **{**kw, **overrides})
    model = tf.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("e_score_correction_bias", "mixer.D")):
                p.copy_(torch.randn(p.shape) * 0.5)
    model.eval().save_pretrained(path)
    return model


# -- Falcon-H1 (attention and Mamba-2 side by side in every layer, muP multipliers) -----


def save_tiny_falcon_h1(path: str, seed: int = 0, **overrides):
    """A random-init transformers Falcon-H1 saved to ``path``; returns the fp32 eval
    model (eager attention). Odd shapes: 3 layers, attention head_dim 24, 6 mamba
    heads of dim 12 in 2 groups, state size 10, conv kernel 4, chunk size 16; every
    muP multiplier away from 1, and D drawn away from its init (ones)."""
    import transformers as tf

    kw = {
        **TINY,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 3,
        "head_dim": 24,
        "mamba_d_ssm": 72,
        "mamba_n_heads": 6,
        "mamba_n_groups": 2,
        "mamba_d_state": 10,
        "mamba_d_conv": 4,
        "mamba_chunk_size": 16,
        "ssm_multipliers": [0.5, 1.5, 0.75, 1.25, 0.8],
        "mlp_multipliers": [0.8, 1.2],
        "key_multiplier": 0.7,
        "attention_in_multiplier": 1.3,
        "attention_out_multiplier": 0.9,
        "ssm_in_multiplier": 1.1,
        "ssm_out_multiplier": 0.6,
        "embedding_multiplier": 2.0,
        "lm_head_multiplier": 1.5,
    }
    torch.manual_seed(seed)
    config = tf.FalconH1Config(**{**kw, **overrides})
    model = tf.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mamba.D"):
                p.copy_(torch.randn(p.shape) * 0.5)
    model.eval().save_pretrained(path)
    return model


class DenseMamba2Step:
    """A step object for one whole sequence (model tests): dense causal attention,
    and the causal conv and the Mamba-2 recurrence one token at a time from their
    definitions (state kept per layer, starting from zeros).

    ``min_dt`` records the smallest softplus'd step size before the clamp."""

    def __init__(self, sm_scale: float) -> None:
        self.sm_scale = sm_scale
        self.conv: dict[int, torch.Tensor] = {}  # layer -> (C, K)
        self.ssm: dict[int, torch.Tensor] = {}  # layer -> (H, P, N) fp32
        self.min_dt = float("inf")

    def __call__(self, layer, q, k, v, sinks=None):
        return dense_attention(q, k, v, None, sinks, self.sm_scale)

    def causal_conv1d(self, layer, x, weight, bias, activation):
        c, width = weight.shape
        state = self.conv.get(layer, x.new_zeros(c, width))
        out = []
        for t in range(x.shape[0]):
            state = torch.cat([state[:, 1:], x[t, :, None]], dim=1)  # last K inputs, oldest first
            y = (state * weight).sum(1) + (0 if bias is None else bias)
            out.append(torch.nn.functional.silu(y) if activation == "silu" else y)
        self.conv[layer] = state
        return torch.stack(out)

    def mamba2_ssd(self, layer, x, dt, A, B, C, D, dt_bias, *, dt_softplus, dt_limit):
        heads, p = x.shape[1:]
        rep = heads // B.shape[1]
        s = self.ssm.get(layer, x.new_zeros(heads, p, B.shape[2], dtype=torch.float32))
        out = []
        for t in range(x.shape[0]):
            step = dt[t].float() + dt_bias.float()
            step = torch.nn.functional.softplus(step) if dt_softplus else step
            self.min_dt = min(self.min_dt, step.min().item())
            step = step.clamp(*dt_limit)
            y = torch.empty(heads, p)
            for h in range(heads):
                b, c, xh = B[t, h // rep].float(), C[t, h // rep].float(), x[t, h].float()
                s[h] = s[h] * torch.exp(step[h] * A[h]) + torch.outer(step[h] * xh, b)
                y[h] = s[h] @ c + D[h].float() * xh
            out.append(y)
        self.ssm[layer] = s
        return torch.stack(out).to(x.dtype)


class GreedyReference:
    """A saved tiny model (``hf``, transformers' fp32 model saved at ``path``), random
    prompts of ``prompt_lens`` tokens and transformers' ``new_tokens`` greedy outputs
    for them."""

    def __init__(self, hf, path: str, prompt_lens, new_tokens: int, seed: int = 7) -> None:
        from unikv.engine.demo import hf_greedy as greedy  # (module-level name: a re-export)

        self.hf, self.path, self.new_tokens = hf, path, new_tokens
        g = torch.Generator().manual_seed(seed)
        self.prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in prompt_lens]
        self.greedy = [greedy(hf, p, new_tokens) for p in self.prompts]


class StepLogits:
    """``on_step`` hook: the logits row of every sampled token by (request id,
    position); ``cut`` counts lanes whose step ended inside their prompt."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], torch.Tensor] = {}
        self.cut = 0

    def __call__(self, llm, batch, logits) -> None:
        for i, r in enumerate(batch.requests):
            if r.num_pending == 1:  # this step sampled r's newest token
                self.rows[(r.request_id, r.seq_len - 1)] = logits[i].clone()
            elif r.num_cached < len(r.prompt_ids):
                self.cut += 1


def assert_pages_returned(llm) -> None:
    """Every page and state slot came back after a run: with prefix caching on, the
    cache alone holds pages, and dropping it (``reset_prefix_cache``, which keeps
    what any request still references) empties every sub-pool."""
    llm.reset_prefix_cache()
    for name in llm.pool.subpools:
        assert llm.alloc.parts.books[name].num_live == 0, f"{name}: pages left after the run"
    llm.alloc.check_integrity()


def check_engine_outputs(ref: GreedyReference, llm, outputs, rows=None, atol=1e-4) -> None:
    """The engine's tokens are transformers' greedy ones, every page and state slot
    came back, and (with ``rows``, a StepLogits) every sampled logit row equals
    transformers' teacher-forced whole-sequence logits at that position."""
    assert [o.output_ids for o in outputs] == ref.greedy
    assert_pages_returned(llm)
    if rows is None:
        return
    first_id = llm.requests.next_id - len(outputs)
    for k, out in enumerate(outputs):
        full = hf_logits(ref.hf, out.prompt_ids + out.output_ids)  # (L, V)
        mine = {p: row for (rid, p), row in rows.rows.items() if rid == first_id + k}
        assert len(mine) == len(out.output_ids)
        for p, row in mine.items():
            err = (row - full[p - 1]).abs().max().item()
            assert err < atol, f"request {k} position {p}: logits differ by {err}"


def engine_llm(ref: GreedyReference, **kw):
    """``LLM`` on ``ref``'s model on CPU; unless ``kw`` says otherwise: 8 sequences,
    32-token steps, 96 positions, 4-token pages."""
    from unikv.engine import LLM

    kw = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 32,
        "max_model_len": 96,
        "page_size": 4,
        **kw,
    }
    return LLM(ref.path, device="cpu", **kw)


def check_greedy_run(ref: GreedyReference, llm) -> None:
    """``llm`` generates ``ref``'s prompts greedily: transformers' tokens, and every
    sampled logit row transformers' (``check_engine_outputs`` with a StepLogits)."""
    from unikv.engine import SamplingParams

    rows = StepLogits()
    outputs = llm.generate(
        ref.prompts, SamplingParams(max_tokens=ref.new_tokens, temperature=0.0), on_step=rows
    )
    check_engine_outputs(ref, llm, outputs, rows)


def check_chunked_prefill(ref: GreedyReference, make_llm, step: int = 7) -> None:
    """``step``-token steps (``make_llm(ref, max_num_batched_tokens=step)``): some
    prompts end a step unfinished, and the tokens are transformers'."""
    from unikv.engine import SamplingParams

    rows = StepLogits()
    llm = make_llm(ref, max_num_batched_tokens=step)
    outputs = llm.generate(
        ref.prompts, SamplingParams(max_tokens=ref.new_tokens, temperature=0.0), on_step=rows
    )
    assert rows.cut > 0 and llm.stats.steps > sum(map(len, ref.prompts)) // step
    check_engine_outputs(ref, llm, outputs)


def check_tight_pool(ref: GreedyReference, make_llm, pages: int = 24) -> None:
    """``ref``'s prompts twice (reversed, then in order) in a pool of ``pages`` pages of
    4 tokens per sub-pool: requests are preempted and recomputed, same tokens."""
    from unikv.engine import SamplingParams
    from unikv.hf_config import specs_from_hf_config
    from unikv.pool import pool_bytes_for

    configs = specs_from_hf_config(ref.path, page_size=4, dtype=torch.float32)
    budget = pool_bytes_for(configs, {c.name: pages for c in configs})
    llm = make_llm(ref, kv_cache_bytes=budget, max_model_len=88, page_size=4)
    prompts = ref.prompts[::-1] + ref.prompts
    outputs = llm.generate(prompts, SamplingParams(max_tokens=ref.new_tokens, temperature=0.0))
    assert [o.output_ids for o in outputs] == ref.greedy[::-1] + ref.greedy
    assert llm.stats.preemptions > 0
    check_engine_outputs(ref, llm, outputs[len(ref.prompts) :])


def model_forward_error(ref: GreedyReference, num_tokens: int = 40, seed: int = 3) -> float:
    """Largest |logit| difference between ``load_model(ref.path)`` (``DenseAttention``,
    no pool) and transformers on one sequence of ``num_tokens`` random tokens."""
    from unikv.models import load_model

    model = load_model(ref.path)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_tokens,), generator=g)
    attn = DenseAttention(model.config.windows, model.config.sm_scale)
    ours = model(tokens, torch.arange(num_tokens), attn)
    return (ours - hf_logits(ref.hf, tokens.tolist())).abs().max().item()


def state_slot_bytes(llm, request_slot: int, slot_bytes: int) -> torch.Tensor:
    """A copy of the raw pool bytes of a request's recurrent-state slot (page p of
    the Mamba sub-pool lies at byte p * slot_bytes of the pool buffer)."""
    phys = int(llm.alloc.mamba_slots(torch.tensor([request_slot])).data[0])
    return llm.pool.buffer[phys * slot_bytes : (phys + 1) * slot_bytes].clone()


# -- Gemma-2 / Gemma-3 (sliding + full layers, soft-capping, sandwich norms) -------------


def tiny_gemma_config(arch: str, **overrides):
    """A tiny ``gemma2`` (6 layers, alternating sliding/full) or ``gemma3`` (text, 7
    layers: five sliding, one full, one sliding) transformers config with odd
    shapes: head_dim 24, window 7, ``query_pre_attn_scalar`` 16 (not head_dim),
    soft caps that bite (Gemma-2 attention 5.0; final 3.0). Gemma-3 is given the
    legacy rope fields (``rope_theta``, ``rope_local_base_freq``, a linear
    ``rope_scaling``) that transformers standardises per layer type."""
    import transformers as tf

    kw = dict(TINY, head_dim=24, sliding_window=7, query_pre_attn_scalar=16)
    kw["final_logit_softcapping"] = 3.0
    if arch == "gemma2":
        kw.update(num_hidden_layers=6, attn_logit_softcapping=5.0, rope_theta=10000.0)
        cls = tf.Gemma2Config
    elif arch == "gemma3":
        kw.update(num_hidden_layers=7, rope_theta=10000.0, rope_local_base_freq=100.0)
        kw["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}  # full layers only
        cls = tf.Gemma3TextConfig
    else:
        raise ValueError(arch)
    kw.update(overrides)
    return cls(**kw)


def save_tiny_gemma(arch: str, path: str, seed: int = 0, **overrides):
    """A random-init transformers Gemma-2 / Gemma-3 (``tiny_gemma_config``) saved to
    ``path``; returns the fp32 eval model with EAGER attention (transformers' SDPA
    path drops Gemma-2's attention soft-capping). Every RMSNorm weight is drawn
    away from its zero init, so ``(1 + w)`` differs from ``w`` and from 1."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_gemma_config(arch, **overrides)
    model = tf.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape) * 0.5)
    model.eval().save_pretrained(path)
    return model


# -- DeepSeek-V2 / V3 (multi-head latent attention + MoE) --------------------------------


def tiny_deepseek_config(version: int, **overrides):
    """A tiny ``deepseek_v2`` / ``deepseek_v3`` transformers config with odd MLA shapes:
    kv_lora_rank 24, rope dim 8, nope dim 12, v_head_dim 20, 4 heads; 3 layers (the
    first dense), 4 routed experts (top 2) in 2 groups, 2 shared experts. V2: no
    q_lora (``q_proj``, as V2-Lite), group-limited greedy routing, YaRN rope with
    mscale != mscale_all_dim (so both the cos/sin factor and the softmax mscale
    bite). V3: q_lora_rank 40, sigmoid routing with a correction bias, renormalised
    top-k, routed_scaling_factor 2.5, interleaved rope."""
    import transformers as tf

    kw = dict(TINY)
    kw.update(
        num_hidden_layers=3,
        num_key_value_heads=4,
        intermediate_size=96,
        kv_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=20,
        n_routed_experts=4,
        n_shared_experts=2,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
    )
    if version == 2:
        kw.update(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5)
        kw["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 128,
        }
        cls = tf.DeepseekV2Config
    elif version == 3:
        kw.update(q_lora_rank=40, routed_scaling_factor=2.5, norm_topk_prob=True)
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        cls = tf.DeepseekV3Config
    else:
        raise ValueError(version)
    kw.update(overrides)
    return cls(**kw)


def save_tiny_deepseek(version: int, path: str, seed: int = 0, **overrides):
    """A random-init transformers DeepSeek-V2 / V3 (``tiny_deepseek_config``) saved to
    ``path``; returns the fp32 eval model (eager attention and experts). V3's
    router correction bias is drawn away from its zero init."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_deepseek_config(version, **overrides)
    model = tf.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape) * 0.5)
    model.eval().save_pretrained(path)
    return model


class DenseMLAStep:
    """A step object for ONE sequence (model tests): the MLA op written from its
    definition, no pool. It keeps every layer's latent rows ``[c | k_rope]`` (L,
    rank + rope) between calls (``rows[layer]``), so a sequence may be fed in
    several steps; new token j of a step of T sits at position L - T + j and sees
    rows 0..its position: logits ``q_latent . c + q_rope . k_rope``, softmax, @ c."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def mla(self, layer, q_latent, q_rope, latent, rope, sm_scale):
        new = torch.cat([latent, rope], dim=-1)
        rows = torch.cat([self.rows[layer], new]) if layer in self.rows else new
        self.rows[layer] = rows
        rank, t, total = latent.shape[1], latent.shape[0], rows.shape[0]
        logits = torch.einsum("thr,lr->htl", q_latent.float(), rows[:, :rank].float())
        logits += torch.einsum("thp,lp->htl", q_rope.float(), rows[:, rank:].float())
        qpos = torch.arange(total - t, total)
        visible = torch.arange(total)[None, :] <= qpos[:, None]  # (T, L)
        probs = torch.softmax((logits * sm_scale).masked_fill(~visible, float("-inf")), dim=-1)
        out = torch.einsum("htl,lr->thr", probs, rows[:, :rank].float())
        return out.to(q_latent.dtype)
