"""Piecewise CUDA graphs of extend steps (prefill chunks, mixed with decodes).

An extend step's forward launches a few hundred kernels; all but the step
object's ops are row-wise over the step's T token rows (GEMMs, norms, activations,
residual adds), so only those ops need the step's metadata. As in vLLM, the model's
layers (``DecoderLM.run_body``) are cut at every call into the step object (the
ops of ``EAGER_OPS``: attention with its K/V store, and the recurrent mixers' conv
and scan): each piece between two such calls is captured as one CUDA graph per
padded token count (``prefill_token_sizes``: 256, 512, 1024, 2048, then every 1024 up
to the planner's ``max_tokens``), and the ops run eagerly between the pieces, with
the real plan.

The cut is found by running the layers once per size over a step object that
records (``_PieceStep``): at each op it copies the op's token-row arguments into
fixed buffers (inside the piece: the copies are part of its graph), ends the
current capture, gives the op a fixed output buffer (``_Boundary.out``) and begins
the next capture; the last piece copies the layers' (h, residual) into fixed
buffers too. Each size is first recorded without graphs (every kernel compiled and
tuned, every fixed buffer made), where the ops run once over a one-row plan of the
sink (``planner.plan(Batch(), rows=1)``) to size the output buffers; under capture
the pieces compute nothing, so the ops do not run there. A step of T rows then runs
in the graphs of the smallest size R >= T:

    ids[:T], positions[:T] <- the plan's (the pieces' fixed inputs; rows T..R-1
    keep earlier tokens: any valid id and position)
    for each boundary: replay piece i (it leaves the op's arguments, R rows, in
    their buffers); the op over their first T rows with the step's own object;
    its output into rows [:T] of ``out``
    replay the last piece -> (h, residual) (R rows) -> the LM head, eagerly, over
    the plan's ``logits_indices`` (its row count varies per step)

Padded rows never reach an op of the step object (its arguments are cut to the
T real rows), so they store no K/V and touch no state slot; every other op is
row-wise, so they cannot change a real row. Per step: two small copies, one replay
per piece, and one copy of each op's arguments and of its output more than the
eager step; no host sync.

On CPU there are no graphs: the same recording runs once per size, and a replay
runs the layers again over a ``_PieceStep`` that copies each call's arguments into
the staged buffers and runs the op over them (the CUDA path's data flow through the
same fixed buffers), so the cut, the padding and the row slicing are tested there.

Families with an op outside ``EAGER_OPS`` (MLA) are refused at start-up, and so is
a size whose pieces cannot be captured (an op that syncs the host: the unfused MoE
loop above ``DENSE_MAX_TOKENS`` rows), by a ValueError naming it.

Why graphs and not ``torch.compile`` of the pieces: the pieces replay the very
kernels the eager step launches (the same GEMMs at the padded row count, the same
Triton norms), so a real row's math is the eager row's and the exactness tests hold
on CPU and GPU alike; the split needs no tracing of the step object, the backend's
dispatch or its context variables (Dynamo would guard on them and recompile per
size), and no compiler on the CPU test machines. Launch overhead is what item 5
measured (wall about 1.25x device), and graphs remove it whole; fusing across ops is
the backend's business (its fused kernels), not this module's.

Memory: nothing of a size's graphs' pool outlives its capture but the graphs (and
small tensors an op takes that a piece computed, such as Mamba-2's -exp(A_log)):
the pieces hand everything on through the fixed buffers, so every size reuses the
same pool memory, about one eager step's activations. The fixed buffers hold the
largest size's rows: each op's output, one set of op arguments per (op, argument,
width) (an op's inputs are dead once it ran), and the final (h, residual); for
Llama-3.2-1B at 8192 tokens, 16 outputs of 8192 x 2048 bf16 and one q|k|v set of
8192 x 3072: about 0.6 GB.
"""

from __future__ import annotations

import inspect
import warnings
from bisect import bisect_left

import torch

from unikv.engine.attention import ExtendAttention
from unikv.engine.plan import StepPlan, StepPlanner
from unikv.engine.scheduler import Batch
from unikv.kernels.backend import stepping

PIECE_MIN_TOKENS = 256  # the smallest captured size (every smaller step pads to it)
PIECE_DOUBLE_UNTIL = 2048  # sizes double up to here, then grow by PIECE_STEP_TOKENS
PIECE_STEP_TOKENS = 1024

# the step object's ops run eagerly between two pieces -> their token-row arguments
EAGER_OPS = {
    "__call__": ("q", "k", "v", "rope"),
    "causal_conv1d": ("x",),
    "gated_delta_rule": ("q", "k", "v", "g", "beta"),
    "mamba2_ssd": ("x", "dt", "B", "C"),
}
_SIGNATURES = {name: inspect.signature(getattr(ExtendAttention, name)) for name in EAGER_OPS}


def prefill_token_sizes(max_tokens: int) -> list[int]:
    """The captured token counts: ``PIECE_MIN_TOKENS`` doubled up to
    ``PIECE_DOUBLE_UNTIL``, then ``PIECE_STEP_TOKENS`` apart (a step pads by at most a
    third of its rows), below ``max_tokens``; then ``max_tokens`` (always the largest)."""
    size, sizes = PIECE_MIN_TOKENS, []
    while size < max_tokens:
        sizes.append(size)
        size = size * 2 if size < PIECE_DOUBLE_UNTIL else size + PIECE_STEP_TOKENS
    return [*sizes, max_tokens]


def _first_rows(value, num: int):
    """``value``'s first ``num`` rows: a tensor's, each tensor's of a tuple (``rope``:
    (rotary, positions)), anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value[:num]
    if isinstance(value, tuple):
        return tuple(_first_rows(v, num) for v in value)
    return value


def _copy_rows(into, value) -> None:
    """Copy ``value`` into the staged ``into`` (tensors, or tuples of them), unless it
    is those very bytes (a fixed buffer passed on: positions, an op's output)."""
    if isinstance(into, torch.Tensor):
        same = into.untyped_storage() is value.untyped_storage()  # torch keeps one object
        if not (same and into.storage_offset() == value.storage_offset()):
            into.copy_(value)
    elif isinstance(into, tuple):
        for a, b in zip(into, value, strict=True):
            _copy_rows(a, b)


class _Boundary:
    """One eager op between two pieces: the step object's method ``name``, its
    arguments by name (the token-row ones staged in fixed buffers, R rows) and the
    fixed buffer its output is copied into (R rows, read by the next piece)."""

    __slots__ = ("arguments", "name", "out", "rows")

    def __init__(self, name: str, arguments: dict) -> None:
        self.name, self.arguments = name, arguments
        self.rows = tuple(k for k in EAGER_OPS[name] if k in arguments)  # (as given)
        self.out: torch.Tensor | None = None

    def call(self, step, num: int) -> torch.Tensor:
        """The op of ``step`` over the first ``num`` rows of the staged arguments."""
        kw = {k: (_first_rows(v, num) if k in self.rows else v) for k, v in self.arguments.items()}
        out = getattr(step, self.name)(**kw)
        assert isinstance(out, torch.Tensor), f"prefill graphs: {self.name} returns one tensor"
        return out

    def run(self, step, num: int) -> torch.Tensor:
        """``call``, its output into ``out[:num]``; returns ``out`` (all rows)."""
        self.out[:num].copy_(self.call(step, num))
        return self.out


class _Sequence:
    """One captured size: its pieces' graphs (CUDA), the boundaries between them, the
    fixed (h, residual) the last piece leaves and the rows plan of the pieces."""

    def __init__(self, size: int, rows_plan) -> None:
        self.size, self.rows_plan = size, rows_plan
        # per piece its graph, None where it captured no work (nothing to replay)
        self.graphs: list | None = []
        self.captured: list = []  # every piece's graph, kept (one memory pool for all)
        self.boundaries: list[_Boundary] = []
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None


class _PieceStep:
    """The step object the pieces see: the ops of ``EAGER_OPS`` cut the layers (a
    recording, ``recording=True``: the op's token-row arguments staged, capture ended
    and begun around it; a CPU replay: the call's arguments staged into the recorded
    buffers, the op run); anything else of a step object is refused (AttributeError
    naming it)."""

    fuses_rope = ExtendAttention.fuses_rope
    feedback = None  # an extend step's placeholders are filled in the plan

    def __init__(self, owner: PrefillGraphs, seq: _Sequence, step, num: int, recording: bool):
        self._owner, self._seq, self._step, self._num = owner, seq, step, num
        self._recording, self.calls = recording, 0  # ops called so far
        self.rows_plan = self.logit_rows_plan = seq.rows_plan

    def __getattr__(self, name):
        raise AttributeError(
            f"prefill graphs cut a step only at the step object's ops {sorted(EAGER_OPS)}; "
            f"this model asks for {name!r} (an MLA model?): run it with prefill_graphs=False"
        )

    def _op(self, name: str, args, kwargs) -> torch.Tensor:
        bound = _SIGNATURES[name].bind(None, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(arguments)))  # self
        if self._recording:
            return self._owner.record_op(self._seq, name, arguments, self._step)
        seq, i = self._seq, self.calls
        self.calls += 1
        boundary = seq.boundaries[i]
        assert boundary.name == name, (
            f"prefill graphs invariant: op {i} of the layers is {name}, recorded {boundary.name}"
        )
        for key in boundary.rows:  # the piece's outputs into the staged (fixed) ones
            _copy_rows(boundary.arguments[key], arguments[key])
        return boundary.run(self._step, self._num)

    def __call__(self, *args, **kwargs):
        return self._op("__call__", args, kwargs)

    def causal_conv1d(self, *args, **kwargs):
        return self._op("causal_conv1d", args, kwargs)

    def gated_delta_rule(self, *args, **kwargs):
        return self._op("gated_delta_rule", args, kwargs)

    def mamba2_ssd(self, *args, **kwargs):
        return self._op("mamba2_ssd", args, kwargs)


class PrefillGraphs:
    """Extend steps of up to ``max(sizes)`` token rows under piecewise CUDA graphs
    (module docstring); on CPU the same pieces as plain calls.

    Args:
        model: a ``DecoderLM`` (its ``run_body`` and ``run_head``).
        planner: the runner's StepPlanner (the recording's one-row plan).
        make_step: plan -> the runner's extend step object (``ExtendAttention``).
        sizes: the captured token counts (default ``prefill_token_sizes(max_tokens)``).
    """

    def __init__(self, model, planner: StepPlanner, make_step, sizes: list[int] | None = None):
        if not hasattr(model, "run_body"):
            raise ValueError(
                f"prefill graphs cut the shared decoder's layers (DecoderLM.run_body); "
                f"{type(model).__name__} has none: run it with prefill_graphs=False"
            )
        mla = [s.name for s in planner.subpools if s.spec.kind == "mla"]
        if mla:
            raise ValueError(
                f"prefill graphs do not cut MLA layers yet (sub-pools {mla}): run this model "
                "with prefill_graphs=False"
            )
        self.model, self.planner, self.device = model, planner, planner.device
        self.sizes = sorted(sizes or prefill_token_sizes(planner.max_tokens))
        self.cuda = self.device.type == "cuda"  # decided once: graphs, or plain calls
        self._run = self._replay if self.cuda else self._calls
        top = self.sizes[-1]
        assert top <= planner.max_tokens, "prefill graphs invariant: sizes within max_tokens"
        self.ids = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=self.device)
        # fixed buffers of ``top`` rows, shared by the sizes: each op's output (by its
        # index in the layers), the ops' token-row arguments (by op, argument and
        # width: an op's inputs are dead once it ran) and the last (h, residual)
        self._outs: dict[int, torch.Tensor] = {}
        self._ins: dict[tuple, torch.Tensor] = {}
        self._final: list[torch.Tensor] = []
        self.sequences: dict[int, _Sequence] = {}
        self.replays = dict.fromkeys(self.sizes, 0)  # steps run per size (tests, benches)
        self._pool = None
        self._capture(make_step)

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A zeroed fixed buffer of the largest size's rows, ``like``'s width and dtype."""
        shape = (self.sizes[-1], *like.shape[1:])
        return torch.zeros(shape, dtype=like.dtype, device=self.device)

    # -- capture -----------------------------------------------------------------------

    @torch.inference_mode()
    def _capture(self, make_step) -> None:
        step = make_step(self.planner.plan(Batch(), rows=1))  # the sink lane: one row
        if not self.cuda:
            for size in self.sizes:
                self.sequences[size] = self._record(size, step, graphs=False)
            return
        stream, side = torch.cuda.current_stream(self.device), torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            for size in reversed(self.sizes):  # the largest first
                self._record(size, step, graphs=False)  # compile and tune every kernel
                torch.cuda.synchronize(self.device)
                self.sequences[size] = self._record(size, step, graphs=True)
        stream.wait_stream(side)
        torch.cuda.synchronize(self.device)

    def _record(self, size: int, step, graphs: bool) -> _Sequence:
        """Run the layers over ``size`` rows, cut at the step object's ops: a
        ``_Sequence`` (its pieces captured where ``graphs``). Nothing of the graphs'
        pool is kept past it: the pieces pass everything on through fixed buffers, so
        every size's pieces reuse the same pool memory."""
        seq = _Sequence(size, self.planner.backend.plan_rows(size))
        seq.graphs = [] if graphs else None
        pieces = _PieceStep(self, seq, step, 1, recording=True)
        try:
            with stepping(seq.rows_plan):
                self._begin(seq)
                h, residual = self.model.run_body(self.ids[:size], self.positions[:size], pieces)
                seq.outputs = self._keep(h, residual)
                self._end(seq)
        except Exception as err:
            if graphs and torch.cuda.is_current_stream_capturing():
                try:  # leave capture mode, so that the error is the one reported
                    seq.captured[-1].capture_end()
                except Exception:  # noqa: BLE001, S110 - the capture was invalid anyway
                    pass
            raise ValueError(
                f"prefill graphs could not {'capture' if graphs else 'record'} a step of "
                f"{size} tokens ({type(err).__name__}: {err}); run with prefill_graphs=False"
            ) from err
        return seq

    def _keep(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The layers' (h, residual) copied into the fixed final buffers (their rows)."""
        if not self._final:  # (the first plain recording's)
            self._final = [self._buffer(h), self._buffer(residual)]
        rows = h.shape[0]
        out = (self._final[0][:rows], self._final[1][:rows])
        out[0].copy_(h)
        out[1].copy_(residual)
        return out

    def _begin(self, seq: _Sequence) -> None:
        if seq.graphs is not None:
            graph = torch.cuda.CUDAGraph()
            seq.captured.append(graph)
            graph.capture_begin(pool=self._pool)

    def _end(self, seq: _Sequence) -> None:
        if seq.graphs is None:
            return
        graph = seq.captured[-1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graph.capture_end()
        self._pool = graph.pool()  # one pool for every piece and size
        empty = False
        for w in caught:  # a piece of views only (between two ops) captures no work
            if "CUDA Graph is empty" in str(w.message):
                empty = True
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        seq.graphs.append(None if empty else graph)

    def _stage(self, name: str, key: str, value, size: int, part: int = 0):
        """A token-row argument in a fixed buffer (copied there: inside the piece's
        graph when capturing), or as it is where it already lies in one (the positions,
        an earlier op's output) or holds no tensor."""
        if isinstance(value, tuple):
            return tuple(self._stage(name, key, v, size, j) for j, v in enumerate(value))
        if not isinstance(value, torch.Tensor):
            return value
        assert value.shape[0] == size, (
            f"prefill graphs invariant: {name}'s {key} has {size} token rows"
        )
        fixed = [self.positions, *self._outs.values()]
        if any(value.untyped_storage() is f.untyped_storage() for f in fixed):
            return value
        slot = (name, key, part, tuple(value.shape[1:]), value.dtype)
        buffer = self._ins.get(slot)
        if buffer is None:  # (a plain recording's: each size's runs before its capture)
            assert not (self.cuda and torch.cuda.is_current_stream_capturing()), (
                "prefill graphs invariant: fixed buffers are made outside capture"
            )
            buffer = self._ins[slot] = self._buffer(value)
        staged = buffer[:size]
        staged.copy_(value)
        return staged

    def record_op(self, seq: _Sequence, name: str, arguments: dict, step) -> torch.Tensor:
        """A recording's op: stage its token-row arguments, end the piece, run the op
        once over the recording's one row (not under capture), give it a fixed output
        buffer and begin the next piece."""
        boundary = _Boundary(name, arguments)
        for key in boundary.rows:
            arguments[key] = self._stage(name, key, arguments[key], seq.size)
        self._end(seq)
        index = len(seq.boundaries)
        if seq.graphs is None:  # a plain recording: the op runs, its output sizes the buffer
            out = boundary.call(step, 1)
            buffer = self._outs.get(index)
            if buffer is None or buffer.shape[1:] != out.shape[1:] or buffer.dtype != out.dtype:
                buffer = self._outs[index] = self._buffer(out)
            buffer[:1].copy_(out)
        else:  # a capture: the pieces ran nothing (their outputs hold no values yet), so
            buffer = self._outs[index]  # the op does not run; this size's plain recording
        boundary.out = buffer[: seq.size]  # (just before) sized the buffer
        seq.boundaries.append(boundary)
        self._begin(seq)
        return boundary.out

    # -- running -----------------------------------------------------------------------

    def size_for(self, num_tokens: int) -> int | None:
        """The captured size that runs a step of ``num_tokens`` rows (None: none)."""
        i = bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def forward(self, plan: StepPlan, step, logits_indices, greedy: bool = False):
        """The runner's ``forward`` of an extend step through the pieces: fp32 logits
        of ``logits_indices`` (None: every real row), with ``greedy`` also the model's
        greedy tokens; None where no size holds the step (run it eagerly)."""
        num = plan.input_ids.shape[0]
        size = self.size_for(num)
        if size is None:
            return None
        self.ids[:num].copy_(plan.input_ids)
        self.positions[:num].copy_(plan.positions)
        seq = self.sequences[size]
        h, residual = self._run(seq, step, num)
        self.replays[size] += 1
        if logits_indices is None:  # every real row (a verify step's)
            h, residual = h[:num], residual[:num]
        rows = step.rows_plan
        head = rows if logits_indices is None else step.logit_rows_plan
        extra = {"greedy": True} if greedy else {}
        with stepping(rows):
            return self.model.run_head(h, residual, step, logits_indices, head=head, **extra)

    @staticmethod
    def _replay(seq: _Sequence, step, num: int):
        """CUDA: each piece's graph, each op eagerly between them."""
        for graph, boundary in zip(seq.graphs, seq.boundaries, strict=False):
            if graph is not None:
                graph.replay()
            boundary.run(step, num)
        if seq.graphs[-1] is not None:
            seq.graphs[-1].replay()
        return seq.outputs

    def _calls(self, seq: _Sequence, step, num: int):
        """CPU: the pieces as plain calls over the same fixed buffers."""
        pieces = _PieceStep(self, seq, step, num, recording=False)
        with stepping(seq.rows_plan):
            h, residual = self.model.run_body(
                self.ids[: seq.size], self.positions[: seq.size], pieces
            )
            out = self._keep(h, residual)
        assert pieces.calls == len(seq.boundaries), "prefill graphs invariant: every op ran"
        return out
