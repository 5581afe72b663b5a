"""``allocator_fixtures.fork``, which the prefix state machines start each example from
(``same_start``): a forked pool and allocator are whole (debug-mode verbs on the fork
pass ``check_integrity``, numpy views and torch views kept) and independent (the
original's state digest does not move), and the fork then behaves as the original
does: the same random verbs leave both with the same digest."""

from __future__ import annotations

import numpy as np
import pytest
from allocator_fixtures import build, churn, fork, snapshot


@pytest.mark.parametrize("chain", ["full+swa", "full+swa+mamba"])
def test_a_fork_is_whole_independent_and_behaves_as_the_original(chain):
    pool, alloc = build(chain, 4, debug=True)
    churn(alloc, np.random.default_rng(0), 60, events=False)
    copy = fork({"pool": pool, "alloc": alloc})
    before = snapshot(alloc)
    assert snapshot(copy["alloc"]) == before
    assert copy["alloc"].pool is copy["pool"] and copy["pool"] is not pool
    churn(copy["alloc"], np.random.default_rng(1), 60, events=False)  # checked every verb
    after = snapshot(copy["alloc"])
    assert snapshot(alloc) == before != after, "the fork's verbs moved the original"
    alloc.check_integrity()
    churn(alloc, np.random.default_rng(1), 60, events=False)
    assert snapshot(alloc) == after, "the fork and the original diverged"
