"""Launcher-side argument checks and buffers shared by the Triton kernels (host only, no syncs)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def has_tensor_descriptor() -> bool:
    """Whether Triton has host tensor descriptors (else pointer loads only); asked on
    the first TMA question, so that importing these checks (the torch references do)
    loads no Triton."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


ID_DTYPES = (torch.int32, torch.int64)


def check_ids(name: str, ids: torch.Tensor, dim: int = 1) -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(ids).__name__} (pass KernelIds.data)")
    if ids.dtype not in ID_DTYPES or ids.dim() != dim:
        raise ValueError(
            f"{name} must be a {dim}-D int32/int64 tensor, got {ids.dtype} with shape "
            f"{tuple(ids.shape)}"
        )


def check_cache(name: str, cache: torch.Tensor, heads: int | None = None) -> None:
    """A kernel view: dense rows (N, H, D) or page-strided (E, ps, H, D), unit
    stride on D (rows and pages may be strided; ``layout.mha_dense_views``)."""
    if cache.dim() not in (3, 4):
        raise ValueError(
            f"{name} must be a 3-D (N, H, D) or 4-D (entries, ps, H, D) kernel view, got "
            f"shape {tuple(cache.shape)}"
        )
    if cache.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride on head_dim, got strides {cache.stride()}; pass the "
            "per-layer kernel view from unikv.layout.mha_dense_views"
        )
    if heads is not None and cache.shape[-2] != heads:
        raise ValueError(f"{name} has {cache.shape[-2]} heads, expected {heads}")


def view_strides(name: str, cache: torch.Tensor, page_size: int) -> tuple[int, int, int]:
    """``(block_stride, row_stride, head_stride)`` of a kernel view, in elements: row
    (entry e, slot s) starts at ``e * block_stride + s * row_stride`` (``_ids.row_offset``).
    A dense 3-D view has ``block_stride = ps * row_stride``; a 4-D view must have
    ``ps`` slots. Decided by the view the pool built, once; no device work."""
    if cache.dim() == 3:
        return page_size * cache.stride(0), cache.stride(0), cache.stride(1)
    if cache.shape[1] != page_size:
        raise ValueError(
            f"{name} is a 4-D (entries, ps, H, D) view with {cache.shape[1]} slots per entry, "
            f"but page_size is {page_size}; pass the sub-pool's page size"
        )
    return cache.stride(0), cache.stride(1), cache.stride(2)


def check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must live on one device, got {sorted(map(str, devices))}")


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200); 8 on CPU."""
    if device_index < 0 or not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    return (
        num_sms(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else num_sms(-1)
    )


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def as_storage(name: str, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``x`` reinterpreted with the cache's storage dtype when the item sizes match
    (fp8 rows into a uint8 cache); anything else is a dtype the spec does not hold."""
    if x.dtype == cache.dtype:
        return x
    if x.element_size() != cache.element_size():
        raise ValueError(
            f"{name} has dtype {x.dtype} but the cache stores {cache.dtype}; pass K/V in the "
            "spec's logical dtype (fp8 tensors are bit-copied into a uint8 cache)"
        )
    return x.view(cache.dtype)


def out_buffer(
    out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    """``out`` checked to be ``shape`` with unit last stride, or a new tensor of that
    shape in ``like``'s dtype and device (an attention launcher's output)."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if out.shape != shape or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {shape} with unit last stride, got {tuple(out.shape)} strides "
            f"{out.stride()}"
        )
    return out


def workspace_numel(rows: int, heads: int, width: int, num_splits: int) -> int:
    """fp32 elements of a split-KV workspace: acc (``width``) and lse of every
    (row, head, split); rows are decode requests or tokens."""
    return rows * heads * num_splits * (width + 1)


def split_workspace(
    workspace: torch.Tensor | None,
    rows: int,
    heads: int,
    width: int,
    num_splits: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(acc, lse) fp32 parts of a split-KV workspace: acc (rows * heads * S * width,)
    row-major over (row, head, split), then lse (rows * heads * S,). ``workspace``:
    None (allocated here) or fp32 with >= ``workspace_numel`` elements (CUDA graphs).
    With one split both parts are the whole (>= 1 element) buffer, a pointer the
    kernels never read."""
    need = workspace_numel(rows, heads, width, num_splits) if num_splits > 1 else 1
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=device)
    elif workspace.dtype != torch.float32 or workspace.numel() < need:
        raise ValueError(
            f"workspace must be fp32 with >= {need} elements (workspace_numel), got "
            f"{workspace.dtype} x {workspace.numel()}"
        )
    if num_splits == 1:
        return workspace, workspace
    acc_numel = rows * heads * num_splits * width
    return workspace[:acc_numel], workspace[acc_numel:need]


@functools.cache
def _tma_device(device: torch.device) -> bool:
    """TMA exists on Hopper and newer; the CPU interpreter emulates it."""
    return device.type == "cpu" or (
        device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    )


def tma_ok(x: torch.Tensor) -> bool:
    """Whether a (T, H, D) tensor can back a ``(T, H * D)`` TMA descriptor with boxes of
    one head's D columns (host only): D a power of two of 16 bytes to 256 columns (a TMA
    box's widest), 16-byte-aligned base and row stride, heads contiguous."""
    size = x.element_size()
    return (
        has_tensor_descriptor()
        and _tma_device(x.device)
        and x.shape[0] > 0
        and x.shape[2] == next_pow2(x.shape[2])
        and x.shape[2] <= 256
        and x.shape[2] * size >= 16
        and x.stride(1) == x.shape[2]
        and x.data_ptr() % 16 == 0
        and (x.stride(0) * size) % 16 == 0
    )
