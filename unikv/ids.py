"""Typed id tensors (docs/design.md section 5): the id kinds cannot be confused.

A virtual token id is smaller than a kernel id, so passing one where the other
is expected passes every bounds check and silently writes the wrong slots
(docs/lessons.md bug 3). Each kind is therefore its own wrapper type, and every
function that takes ids states and checks the kind it wants with ``expect``.
The wrappers hold a plain tensor (``.data``) and cost one Python object; kernels
receive ``.data``.

    VirtualTokenIds   requests, scheduler     stable slot names
    VirtualPageIds    allocator free lists    tv // ps
    PhysicalPageIds   page moves, offload     v2p[tv // ps]
    PhysicalTokenIds  page moves, transfer    P * ps + tv % ps
    KernelIds         attention/store only    P * ps * B + tv % ps
    KernelPageIds     block tables            P * B
"""

from __future__ import annotations

import torch


class _Ids:
    __slots__ = ("data", "space")

    def __init__(self, data: torch.Tensor, space: str = "") -> None:
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"{type(self).__name__} wraps a tensor, got {type(data).__name__}")
        if data.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{type(self).__name__} must be int32 or int64, got {data.dtype}")
        self.data = data
        self.space = space  # the sub-pool whose grid the ids live on ("" = any)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __repr__(self) -> str:
        where = f" on {self.space!r}" if self.space else ""
        return f"{type(self).__name__}{where}({self.data})"


class VirtualTokenIds(_Ids):
    __slots__ = ()


class VirtualPageIds(_Ids):
    __slots__ = ()


class PhysicalPageIds(_Ids):
    __slots__ = ()


class PhysicalTokenIds(_Ids):
    __slots__ = ()


class KernelIds(_Ids):
    __slots__ = ()


class KernelPageIds(_Ids):
    __slots__ = ()


def expect(ids: object, kind: type[_Ids], what: str, space: str | None = None) -> torch.Tensor:
    """Return ``ids.data`` after checking that ``ids`` is of ``kind`` (and, if
    given, lives on sub-pool ``space``); raise TypeError naming both otherwise."""
    if not isinstance(ids, kind):
        given = type(ids).__name__
        raise TypeError(
            f"{what} takes {kind.__name__}, got {given}; translate the ids first "
            f"(virtual -> physical -> kernel) instead of passing a raw or other-kind id"
        )
    if space is not None and ids.space and ids.space != space:
        raise TypeError(f"{what} takes ids of sub-pool {space!r}, got ids of {ids.space!r}")
    return ids.data
