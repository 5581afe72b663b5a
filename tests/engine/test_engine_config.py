"""``EngineConfig``: each field's validation (the field named, the config left as it
was), the CLI's flags against the fields (the real parsers of ``unikv generate`` and
``unikv serve``), pickling, and an engine built from a config against transformers."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from engine_fixtures import (
    GreedyReference,
    one_thread,  # noqa: F401  (a fixture)
    save_tiny_model,
)

from unikv.engine.config import CLI_ALIASES, CLI_DESTS, EngineConfig, flag_of
from unikv.engine.speculative.config import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")
GOOD = EngineConfig(model="some/checkpoint", device="cpu")

# (field, a bad value, the error type, a pattern its message must match)
BAD = [
    ("model", "", ValueError, "model must be a checkpoint directory"),
    ("model", None, ValueError, "model must be"),
    ("device", "tpu", ValueError, "device must be"),
    ("dtype", "fp8", ValueError, "dtype is the weights'.*bf16, fp16 or fp32"),
    ("kv_cache_dtype", "bf16", ValueError, "kv_cache_dtype must be 'auto'"),
    ("kv_cache_bytes", 0, ValueError, "kv_cache_bytes must be None .* or an int > 0, got 0"),
    ("kv_cache_bytes", True, ValueError, "kv_cache_bytes must be"),
    ("kv_cache_max_bytes", 0, ValueError, "kv_cache_max_bytes must be None or an int > 0"),
    ("kv_cache_margin_bytes", -1, ValueError, "kv_cache_margin_bytes must be None or an int >= 0"),
    ("kv_cache_margin_bytes", 1 << 20, ValueError, "kv_cache_margin_bytes .*CUDA only"),
    ("memory_fraction", 1.5, ValueError, r"memory_fraction must be a number in \(0, 1\]"),
    ("memory_fraction", 0, ValueError, "memory_fraction must be"),
    ("page_size", 0, ValueError, "page_size must be a positive int, got 0"),
    ("max_num_seqs", -3, ValueError, "max_num_seqs must be a positive int"),
    ("max_num_batched_tokens", "512", ValueError, "max_num_batched_tokens must be a positive int"),
    ("max_model_len", 1, ValueError, "max_model_len must be None .* or an int >= 2"),
    ("max_prefill_tokens_decoding", 0, ValueError, "max_prefill_tokens_decoding must be None"),
    ("admission_window_ms", -1, ValueError, r"admission_window_ms must be a number .*\[0, 1000\]"),
    ("cuda_graphs", "yes", ValueError, "cuda_graphs must be True, False or None"),
    ("prefill_graphs", "yes", ValueError, "prefill_graphs must be True or False"),
    ("prefill_graph_tokens", 0, ValueError, "prefill_graph_tokens must be None .* or an int >= 1"),
    ("backend", "cuda", ValueError, "backend must be None .*'torch' or 'triton'"),
    ("seed", 1.5, ValueError, "seed must be an int"),
    ("debug", 1, ValueError, "debug must be True or False"),
    ("tensor_parallel_size", 0, ValueError, "tensor_parallel_size must be an int >= 1"),
    ("static_split", [0.5, 0.5], TypeError, "static_split must be None or a mapping"),
    ("enable_prefix_caching", "yes", TypeError, "enable_prefix_caching must be True, False"),
    ("prefix_host_bytes", -1, ValueError, "prefix_host_bytes must be an int >= 0"),
    ("swap_host_bytes", 2.5, ValueError, "swap_host_bytes must be an int >= 0"),
    ("preemption", "always", ValueError, "preemption must be one of"),
    ("preemption", "swap", ValueError, "preemption='swap' .* swap_host_bytes is 0"),
    ("speculative_config", {"method": "beam"}, ValueError, r"speculative_config\['method'\]"),
    ("speculative_config", "{not json", ValueError, "speculative_config must be a JSON object"),
    (
        "speculative_config",
        {"method": "ngram", "num_speculative_tokens": 2, "force_accept": True},
        ValueError,
        "force_accept'\\] is a benchmark-only mode",
    ),
    (
        "speculative_disable_by_batch_size",
        0,
        ValueError,
        "speculative_disable_by_batch_size must be None or an int >= 1",
    ),
    ("speculative_disable_by_batch_size", 8, ValueError, "give speculative_config too"),
]


def test_every_field_has_a_bad_value_case():
    from unikv.engine.config import PREEMPTION_MODES
    from unikv.io.swap import MODES

    assert {f.name for f in dataclasses.fields(EngineConfig)} == {b[0] for b in BAD}
    assert PREEMPTION_MODES == MODES  # the config refuses what the swap policy would


@pytest.mark.parametrize(
    ("name", "value", "error", "match"), BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD]
)
def test_a_bad_value_is_refused_naming_the_field_and_nothing_changes(name, value, error, match):
    before = pickle.dumps(GOOD)
    with pytest.raises(error, match=match) as err:
        dataclasses.replace(GOOD, **{name: value})
    assert name.split("_")[0] in str(err.value)  # the field (or its family) is named
    assert pickle.dumps(GOOD) == before  # the config it was made from is as it was
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(GOOD, name, value)  # a config changes only by making a new one


def test_defaults_resolve_device_dtype_and_speculation():
    c = EngineConfig(model="m", device="cpu", speculative_config='{"method": "ngram", '
                     '"num_speculative_tokens": 3}')  # fmt: skip
    assert c.device == torch.device("cpu") and c.dtype == torch.float32  # fp32 on the CPU
    assert c.speculative_config == SpeculativeConfig("ngram", 3)  # parsed from vLLM's JSON
    assert EngineConfig(model="m", device="cpu", dtype="bf16").dtype == torch.bfloat16


def test_llm_keywords_make_the_same_config():
    """``LLM``'s keyword names (``model_dir`` included) make the config of the same
    fields; an unknown name and a checkpoint given twice are refused."""
    a = EngineConfig.of("m", device="cpu", page_size=4, max_num_seqs=3)
    b = EngineConfig.of(model_dir="m", device="cpu", page_size=4, max_num_seqs=3)
    c = EngineConfig(model="m", device="cpu", page_size=4, max_num_seqs=3)
    assert a == b == c
    with pytest.raises(TypeError, match="unknown engine options \\['max_batch'\\]"):
        EngineConfig.of("m", device="cpu", max_batch=3)
    with pytest.raises(ValueError, match="once"):
        EngineConfig.of("m", model="m")
    with pytest.raises(ValueError, match="once"):
        EngineConfig.of(device="cpu")


def test_pickles_whole():
    c = EngineConfig(model="m", device="cpu", page_size=4, static_split={"full": 1.0},
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                     enable_prefix_caching=False, swap_host_bytes=1 << 20, preemption="swap")  # fmt: skip
    back = pickle.loads(pickle.dumps(c))
    assert back == c and back is not c
    assert [getattr(back, f.name) for f in dataclasses.fields(c)] == [
        getattr(c, f.name) for f in dataclasses.fields(c)
    ]


# -- the command line ---------------------------------------------------------------------


def _parsers():
    from unikv.engine.cli import _generate_parser
    from unikv.serving.cli import _parser

    return {"generate": _generate_parser(), "serve": _parser()}


def _engine_actions(parser):
    group = next(g for g in parser._action_groups if g.title == "engine (EngineConfig)")
    return group._group_actions


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_engine_flag_is_a_field_of_its_name(command):
    """Each engine flag's first name is ``--<field>`` (``flag_of``), every field has
    one, and every other name of a flag is a listed alias of that field."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    actions = _engine_actions(_parsers()[command])
    by_field = {}
    for action in actions:
        field = {v: k for k, v in CLI_DESTS.items()}.get(action.dest, action.dest)
        assert field in fields, f"{action.option_strings} sets {action.dest}, no field"
        assert action.option_strings[0] == flag_of(field)
        for alias in action.option_strings[1:]:
            assert CLI_ALIASES.get(alias) == field or alias == f"--no-{field.replace('_', '-')}"
        by_field[field] = action
    assert set(by_field) == fields


# every field set away from its default on the command line, and the value it must give
ARGV = {
    "model": ("--model", "org/tiny", "org/tiny"),
    "device": ("--device", "cpu", torch.device("cpu")),
    "dtype": ("--dtype", "bf16", torch.bfloat16),
    "kv_cache_dtype": ("--kv-cache-dtype", "fp8", "fp8"),
    "kv_cache_bytes": ("--kv-cache-bytes", "3MiB", 3 << 20),
    "kv_cache_max_bytes": ("--kv-cache-max-bytes", "5MiB", 5 << 20),
    "kv_cache_margin_bytes": None,  # CUDA only: a case of its own below
    "memory_fraction": ("--memory-fraction", "0.5", 0.5),
    "page_size": ("--page-size", "8", 8),
    "max_num_seqs": ("--max-num-seqs", "7", 7),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "96", 96),
    "max_model_len": ("--max-model-len", "128", 128),
    "max_prefill_tokens_decoding": ("--max-prefill-tokens-decoding", "32", 32),
    "admission_window_ms": ("--admission-window-ms", "2.5", 2.5),
    "cuda_graphs": ("--no-cuda-graphs", None, False),
    "prefill_graphs": ("--prefill-graphs", None, True),
    "prefill_graph_tokens": ("--prefill-graph-tokens", "512", 512),
    "backend": ("--backend", "torch", "torch"),
    "seed": ("--engine-seed", "11", 11),
    "debug": ("--debug", None, True),
    "tensor_parallel_size": ("--tensor-parallel-size", "2", 2),
    "static_split": ("--static-split", '{"full": 1.0}', {"full": 1.0}),
    "enable_prefix_caching": ("--no-enable-prefix-caching", None, False),
    "prefix_host_bytes": ("--prefix-host-bytes", "2KiB", 2048),
    "swap_host_bytes": ("--swap-host-bytes", "1KiB", 1024),
    "preemption": ("--preemption", "swap", "swap"),
    "speculative_config": (
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 2}',
        SpeculativeConfig("ngram", 2, disable_by_batch_size=8),  # the next flag's 8
    ),
    "speculative_disable_by_batch_size": ("--speculative-disable-by-batch-size", "8", 8),
}


def _argv(cases) -> list[str]:
    out = []
    for case in cases.values():
        if case is not None:
            out += [case[0]] if case[1] is None else [case[0], case[1]]
    return out


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_from_cli_round_trip(command):
    parser = _parsers()[command]
    extra = ["--prompt", "x"] if command == "generate" else []
    config = EngineConfig.from_cli(parser.parse_args(_argv(ARGV) + extra))
    assert set(ARGV) == {f.name for f in dataclasses.fields(EngineConfig)}
    for name, case in ARGV.items():
        want = case[2] if case is not None else None
        assert getattr(config, name) == want, name
    # the defaults: no flag gives EngineConfig's own defaults
    assert EngineConfig.from_cli(parser.parse_args(["--model", "m", *extra])) == EngineConfig(
        model="m"
    )


def test_old_flag_names_and_vllms_are_aliases():
    parser = _parsers()["serve"]
    new = ["--model", "m", "--device", "cpu", "--kv-cache-bytes", "2MiB", "--page-size", "8",
           "--max-num-batched-tokens", "64", "--memory-fraction", "0.5", "--tensor-parallel-size",
           "2"]  # fmt: skip
    old = ["--model", "m", "--device", "cpu", "--kv-cache", "2MiB", "--block-size", "8",
           "--chunk", "64", "--gpu-memory-utilization", "0.5", "-tp", "2"]  # fmt: skip
    a, b = (EngineConfig.from_cli(parser.parse_args(v)) for v in (new, old))
    assert a == b and (a.kv_cache_bytes, a.page_size, a.max_num_batched_tokens) == (2 << 20, 8, 64)
    # generate's --seed seeds requests, not the engine (--engine-seed does)
    args = _parsers()["generate"].parse_args(["--model", "m", "--device", "cpu", "--seed", "5"])
    assert EngineConfig.from_cli(args).seed == 0 and args.seed == 5
    with pytest.raises(ValueError, match="byte size"):
        EngineConfig.from_cli(parser.parse_args(["--model", "m", "--kv-cache", "lots"]))


# -- an engine from a config ------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    return GreedyReference(save_tiny_model("llama", path), path, [5, 11, 3], new_tokens=6)


def test_an_llm_from_a_config_matches_transformers(llama):
    from unikv.engine import LLM, SamplingParams

    config = EngineConfig(model=llama.path, device="cpu", page_size=4, max_model_len=64)
    llm = LLM(pickle.loads(pickle.dumps(config)))  # as the TP workers and the engine process
    assert llm.engine_config == config
    params = SamplingParams(max_tokens=llama.new_tokens, temperature=0.0, ignore_eos=True)
    assert [o.output_ids for o in llm.generate(llama.prompts, params)] == llama.greedy


def test_the_built_pieces_run_without_an_llm(llama):
    """build_engine's pieces alone (the loop, the request maker) serve requests."""
    from unikv.engine.build import build_engine
    from unikv.engine.inline import run_inline
    from unikv.engine.online import EngineLoop
    from unikv.engine.prompts import PromptMaker
    from unikv.engine.request_maker import RequestMaker
    from unikv.engine.sampling import SamplingParams

    core = build_engine(EngineConfig(model=llama.path, device="cpu", page_size=4,
                                     max_model_len=64, max_num_seqs=2))  # fmt: skip
    prompts = PromptMaker(core.tokenizer, core.tokenizer_lock, core.model_config, 64)
    requests = RequestMaker(core, prompts, seed=0)
    params = SamplingParams(max_tokens=llama.new_tokens, temperature=0.0, ignore_eos=True)
    groups = requests.make_groups(llama.prompts, params)
    stats = run_inline(EngineLoop(core), groups, use_tqdm=False)
    assert [g.requests[0].output_ids for g in groups] == llama.greedy
    assert stats.num_requests == 3 and requests.next_id == 3
    core.reset_prefix_now()  # the prefix cache alone held pages: every one comes back
    assert all(b.num_live == 0 for b in core.alloc.parts.books.values())
    core.alloc.check_integrity()
