"""One memory budget for the elastic pools of several models (issue 44 item 4),
and the idle shrink of one (item 2): ``SharedBudget``, the capacity oracle.

Each model's pool is elastic (``LLM(kv_cache_max_bytes=...)``); with
``MultiLLM`` they are sub-ranges of one reservation (``backing.SliceBacking``).
The budget is the committed bytes of all of them together (each pool's chunks,
its tail pad included): ``committed() <= total_bytes`` always holds, because
only ``grant`` grows a pool and it does so under the lock, by no more than is
free.

The oracle decides once per engine step of each model (``tick``, installed as
the loop's ``before_schedule`` hook; a few integer reads, no loop over
requests):

- a model is *hungry* when requests wait and fewer than ``max_num_seqs`` run
  (it could admit more with more pages);
- a hungry model takes every free byte of the budget at once (up to its
  ``max_bytes``);
- when none is free it asks a donor to shrink: an idle model (nothing running
  or waiting) to its floor, else a hungry one above the fair share
  (``total_bytes / n``) to that share while the asker is below it. The donor
  shrinks in its own loop's thread between two steps (``EngineLoop.call``: the
  existing compact-then-release path, which never frees a byte a request holds
  and refuses, with nothing changed, below what its requests need); the asker
  does not wait and takes the freed bytes at a later step.

Idle shrink: ``shrink_idle`` (and the watcher thread ``start`` runs) shrinks a
model to its floor once it has had no work for ``idle_seconds``; it grows back
at its next hungry step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial

from unikv.backing import round_up


@dataclass
class Member:
    """One model under the budget: its LLM, its floor, its bookkeeping."""

    name: str
    llm: object
    floor: int  # the least pool size the oracle shrinks it to
    last_active: float = field(default_factory=time.monotonic)
    pending: bool = False  # a shrink asked of its loop and not yet run
    grants: int = 0
    shrinks: int = 0
    refused: int = 0

    @property
    def pool(self):
        return self.llm.pool

    @property
    def committed(self) -> int:
        return self.pool.backing.committed_bytes

    def busy(self) -> bool:
        return bool(self.llm.engine.num_queued) or self.llm.scheduler.has_work()

    def hungry(self) -> bool:
        sched = self.llm.scheduler
        return bool(sched.waiting) and len(sched.running) < sched.max_num_seqs


def least_size(pool) -> int:
    """The least total the elastic ``pool``'s geometry allows (``check_resize``:
    a real page in every grid, one worst-case request alone), by bisection."""
    lo, hi = pool.sink_bytes, pool.max_bytes  # lo refused, hi allowed
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            pool.check_resize(mid)
        except ValueError:
            lo = mid
        else:
            hi = mid
    return hi


class SharedBudget:
    """The capacity oracle over ``total_bytes`` of committed memory (module docstring).

    Args:
        total_bytes: the committed bytes all members' pools may hold together.
        elastic: False keeps every pool at the size it had when attached (a fixed
            split, the benchmark's baseline); ``tick`` then only records activity.
        idle_seconds: None, or shrink a member to its floor after this long with
            no work (``shrink_idle``; the thread ``start`` runs checks it).
        idle_floor: the floor of an idle shrink (bytes; default each member's least
            size), at least the least size.
    """

    def __init__(
        self,
        total_bytes: int,
        *,
        elastic: bool = True,
        idle_seconds: float | None = None,
        idle_floor: int | None = None,
    ) -> None:
        if not isinstance(total_bytes, int) or isinstance(total_bytes, bool) or total_bytes <= 0:
            raise ValueError(f"total_bytes must be a positive int, got {total_bytes!r}")
        if idle_seconds is not None and not idle_seconds > 0:
            raise ValueError(f"idle_seconds must be None or > 0, got {idle_seconds!r}")
        if idle_floor is not None and (not isinstance(idle_floor, int) or idle_floor <= 0):
            raise ValueError(f"idle_floor must be None or a positive int, got {idle_floor!r}")
        self.total_bytes, self.elastic = total_bytes, elastic
        self.idle_seconds, self.idle_floor = idle_seconds, idle_floor
        self.members: dict[str, Member] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- membership --------------------------------------------------------------

    def attach(self, name: str, llm, size: int | None = None) -> Member:
        """Put ``llm`` (an elastic pool) under the budget, resized to ``size``
        (default: as it is); its loop asks the oracle before every schedule."""
        if llm.pool.backing is None:
            raise ValueError(
                f"model {name!r}: a shared budget needs an elastic pool (kv_cache_max_bytes)"
            )
        if name in self.members:
            raise ValueError(f"model {name!r} is already under this budget")
        least = least_size(llm.pool)
        floor = max(least, min(self.idle_floor or least, llm.pool.max_bytes))
        member = Member(name, llm, floor)
        if size is not None and size != llm.pool.total_bytes:
            llm.alloc.resize(size)
        with self.lock:
            if self.committed() + member.committed > self.total_bytes:
                raise ValueError(
                    f"model {name!r}: its pool commits {member.committed} bytes and the "
                    f"budget has {self.total_bytes - self.committed()} left of "
                    f"{self.total_bytes}; raise the budget or start it smaller"
                )
            self.members[name] = member
        llm.engine.before_schedule = partial(self.tick, name)
        llm.kv_budget = (self, name)  # resize_kv: an explicit resize asks this budget
        return member

    def committed(self) -> int:
        """Bytes the members' pools hold committed, together."""
        return sum(m.committed for m in self.members.values())

    def fair_share(self) -> int:
        return self.total_bytes // max(len(self.members), 1)

    # -- the oracle ----------------------------------------------------------------------

    def tick(self, name: str) -> None:
        """Once per step of ``name``'s loop, in its thread, before the schedule."""
        m = self.members[name]
        m.last_active = time.monotonic()
        room = self.elastic and m.pool.total_bytes < m.pool.max_bytes
        if room and m.hungry() and not self.grant(m):
            self._ask_donor(m)

    def grant(self, m: Member) -> int:
        """Grow ``m`` (in its loop's thread, or with its loop stopped) by every free
        byte of the budget (and the rest of its last chunk); returns the bytes newly
        committed (0: none was free, a donor is asked)."""
        pool = m.pool
        with self.lock:
            before = m.committed
            free = self.total_bytes - self.committed()
            chunk = pool.backing.chunk
            end = before + free // chunk * chunk  # the committed top it may reach
            target = min(end - pool.tail_pad_bytes, pool.max_bytes)
            if target > pool.total_bytes:
                m.llm.alloc.resize(target)
                m.grants += 1
            assert self.committed() <= self.total_bytes, "shared budget: over-committed"
            return m.committed - before

    def _ask_donor(self, m: Member) -> None:
        share = self.fair_share()
        best = None
        for d in self.members.values():  # a handful of models, not requests
            if d is m or d.pending:
                continue
            if not d.busy():
                target = d.floor
            elif d.hungry() and m.committed < share < d.committed:
                target = max(d.floor, share - d.pool.tail_pad_bytes)
            else:
                continue
            if target < d.pool.total_bytes and (best is None or d.committed > best[0].committed):
                best = (d, target)
        if best is not None:
            d, target = best
            d.pending = True
            d.llm.engine.call(partial(self._shrink, d, target))

    def _shrink(self, d: Member, target: int) -> None:
        """In ``d``'s loop thread: shrink to ``target``; a refusal changes nothing."""
        try:
            if target < d.pool.total_bytes:
                d.llm.alloc.resize(target)
                d.shrinks += 1
        except ValueError:
            d.refused += 1
        finally:
            d.pending = False

    def resize(self, name: str, total_bytes: int) -> int:
        """An explicit resize of one member (the admin route): a grow past the
        budget's free bytes is refused (ValueError, nothing changed); a shrink below
        what its requests need too. Returns the pool's new size."""
        m = self.members[name]
        pool = m.pool
        pool.check_resize(total_bytes)

        def run() -> int:
            with self.lock:
                end = round_up(total_bytes + pool.tail_pad_bytes, pool.backing.chunk)
                grow = end - m.committed
                free = self.total_bytes - self.committed()
                if grow > free:
                    raise ValueError(
                        f"resize: model {name!r} would commit {grow} more bytes and the shared "
                        f"budget has {free} free of {self.total_bytes}; shrink another model first"
                    )
                m.llm.alloc.resize(total_bytes)
            return pool.total_bytes

        return m.llm.engine.call(run).result()

    # -- idle shrink ------------------------------------------------------------------------

    def shrink_idle(self, now: float | None = None) -> list[str]:
        """Ask every member idle for ``idle_seconds`` and above its floor to shrink
        to it (in its loop's thread); returns their names."""
        if self.idle_seconds is None:
            return []
        now = time.monotonic() if now is None else now
        out = []
        for m in self.members.values():
            idle = not m.busy() and now - m.last_active >= self.idle_seconds
            if idle and not m.pending and m.pool.total_bytes > m.floor:
                m.pending = True
                m.llm.engine.call(partial(self._shrink, m, m.floor))
                out.append(m.name)
        return out

    def start(self) -> None:
        """Run ``shrink_idle`` every quarter of ``idle_seconds`` (at most each second)
        in a daemon thread, until ``stop``."""
        if self.idle_seconds is None or self._watcher is not None:
            return
        period = min(self.idle_seconds / 4, 1.0)

        def watch() -> None:
            while not self._stop.wait(period):
                self.shrink_idle()

        self._watcher = threading.Thread(target=watch, name="unikv-idle-shrink", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5)
            self._watcher = None


def resize_kv(llm, total_bytes: int) -> int:
    """Resize ``llm``'s pool to ``total_bytes`` (within its shared budget if it has
    one: ``SharedBudget.resize``); returns the new size. ValueError, nothing
    changed, on a size the pool or the budget cannot take."""
    owner = getattr(llm, "kv_budget", None)
    if owner is not None:
        budget, name = owner
        return budget.resize(name, total_bytes)
    llm.resize_kv_cache(total_bytes)
    return llm.pool.total_bytes


def idle_budget(llm, idle_seconds: float, floor: int) -> SharedBudget:
    """A one-model budget for ``llm``'s elastic pool (all of its reservation) that
    shrinks it to ``floor`` bytes after ``idle_seconds`` with no work and grows it
    back at its next hungry step (``unikv serve --kv-idle-shrink-floor``)."""
    pool = llm.pool
    if pool.backing is None:
        raise ValueError("an idle shrink needs an elastic pool: give kv_cache_max_bytes")
    if not isinstance(floor, int) or floor <= 0 or floor > pool.max_bytes:
        raise ValueError(
            f"the idle shrink floor must be an int in (0, {pool.max_bytes}] (the pool's "
            f"max_bytes), got {floor!r}"
        )
    total = round_up(pool.max_bytes + pool.tail_pad_bytes, pool.backing.chunk)
    budget = SharedBudget(total, idle_seconds=idle_seconds, idle_floor=floor)
    budget.attach("model", llm)
    return budget
