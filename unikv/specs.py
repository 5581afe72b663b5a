"""Sub-pool specs: a frozen description of what one slot of a sub-pool holds.

Everything geometric derives from a spec (docs/design.md section 1): entry bytes,
page bytes for a page size, blocks per page, the view tail pad and the byte
offset of each (layer, part) inside a page. No other module restates these
formulas.

    MHA page envelope:  [L0_K x ps | L0_V x ps | L1_K x ps | L1_V x ps | ... ]
    MLA page envelope:  [L0_lat x ps | L1_lat x ps | ... ]
    Mamba slot:         [conv part 0, all layers]...[temporal, all layers]

Asymmetric K/V (head_dim != v_head_dim) is stored without padding: a K row is
``H * head_dim`` wide, a V row ``H * v_head_dim``, so ``entry_bytes`` is exactly
``L * H * (head_dim + v_head_dim) * itemsize``. Its row-blocks then differ in
size, so its kernel id multiplier (``blocks_per_page``) is 1 and kernels reach a
row through a page stride (docs/design.md sections 1-3).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields

import torch

FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8, *FP8_DTYPES)


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the buffer is viewed with: fp8 is stored as raw bytes (uint8)."""
    return torch.uint8 if dtype in FP8_DTYPES else dtype


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_positive(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def _check_dtype(owner: str, name: str, value: object) -> None:
    if value not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"{owner}.{name} must be one of {names}; got {value!r}")


def _check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")


class _PagedSpec:
    """Shared geometry of specs whose page is an array of (layer, part) row-blocks.

    A page of ``ps`` slots holds, for each layer in order and each part in order,
    a block of ``ps`` rows of that part (``part_row_bytes(part)`` each). When every
    part's rows have one width (``uniform_rows``) the page is ``B = L * len(parts)``
    equal blocks and a kernel id addresses a row of one dense view per (layer,
    part); otherwise (asymmetric K/V) the id multiplier is 1 and a kernel id is
    the physical token id, read through a page stride (``layout.IdMap``).
    """

    num_layers: int
    parts: tuple[str, ...]
    dtype: torch.dtype  # a field of each subclass (this base is no dataclass)

    def part_row_elems(self, part: str) -> int:
        """Elements of one row of ``part`` (one token, one layer)."""
        raise NotImplementedError

    def part_row_bytes(self, part: str) -> int:
        """Bytes of one row of ``part`` (one token, one layer)."""
        return self.part_row_elems(part) * self.itemsize

    @property
    def uniform_rows(self) -> bool:
        """Whether every part's rows have one width (a page of equal row-blocks)."""
        return len({self.part_row_elems(p) for p in self.parts}) == 1

    @property
    def row_elems(self) -> int:
        """Elements of one row, when every part's rows have one width."""
        if not self.uniform_rows:
            widths = {p: self.part_row_elems(p) for p in self.parts}
            raise ValueError(
                f"{type(self).__name__} rows differ per part ({widths} elements); "
                "use part_row_elems(part) / part_row_bytes(part)"
            )
        return self.part_row_elems(self.parts[0])

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one token, one layer, one part), when rows are uniform."""
        return self.row_elems * self.itemsize

    @property
    def itemsize(self) -> int:
        return _itemsize(storage_dtype(self.dtype))

    @property
    def storage_dtype(self) -> torch.dtype:
        return storage_dtype(self.dtype)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's rows (every part) of one token."""
        return sum(self.part_row_bytes(p) for p in self.parts)

    @property
    def entry_bytes(self) -> int:
        """Bytes of one slot: every layer's rows for one token, no padding."""
        return self.num_layers * self.layer_bytes

    @property
    def blocks_per_page(self) -> int:
        """The kernel id multiplier B: kernel page entry = physical page * B.

        Uniform rows: the page's number of row-blocks (``L * len(parts)``), so
        one dense view per (layer, part) serves every kernel id. Otherwise 1:
        kernel ids are physical token ids and views carry the page stride."""
        return self.num_layers * len(self.parts) if self.uniform_rows else 1

    def page_bytes(self, page_size: int) -> int:
        _check_page_size(page_size)
        return page_size * self.entry_bytes

    def view_tail_pad_bytes(self, page_size: int) -> int:
        """Bytes the last row-block's dense view runs past the last page (uniform
        rows: ``(B - 1) * ps`` rows; page-strided views end inside their page: 0)."""
        _check_page_size(page_size)
        if not self.uniform_rows:
            return 0
        return (self.blocks_per_page - 1) * page_size * self.row_bytes

    def block_index(self, layer: int, part: str) -> int:
        """Which row-block of a page envelope holds (layer, part), in byte order."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        if part not in self.parts:
            raise ValueError(f"part must be one of {self.parts}, got {part!r}")
        return layer * len(self.parts) + tuple.index(self.parts, part)

    def part_offset(self, layer: int, part: str, page_size: int) -> int:
        """Byte offset of (layer, part)'s rows inside a page envelope:
        ``ps * (layer * layer_bytes + the row bytes of the parts before it)``."""
        index = self.block_index(layer, part) - layer * len(self.parts)
        before = sum(self.part_row_bytes(p) for p in self.parts[:index])
        return page_size * (layer * self.layer_bytes + before)

    def fingerprint(self) -> str:
        return _fingerprint(self)  # type: ignore[arg-type]  # each subclass is a Spec


@dataclass(frozen=True)
class MHASpec(_PagedSpec):
    """Full or sliding-window attention K/V. ``sliding_window`` counts the keys a
    query sees, itself included (transformers' convention)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    dtype: torch.dtype = torch.bfloat16
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            _check_positive("MHASpec", name, getattr(self, name))
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        _check_positive("MHASpec", "v_head_dim", self.v_head_dim)
        _check_dtype("MHASpec", "dtype", self.dtype)
        if self.sliding_window is not None:
            _check_positive("MHASpec", "sliding_window", self.sliding_window)

    parts = ("k", "v")

    @property
    def kind(self) -> str:
        return "swa" if self.sliding_window is not None else "full"

    @property
    def is_asymmetric(self) -> bool:
        return self.head_dim != self.v_head_dim

    def part_row_elems(self, part: str) -> int:
        """K rows are ``H * head_dim`` wide, V rows ``H * v_head_dim`` (no padding)."""
        if part not in self.parts:
            raise ValueError(f"part must be one of {self.parts}, got {part!r}")
        v_dim = self.head_dim if self.v_head_dim is None else self.v_head_dim  # set post-init
        return self.num_kv_heads * (self.head_dim if part == "k" else v_dim)


@dataclass(frozen=True)
class MLASpec(_PagedSpec):
    """Multi-head latent attention: one latent row per layer and token; V is a
    prefix of it (``kv_lora_rank`` wide), the rope part follows."""

    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_lora_rank", "rope_dim"):
            _check_positive("MLASpec", name, getattr(self, name))
        _check_dtype("MLASpec", "dtype", self.dtype)

    parts = ("latent",)
    kind = "mla"
    sliding_window = None

    def part_row_elems(self, part: str) -> int:
        if part not in self.parts:
            raise ValueError(f"part must be one of {self.parts}, got {part!r}")
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class StatePart:
    """One recurrent-state tensor per layer and request, e.g. a conv window."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        shape = tuple(self.shape) if isinstance(self.shape, (tuple, list)) else ()
        if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in shape):
            raise ValueError(
                f"StatePart.shape must be a non-empty tuple of positive ints, got {self.shape!r}"
            )
        object.__setattr__(self, "shape", shape)
        _check_dtype("StatePart", "dtype", self.dtype)

    @property
    def itemsize(self) -> int:
        return _itemsize(storage_dtype(self.dtype))

    @property
    def layer_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class MambaSpec:
    """Mamba / linear-attention / short-convolution state: one slot per request
    (page size 1).

    Slot layout: ``[conv part 0, all layers][conv part 1, all layers]...[temporal,
    all layers]``; each part starts at a multiple of its itemsize and the slot is
    a multiple of the largest itemsize, so every part has a typed view.

    ``temporal`` None: a conv-only slot (LFM2's short convolutions keep the last
    ``L_cache`` inputs of each layer and no recurrent state). It is the same kind of
    state as a Mamba slot, fixed-size, one per request, read and written by the same
    ``causal_conv1d`` op at the same slot index, so it stays a ``MambaSpec`` with one
    part fewer rather than a new kind: the allocator, the capacity oracle, the
    prefix-cache checkpoints and the I/O paths, which all see a slot as
    ``entry_bytes`` of one contiguous range, take it unchanged.
    """

    num_layers: int
    conv: tuple[StatePart, ...]
    temporal: StatePart | None

    def __post_init__(self) -> None:
        _check_positive("MambaSpec", "num_layers", self.num_layers)
        conv = tuple(self.conv) if isinstance(self.conv, (tuple, list)) else ()
        if not conv or not all(isinstance(p, StatePart) for p in conv):
            raise ValueError(
                f"MambaSpec.conv must be a non-empty tuple of StatePart, got {self.conv!r}"
            )
        object.__setattr__(self, "conv", conv)
        if self.temporal is not None and not isinstance(self.temporal, StatePart):
            raise ValueError(
                f"MambaSpec.temporal must be a StatePart or None (a conv-only slot), "
                f"got {self.temporal!r}"
            )

    kind = "mamba"
    sliding_window = None
    blocks_per_page = None

    @property
    def state_parts(self) -> tuple[StatePart, ...]:
        return self.conv if self.temporal is None else (*self.conv, self.temporal)

    @property
    def parts(self) -> tuple[str, ...]:
        conv = tuple(f"conv{i}" for i in range(len(self.conv)))
        return conv if self.temporal is None else (*conv, "temporal")

    def _part_offsets(self) -> tuple[list[int], int]:
        offsets, cursor = [], 0
        for part in self.state_parts:
            cursor = -(-cursor // part.itemsize) * part.itemsize  # align to itemsize
            offsets.append(cursor)
            cursor += self.num_layers * part.layer_bytes
        align = max(p.itemsize for p in self.state_parts)
        return offsets, -(-cursor // align) * align

    @property
    def entry_bytes(self) -> int:
        """Bytes of one request's state, all layers and parts (alignment included)."""
        return self._part_offsets()[1]

    def page_bytes(self, page_size: int = 1) -> int:
        if page_size != 1:
            raise ValueError(f"a Mamba sub-pool always has page_size 1, got {page_size!r}")
        return self.entry_bytes

    def view_tail_pad_bytes(self, page_size: int = 1) -> int:
        self.page_bytes(page_size)
        return 0  # per-layer state views end inside their own slot

    def part_offset(self, layer: int, part: str, page_size: int = 1) -> int:
        """Byte offset of (layer, part) inside a slot."""
        self.page_bytes(page_size)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        if part not in self.parts:
            raise ValueError(f"part must be one of {self.parts}, got {part!r}")
        index = tuple.index(self.parts, part)
        return self._part_offsets()[0][index] + layer * self.state_parts[index].layer_bytes

    def fingerprint(self) -> str:
        return _fingerprint(self)


Spec = MHASpec | MLASpec | MambaSpec


def _fingerprint(spec: Spec) -> str:
    """A stable digest of a spec's fields, for save/restore and transfer handshakes."""

    def encode(value: object) -> str:
        if isinstance(value, StatePart):
            return f"StatePart({value.shape},{value.dtype})"
        if isinstance(value, tuple):
            return "(" + ",".join(encode(v) for v in value) + ")"
        return repr(value)

    text = (
        type(spec).__name__
        + ";"
        + ";".join(f"{f.name}={encode(getattr(spec, f.name))}" for f in fields(spec))
    )
    if isinstance(spec, _PagedSpec) and not spec.uniform_rows:
        text += ";rows=exact"  # not the old padded layout of the same fields
    return hashlib.sha256(text.encode()).hexdigest()[:16]
