"""Mamba slots and translation verbs of the PoolAllocator.

Mamba: one slot (page size 1) per request; the sub-pool's virtual id of request
r is ``r + 1`` (0 is the sink), so compaction can move a slot and
``mamba_slots`` still finds it through ``v2p``.
"""

from __future__ import annotations

import numpy as np
import torch

from unikv.allocator.translate import (
    check_block_table,
    translate_fused,
    translate_kernel,
    translate_physical,
)
from unikv.ids import (
    KernelIds,
    KernelPageIds,
    PhysicalPageIds,
    PhysicalTokenIds,
    VirtualTokenIds,
    expect,
)


class LookupVerbs:
    """Mixed into PoolAllocator."""

    # -- Mamba ----------------------------------------------------------------------

    def _mamba(self, what: str):
        if self.mamba_name is None:
            raise ValueError(f"{what}: this pool has no Mamba sub-pool")
        return self.subs[self.mamba_name]

    def alloc_mamba(self, slots: object) -> PhysicalPageIds | None:
        """One state slot for each request in ``slots`` ((B,) host ints, requests
        without one), its bytes zeroed (a fresh recurrent state). Returns the (B,)
        physical slots on the device, or None (state unchanged) when the chain
        cannot make room."""
        sub = self._mamba("alloc_mamba")
        slots = self.requests.check_slots(slots, "alloc_mamba")
        vids = (slots + 1).astype(np.int32)
        if (sub.v2p_host[vids] >= 0).any():
            raise ValueError(
                f"alloc_mamba: requests {slots[sub.v2p_host[vids] >= 0].tolist()} already hold a slot"
            )
        if len(vids) and not self.reserve({sub.name: len(vids)}, 0, slots):
            return None
        pages = sub.take(len(vids))
        sub.bind_host(vids, pages)
        packed = self.upload(np.concatenate([vids, pages]))
        sub.write_bind(packed[: len(vids)], packed[len(vids) :])
        phys = PhysicalPageIds(packed[len(vids) :], sub.name)
        self.pool.zero_pages(sub.name, phys)  # before any later forward, in stream order
        self._after_verb()
        return phys

    def free_mamba(self, slots: object) -> None:
        """Free the state slots of ``slots`` ((B,) host ints, requests holding one)."""
        sub = self._mamba("free_mamba")
        slots = self.requests.check_slots(slots, "free_mamba")
        vids = (slots + 1).astype(np.int32)
        if (sub.v2p_host[vids] < 0).any():
            raise ValueError(
                f"free_mamba: requests {slots[sub.v2p_host[vids] < 0].tolist()} hold no slot"
            )
        sub.unbind(vids)
        self._after_verb()

    def mamba_slots(self, req_slots: torch.Tensor) -> PhysicalPageIds:
        """Current physical state slots of (B,) int32/int64 device request slots
        (0, the sink, for requests without one). No host sync."""
        sub = self._mamba("mamba_slots")
        return PhysicalPageIds(sub.v2p.index_select(0, req_slots.long() + 1).clamp_min(0), sub.name)

    # -- translation ------------------------------------------------------------------

    def _token_sub(self, name: str, what: str):
        sub = self.subpool(name)
        if name not in self.token_names:
            raise ValueError(f"{what}: {name!r} is a Mamba sub-pool; use mamba_slots")
        return sub

    def translate(
        self, virtual_ids: VirtualTokenIds, name: str, out: torch.Tensor | None = None
    ) -> KernelIds:
        """Kernel ids of sub-pool ``name`` for (n,) virtual token ids (device).
        Padding (negative) ids and tombstones go to the sink; ``out`` (1-D int32/
        int64, >= n entries, may alias the input) receives ``out[:n]``."""
        ids = expect(virtual_ids, VirtualTokenIds, "translate")
        sub = self._token_sub(name, "translate")
        if self.debug:  # torch path with the tombstone check (host sync)
            kernel = translate_kernel(
                ids, sub.v2p, sub.page_size, sub.blocks_per_page, out=out, debug=True, name=name
            )
        else:  # one fused launch (the op was chosen at construction)
            mult = sub.page_size * sub.blocks_per_page
            kernel = translate_fused(
                self._ops.translate_ids, ids, sub.v2p, sub.page_size, mult, out
            )
        return KernelIds(kernel, name)

    def translate_physical(
        self, virtual_ids: VirtualTokenIds, name: str, out: torch.Tensor | None = None
    ) -> PhysicalTokenIds:
        """Physical token ids ``P * ps + tv % ps`` of sub-pool ``name`` (same rules)."""
        ids = expect(virtual_ids, VirtualTokenIds, "translate_physical")
        sub = self._token_sub(name, "translate_physical")
        if self.debug:
            result = translate_physical(ids, sub.v2p, sub.page_size, out=out, debug=True, name=name)
        else:
            ps = sub.page_size
            result = translate_fused(self._ops.translate_ids, ids, sub.v2p, ps, ps, out)
        return PhysicalTokenIds(result, name)

    def block_table(
        self,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        name: str,
        out: torch.Tensor,
        window: int = 0,
    ) -> KernelPageIds:
        """Kernel page entries of sub-pool ``name`` into ``out`` (B, max_pages) int32.

        req_slots, seq_lens: (B,) int32 device tensors (request slots, tokens in the
        cache). window: 0, or W to zero pages wholly before ``seq_len - W``. Uses the
        kernels backend's ``build_block_table`` (chosen once)."""
        sub = self._token_sub(name, "block_table")
        self._build_block_table(
            self.req_to_token,
            req_slots,
            seq_lens,
            sub.v2p,
            page_size=sub.page_size,
            blocks_per_page=sub.blocks_per_page,
            out=out,
            window=window,
        )
        if self.debug:
            check_block_table(
                out,
                self.req_to_token,
                req_slots,
                seq_lens,
                sub.v2p,
                sub.page_size,
                self.windows.get(name, 0),
                name,
            )
        return KernelPageIds(out, name)
