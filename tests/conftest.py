import os

import torch

# Without a GPU, run every Triton kernel through Triton's CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The device suite runs lanes of GPU test files side by side on one GPU. An engine
# built without ``kv_cache_bytes`` takes ``memory_fraction`` (default 0.9) of the free
# memory and starves the lanes beside it, so the suite sets UNIKV_TEST_LANE_FRACTION
# and every engine's default pool here takes at most that share.
_LANE_FRACTION = os.environ.get("UNIKV_TEST_LANE_FRACTION")
if _LANE_FRACTION is not None:
    import pytest

    @pytest.fixture(autouse=True)
    def _lane_memory_share(monkeypatch):
        from unikv.engine import build

        cap = float(_LANE_FRACTION)
        budget = build.kv_budget_bytes

        def capped(*args, memory_fraction, **kwargs):
            return budget(*args, memory_fraction=min(memory_fraction, cap), **kwargs)

        monkeypatch.setattr(build, "kv_budget_bytes", capped)
