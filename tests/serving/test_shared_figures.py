"""``metrics.SharedFigures`` (the API processes' figures, ``unikv serve
--api-server-count N``): a scrape reads each row as one write left it, never
half of one write and half of another.

Oracle: every write puts ONE value in every cell of its row, so a whole row is
uniform; a torn read shows two values. A writer in another process rewrites a
large row (each write a long copy) while this process reads; a writer that
stopped mid-write (its version left odd) is simulated by hand.
"""

from __future__ import annotations

import multiprocessing as mp
import time

from unikv.serving.metrics import SharedFigures

WIDTH = 200_000  # 1.6 MB a row: a write takes long enough for a read to overlap it


def _writer(path: str, stop, last: int) -> None:
    figures = SharedFigures(path, 1, 2, WIDTH)
    k = 0
    while not stop.is_set():
        k += 1
        figures.write([float(k)] * WIDTH)
    figures.write([float(last)] * WIDTH)


def test_reads_never_mix_two_writes(tmp_path):
    path = str(tmp_path / "figures.bin")
    reader = SharedFigures(path, 0, 2, WIDTH)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    proc = ctx.Process(target=_writer, args=(path, stop, -7))
    proc.start()
    try:
        seen, deadline = set(), time.monotonic() + 3.0
        while time.monotonic() < deadline:
            row = reader.rows()[1]
            values = set(row)
            assert len(values) == 1, f"a torn row: {sorted(values)[:4]}"
            seen |= values
            if len(seen) > 3 and time.monotonic() > deadline - 2.0:
                break  # whole rows of several writes were read
    finally:
        stop.set()
        proc.join(30)
    assert proc.exitcode == 0
    assert reader.rows()[1] == [-7.0] * WIDTH  # the writer's last row, once it is idle
    assert reader.rows()[0] == [0.0] * WIDTH  # a row nobody wrote: zeros


def test_a_writer_stopped_mid_write_leaves_the_last_whole_row(tmp_path):
    path = str(tmp_path / "figures.bin")
    width = 8
    writer = SharedFigures(path, 1, 2, width)
    reader = SharedFigures(path, 0, 2, width)
    writer.write([5.0] * width)
    assert reader.rows()[1] == [5.0] * width
    # the writer dies half-way through its next write: version odd, half the row new
    at = writer.index * writer.stride
    writer.cells[at] += 1
    writer.cells[at + 1 : at + 1 + width // 2] = memoryview(bytes(8 * (width // 2))).cast("d")
    start = time.monotonic()
    assert reader.rows()[1] == [5.0] * width  # the last whole copy, not the torn row
    assert time.monotonic() - start < 1.0, "a reader must not wait for a dead writer"
    fresh = SharedFigures(path, 0, 2, width)  # a reader that never saw it whole: zeros
    assert fresh.rows()[1] == [0.0] * width
