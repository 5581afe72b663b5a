"""Load a model from a local Hugging Face checkpoint directory.

A directory holds ``config.json`` and the weights as ``model.safetensors`` or
shards listed in ``model.safetensors.index.json``; the tokenizer (optional)
comes from the same directory. Parameters are matched by name (unikv's modules
mirror transformers' names); a missing or unexpected tensor is an error, except
``lm_head.weight`` when the embeddings are tied. A fused projection (one GEMM
for q|k|v, one for gate|up) is filled with its checkpoint tensors concatenated
(``packed_params``). The model is built inside ``backend.building(ops)``: every
module takes the kernel backend of its device at construction (the elementwise ops,
the MoE, each variant decided once by ``get_backend``).
"""

from __future__ import annotations

import json
import logging
import os

import torch

from unikv.kernels.backend import building, get_backend
from unikv.models.config import TEXT_DECODERS, ModelConfig, model_config_from_hf
from unikv.models.decoder import DecoderLM
from unikv.models.fp8 import (
    SCALE_SUFFIX,
    Fp8Format,
    check_unscaled,
    dequantize_fp8,
    fp8_format,
    fp8_pairs,
)
from unikv.models.fp8_linear import keep_fp8
from unikv.models.mxfp4 import dequantize_mxfp4
from unikv.models.parallel import check_tp_config, shard_plan, shard_tensor
from unikv.models.registry import model_class

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _require_dir(model_dir: str) -> None:
    if not os.path.isdir(model_dir):
        raise ValueError(
            f"model directory {model_dir!r} does not exist; pass a local HF checkpoint dir"
        )
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(
            f"{model_dir!r} has no config.json; a Hugging Face checkpoint directory needs "
            "config.json and model.safetensors (or sharded safetensors with an index)"
        )


def load_model_config(model_dir: str) -> tuple[ModelConfig, object]:
    """(ModelConfig, the transformers config) of a checkpoint directory."""
    _require_dir(model_dir)
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, StrictDataclassError) as err:  # e.g. kv_lora_rank: null
        raise ValueError(f"cannot read {model_dir}/config.json with transformers: {err}") from err
    legacy_rope_parameters(hf_config, model_dir)
    fp8_format(hf_config)  # an unsupported quantization_config is refused here
    return model_config_from_hf(hf_config), hf_config


def legacy_rope_parameters(hf_config, model_dir: str) -> None:
    """transformers 4.x keeps a checkpoint's rope scaling in ``rope_scaling`` (and
    ``rope_theta``) and has no ``rope_parameters``; set ``rope_parameters`` from
    them (config.json's own fields first), in transformers 5's form, so that the
    scaling (llama3, yarn, linear) is not dropped. No-op under transformers 5."""
    if getattr(hf_config, "rope_parameters", None):
        return
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    scaling = raw.get("rope_scaling") or getattr(hf_config, "rope_scaling", None)
    if not isinstance(scaling, dict):
        return
    params = dict(scaling)
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    theta = raw.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is not None:
        params.setdefault("rope_theta", theta)
    hf_config.rope_parameters = params


def generation_eos_ids(model_dir: str) -> tuple[int, ...]:
    """The EOS ids of the checkpoint's ``generation_config.json`` (read with
    transformers' GenerationConfig), () without one. vLLM stops on these too."""
    if not os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        return ()
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {model_dir}/generation_config.json: {err}") from err
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint, sharded or not."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
    else:
        files = [os.path.join(model_dir, SINGLE_FILE)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(
            f"checkpoint {model_dir!r} lacks weight files {missing}; expected {SINGLE_FILE} or "
            f"the shards named in {INDEX_FILE}"
        )
    return files


def checkpoint_index(files: list[str]) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it (reads headers only)."""
    index = {}
    for path in files:
        with _open_weights(path) as f:
            index.update({name: path for name in f.keys()})  # noqa: SIM118 (not iterable)
    return index


def _open_weights(path: str):
    """``safe_open`` of one weights file; a truncated or corrupt file is a
    ValueError that names it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"cannot read weights file {path}: {err}. The file is truncated or corrupt "
            "(an interrupted download?); download or save it again"
        ) from err


def _sources(index: dict[str, str], raw=(), fp8=None) -> dict[str, tuple[str, ...]]:
    """Parameter name -> checkpoint tensor names: ``(name,)``, ``(blocks, scales)``
    for an MXFP4 pair dequantised at load (gpt-oss experts), or ``(weight,
    weight_scale_inv)`` for an FP8 block-quantised weight dequantised at load
    (``models/fp8.py``); a pair the model holds as parameters itself (``raw``: the
    checkpoint names it loads as they are: experts kept packed, FP8 weights and scales
    of ``fp8_linear.Fp8BlockLinear`` s) loads as is."""
    packed = ("_blocks", "_scales", SCALE_SUFFIX)
    sources = {n: (n,) for n in index if n in raw or not n.endswith(packed)}
    sources.update(fp8_pairs(index, raw, fp8))
    for name in index:
        if name.endswith("_blocks") and name not in raw:
            base = name[: -len("_blocks")]
            if base + "_scales" not in index:
                raise ValueError(
                    f"checkpoint has {name} but no {base}_scales; the MXFP4 pair is broken"
                )
            sources[base] = (name, base + "_scales")
    return sources


def _sinks_to_fp32(model: DecoderLM) -> None:
    """Attention sinks feed the kernels as fp32 (Hq,) vectors; they keep the
    model dtype's rounding (transformers holds them in the model dtype)."""
    for name, param in model.named_parameters():
        if name.endswith("sinks"):
            param.data = param.data.float()


def packed_params(model) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the checkpoint parameter names concatenated (on dim 0,
    in order) into it, for the fused modules' ``packed`` maps (``layers.Attention``'s
    ``qkv_proj`` from q/k/v_proj, ``GatedMLP``'s ``gate_up_proj`` from gate/up_proj);
    every other parameter is its own name."""
    out = {}
    for prefix, module in model.named_modules():
        base = f"{prefix}." if prefix else ""
        for fused, parts in getattr(module, "packed", {}).items():
            for p, _ in getattr(module, fused).named_parameters(recurse=False):
                out[f"{base}{fused}.{p}"] = tuple(f"{base}{part}.{p}" for part in parts)
    return out


def _check_names(model, wanted: dict, sources: dict, index: dict, ignored: tuple) -> None:
    """ValueError naming the checkpoint tensors the model lacks or does not know."""
    missing = sorted(
        c for n in wanted for c in wanted[n] if c not in sources or sources[c][0] not in index
    )
    known = {c for names in wanted.values() for c in names}
    unexpected = sorted(
        n
        for n in sources
        if n not in known and not n.endswith("inv_freq") and not n.startswith(ignored)
    )
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the {model.config.architecture} model: missing "
            f"{missing[:8]}{'...' if len(missing) > 8 else ''}, unexpected "
            f"{unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )


def _renamer(model):
    """(checkpoint name -> the model's name, prefixes to ignore): a wrapper's text
    decoder renamed (``TEXT_DECODERS``), every other name as it is."""
    ignored = tuple(getattr(model, "ignore_checkpoint_prefixes", ()))  # e.g. MTP heads
    if model.config.architecture not in TEXT_DECODERS:
        return (lambda n: n), ignored
    theirs, ours, skipped = TEXT_DECODERS[model.config.architecture]
    return (lambda n: ours + n[len(theirs) :] if n.startswith(theirs) else n), ignored + skipped


def _checkpoint_sources(model, index: dict[str, str], wanted: dict, fp8=None) -> tuple:
    """(checkpoint parameter name -> tensor names, prefixes to ignore), after a
    wrapper's renaming and tied embeddings; ``wanted``: parameter -> the (model-named)
    checkpoint parameters it is made of."""
    rename, ignored = _renamer(model)
    known = {c for names in wanted.values() for c in names}
    sources = _sources(index, {n for n in index if rename(n) in known}, fp8)
    sources = {rename(n): v for n, v in sources.items()}
    arch = model.config.architecture
    if arch in TEXT_DECODERS:  # a wrapper's text decoder only
        skipped = TEXT_DECODERS[arch][2]
        left = sum(n.startswith(skipped) for n in sources)
        if left:
            logger.info(
                "%s: loading its text decoder only; %d checkpoint tensors under %s (the "
                "vision tower) are not loaded, and requests carrying images are refused",
                arch, left, ", ".join(skipped),
            )  # fmt: skip
    if model.config.tie_word_embeddings and "lm_head.weight" not in sources:
        embed = "model.embed_tokens.weight"  # a wrapper's embedding keeps its own name
        sources["lm_head.weight"] = sources.get(embed, (embed,))
    return sources, ignored


def _keep_fp8(model, index: dict[str, str], handles: dict, fp8) -> None:
    """The model's linears whose checkpoint weights are FP8 become ``Fp8BlockLinear`` s
    (``fp8_linear.keep_fp8``), then the model re-derives its fused paths (``rebind``)."""
    rename, _ = _renamer(model)
    theirs = {rename(n): n for n in index}

    def shape(name: str) -> tuple[int, ...]:
        return tuple(handles[index[theirs[name]]].get_slice(theirs[name]).get_shape())

    if keep_fp8(model, theirs.__contains__, shape, packed_params(model), fp8):
        model.rebind()


def load_weights(model: DecoderLM, files: list[str], fp8: Fp8Format | None = None) -> None:
    """Copy checkpoint tensors into ``model`` by name, one tensor at a time
    (FP8 weights of format ``fp8`` kept as they are, with their scales, in the
    ``Fp8BlockLinear`` s that replace the linears holding them, ``_keep_fp8``; MXFP4
    experts and the FP8 weights left to dense modules dequantised on the way, the
    latter on the parameter's device in its dtype; under ``model.tp`` each sharded
    tensor narrowed to this rank's slice; a fused parameter is the concatenation
    of its checkpoint tensors, each narrowed first (by the part's own entry of the
    shard plan where it has one, e.g. Gated DeltaNet's [q | k | v] segments), so every
    rank holds its own q|k|v or gate|up rows); raise ValueError naming missing, unexpected or
    mis-shaped tensors."""
    index = checkpoint_index(files)
    handles = {path: _open_weights(path) for path in files}
    if fp8 is not None:
        _keep_fp8(model, index, handles, fp8)
    params = dict(model.named_parameters())
    packed = packed_params(model)
    wanted = {n: packed.get(n, (n,)) for n in params}
    sources, ignored = _checkpoint_sources(model, index, wanted, fp8)
    _check_names(model, wanted, sources, index, ignored)
    tp = model.tp
    plan = shard_plan(model) if tp is not None else {}
    with torch.no_grad():
        for name, param in params.items():
            parts = []
            for part in wanted[name]:
                tensors = [_tensor(handles, index[n], n) for n in sources[part]]
                source = _source_tensor(sources[part], tensors, param, fp8)
                spec = plan.get(part, plan.get(name))  # a packed part's own, else its param's
                if spec is not None:  # tensor parallelism: this rank's slice
                    source = shard_tensor(source, spec, tp.rank, tp.size, part)
                parts.append(source)
            if len(parts) > 1:  # a dequantised part is on the param's device, a raw one not
                source = torch.cat([p.to(param.device) for p in parts], dim=0)
            else:
                source = parts[0]
            if tuple(source.shape) != tuple(param.shape):
                scale = name.endswith(SCALE_SUFFIX)  # an FP8 linear's block scales
                raise ValueError(
                    f"tensor {name}: expected shape {tuple(param.shape)} (the model's"
                    f"{', in blocks of weight_block_size' if scale else ''}), given "
                    f"{tuple(source.shape)} (from {list(wanted[name])}); "
                    + ("the checkpoint's scales and weight_block_size disagree" if scale
                       else "config.json and the weights disagree")
                )  # fmt: skip
            param.copy_(source)


def _source_tensor(names: tuple, tensors: list, param: torch.Tensor, fp8) -> torch.Tensor:
    """One checkpoint tensor as stored, or a quantised pair dequantised."""
    if len(tensors) == 2 and names[1].endswith(SCALE_SUFFIX):
        return dequantize_fp8(*tensors, fp8, param.dtype, param.device, name=names[0])
    if len(tensors) == 2:
        return dequantize_mxfp4(*tensors)
    check_unscaled(names[0], tensors[0], param.dtype)
    return tensors[0]


def _tensor(handles: dict, path: str, name: str) -> torch.Tensor:
    from safetensors import SafetensorError

    try:
        return handles[path].get_tensor(name)
    except SafetensorError as err:
        raise ValueError(
            f"cannot read tensor {name} from weights file {path}: {err}; the file is "
            "truncated or corrupt, download or save it again"
        ) from err


def load_model(
    model_dir: str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_positions: int | None = None,
    tp=None,
    kernels: str | None = None,
) -> DecoderLM:
    """Build the model of a checkpoint directory and load its weights.

    ``max_positions``: rope table length (default: the config's
    ``max_position_embeddings``). ``tp``: None, or a
    ``models.parallel.TensorParallel``: load only this rank's shard.
    ``kernels``: the kernel backend the modules call, None (Triton on CUDA, torch
    elsewhere), ``"triton"`` or ``"torch"``, as ``kernels.get_backend`` (its
    elementwise ops and its MoE, taken by each module at construction)."""
    ops = get_backend(device, kernels)  # validated before anything is built
    config, hf_config = load_model_config(model_dir)
    if tp is not None:
        check_tp_config(config, tp.size)
    files = weight_files(model_dir)
    max_positions = max_positions or config.max_position_embeddings
    fp8 = fp8_format(hf_config)
    with torch.device("meta"), building(ops):
        model = model_class(config.family)(config, max_positions, tp)
    model = model.to(dtype)  # still on the meta device: no memory yet
    if fp8 is not None:  # FP8 modules made here, so their 16-bit twins are never allocated
        index = checkpoint_index(files)
        _keep_fp8(model, index, {path: _open_weights(path) for path in set(index.values())}, fp8)
    model = model.to_empty(device=device)  # no full-precision copy on the device
    model.build(torch.device(device))  # the rope tables, fp32 parameters (decoder.DecoderLM)
    load_weights(model, files, fp8)
    for module in model.modules():  # e.g. MXFP4 experts re-packed for the backend's kernel
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    _sinks_to_fp32(model)
    return model.eval().requires_grad_(False)


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer via ``transformers.AutoTokenizer``, or None
    when the directory has no tokenizer files (prompts must then be token ids)."""
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any(os.path.isfile(os.path.join(model_dir, n)) for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
