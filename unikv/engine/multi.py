"""Several models under one KV memory budget in one process (issue 44 item 4):
``MultiLLM({"a": dir_a, "b": dir_b}, total_kv_bytes=N)``.

One ``Backing`` reservation holds every model's pool as a sub-range of its
address space (a ``SliceBacking`` each, ``n`` slices of ``capacity`` bytes);
physical memory is the shared budget, committed in chunks where each pool's top
lies. Each model is an ``LLM`` with an elastic pool (``kv_cache_max_bytes``),
started at the fair share ``N / n``; a ``SharedBudget`` (``budget_broker.py``)
moves memory from idle models to busy ones between steps, through each pool's
own compact-then-release resize.

    reservation: | slice a: pool a -> ... | slice b: pool b -> ... |
    committed:   | a's chunks |            | b's chunks |
                 sum of committed chunks <= total_kv_bytes

Every model keeps its own engine loop (``llm.engine``): ``generate(name, ...)``
runs one model's requests in the caller's thread; ``start()`` runs every loop
in a thread of its own (``unikv serve``), and the budget's idle watcher.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from unikv.backing import SliceBacking, make_backing, round_up
from unikv.engine.budget_broker import SharedBudget


class MultiLLM:
    """Several ``LLM``s, one KV budget (the module docstring).

    Args:
        models: ``{name: model directory}`` or ``{name: {LLM keyword arguments}}``
            (``model`` among them); the names are what requests name.
        total_kv_bytes: the committed pool bytes of all models together.
        elastic: False: every model keeps its fair share (a fixed split).
        idle_seconds, idle_floor: shrink a model with no work for that long to
            that floor (``SharedBudget``).
        chunk: the backing's commit granularity (CUDA rounds it up to the
            device's; None: ``make_backing``'s default for the device).
        **common: ``LLM`` keyword arguments every model takes (device, page_size,
            max_num_seqs, ...); a model's own mapping overrides them.
    """

    def __init__(
        self,
        models: Mapping[str, object],
        *,
        total_kv_bytes: int,
        elastic: bool = True,
        idle_seconds: float | None = None,
        idle_floor: int | None = None,
        chunk: int | None = None,
        device: str | torch.device | None = None,
        **common,
    ) -> None:
        from unikv.engine.llm import LLM  # (lazy: the serving app imports this module)
        from unikv.engine.options import check_device

        if not isinstance(models, Mapping) or not models:
            raise ValueError(f"models must be a non-empty {{name: model}} mapping, got {models!r}")
        for banned in ("kv_cache_bytes", "kv_cache_max_bytes", "kv_backing", "model"):
            if banned in common:
                raise ValueError(f"MultiLLM sets {banned} itself; give total_kv_bytes")
        self.budget = SharedBudget(
            total_kv_bytes, elastic=elastic, idle_seconds=idle_seconds, idle_floor=idle_floor
        )
        device = check_device(device)
        self.backing = make_backing(device, chunk)
        chunk = self.backing.chunk
        n = len(models)
        share = total_kv_bytes // n // chunk * chunk
        if share < 2 * chunk:
            raise ValueError(
                f"total_kv_bytes ({total_kv_bytes}) gives each of {n} models less than two "
                f"{chunk}-byte chunks; raise it to at least {2 * n * chunk} (or a smaller chunk)"
            )
        most = total_kv_bytes // chunk * chunk
        # each slice: the whole budget (one model may hold nearly all of it) plus
        # room for its pool's tail pad (less than a page)
        capacity = round_up(most + max(chunk, most // 8), chunk)
        self.backing.reserve(n * capacity)
        self.llms: dict = {}
        try:
            for i, (name, spec) in enumerate(models.items()):
                kw = dict(common)
                kw.update(spec if isinstance(spec, Mapping) else {"model": spec})
                for banned in ("kv_cache_bytes", "kv_cache_max_bytes", "kv_backing"):
                    kw.pop(banned, None)
                llm = LLM(
                    device=device,
                    kv_cache_bytes=share * 3 // 4,  # within the share; fitted below
                    kv_cache_max_bytes=most,
                    kv_backing=SliceBacking(self.backing, i * capacity, capacity),
                    **kw,
                )
                self.llms[name] = llm
                self.budget.attach(name, llm, share - llm.pool.tail_pad_bytes)
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        return list(self.llms)

    def __getitem__(self, name: str):
        if name not in self.llms:
            raise KeyError(f"model {name!r} is not served here; the models are {self.names}")
        return self.llms[name]

    def generate(self, name: str, prompts, sampling_params=None, **kw):
        """``LLM.generate`` of model ``name`` (its loop's tick may take memory from
        idle models before each step)."""
        return self[name].generate(prompts, sampling_params, **kw)

    def resize_kv_cache(self, name: str, total_bytes: int) -> int:
        """Model ``name``'s pool to ``total_bytes`` within the budget (ValueError,
        nothing changed, past the budget's free bytes or below what its requests
        need); returns the new size."""
        self[name]
        return self.budget.resize(name, total_bytes)

    def committed(self) -> dict[str, int]:
        """Committed bytes per model."""
        return {n: m.committed for n, m in self.budget.members.items()}

    def start(self) -> None:
        """Every model's loop in its own thread, and the idle watcher."""
        for llm in self.llms.values():
            llm.engine.start()
        self.budget.start()

    def close(self) -> None:
        self.budget.stop()
        for llm in self.llms.values():
            llm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
