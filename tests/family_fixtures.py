"""Byte oracles shared by the family tests (Gemma-3 multimodal, LFM2): a request's
cached state read from the pool's raw byte buffer, at offsets written out here from
the layout law of docs/design.md section 2 and the config's own fields (not from the
specs' offset methods), right after the step that finished its prefill.

    attention row (t, l, K) = page * page_bytes + ps * l * (row_k + row_v) + (t % ps) * row_k
    attention row (t, l, V) = page * page_bytes + ps * (l * (row_k + row_v) + row_k) + (t % ps) * row_v
    state slot s            = buffer[s * slot_bytes : (s + 1) * slot_bytes]
"""

from __future__ import annotations

import torch


def kv_rows(llm, request, name: str, heads: int, head_dim: int, dtype) -> dict:
    """Model layer -> (positions (n,), K (n, H, D), V (n, H, D)) of ``request``'s prompt
    rows still bound in attention sub-pool ``name`` (H KV heads of width D, dtype),
    copied from ``llm.pool.buffer`` byte by byte."""
    sub = llm.pool.subpools[name]
    item = torch.empty((), dtype=dtype).element_size()
    row = heads * head_dim * item
    layers, ps = list(sub.layers), sub.page_size
    page_bytes = ps * len(layers) * 2 * row
    cols, phys = llm.alloc.request_pages(request.slot)[name]
    page_of = dict(zip(cols.tolist(), phys.tolist()))
    positions = [p for p in range(len(request.prompt_ids)) if p // ps in page_of]
    buffer = llm.pool.buffer
    out = {}
    for j, layer in enumerate(layers):
        keys, values = [], []
        for p in positions:
            base = page_of[p // ps] * page_bytes + ps * j * 2 * row
            k = base + (p % ps) * row
            v = base + ps * row + (p % ps) * row
            keys.append(buffer[k : k + row].clone().view(dtype).view(heads, head_dim))
            values.append(buffer[v : v + row].clone().view(dtype).view(heads, head_dim))
        out[layer] = (torch.tensor(positions), torch.stack(keys), torch.stack(values))
    return out


def state_slot(llm, request, slot_bytes: int) -> torch.Tensor:
    """A copy of ``request``'s recurrent-state slot: physical slot s of the state
    sub-pool lies at byte ``s * slot_bytes`` of the buffer."""
    phys = int(llm.alloc.mamba_slots(torch.tensor([request.slot])).data[0])
    assert phys > 0, "slot 0 is the sink"
    return llm.pool.buffer[phys * slot_bytes : (phys + 1) * slot_bytes].clone()


class AfterPrefill:
    """``on_step`` hook: ``grab(llm, request)`` for every request right after the step
    that finished its prefill (before a decode step touches its state), by prompt length."""

    def __init__(self, grab) -> None:
        self.grab, self.seen = grab, {}

    def __call__(self, llm, batch, logits) -> None:
        for r in batch.requests:
            if r.num_cached == len(r.prompt_ids) and len(r.output_ids) == 1:
                self.seen[len(r.prompt_ids)] = self.grab(llm, r)
