"""A decode checkpoint's copy is enqueued on the step's stream without a host sync
(issue 41 item 1): on a CUDA pool, ``prefix.insert`` + ``prefix.checkpoint`` of a
request run under ``set_sync_debug_mode("error")`` (any sync raises), and the
checkpoint's bytes, read after a sync, are the request's state at that moment (a
second description: the slot's envelope cloned before it changed).

    pytest -q -p no:xdist -m gpu tests/engine/test_prefix_checkpoint_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from allocator_fixtures import full_config, mamba_config

from unikv.allocator import PoolAllocator
from unikv.pool import UnifiedPool, pool_bytes_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_a_checkpoint_copy_takes_no_host_sync():
    configs = [full_config(4), mamba_config()]
    pool = UnifiedPool(configs, pool_bytes_for(configs, {"full": 12, "mamba": 6}), device="cuda")
    alloc = PoolAllocator(pool, max_requests=4, max_context=32)
    tokens = np.arange(9)
    slot = alloc.new_request()
    alloc.alloc_mamba(np.array([slot]))
    alloc.alloc_extend(np.array([slot]), np.array([0]), np.array([9]))
    phys = int(alloc.mamba_slots(torch.tensor([slot], device="cuda")).data[0])
    envelope = pool.page_envelope("mamba", phys).view(torch.float32)
    envelope.fill_(2.5)
    want = envelope.clone()
    torch.cuda.synchronize()
    prefix = alloc.parts.prefix
    torch.cuda.set_sync_debug_mode("error")
    try:
        alloc.prefix.insert(slot, tokens[:8])
        assert alloc.prefix.checkpoint(slot, tokens[:8])
        envelope.fill_(7.0)  # the request decodes on: the checkpoint must not see it
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    states = prefix.states
    vid = next(iter(states.by_node.values()))
    ckpt = int(states.book.v2p_host[vid])
    assert torch.equal(pool.page_envelope("mamba", ckpt).view(torch.float32), want)
    alloc.check_integrity()
