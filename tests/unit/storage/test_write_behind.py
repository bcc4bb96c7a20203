"""Write-behind keeps order: a reader waiting for a key sees its last write, drain waits for everything, and a
failed write surfaces instead of vanishing on the background thread."""

from __future__ import annotations

import threading

import pytest

from runtime.storage.write_behind import WriteBehind


def test_wait_for_returns_after_the_last_write_of_that_key():
    gate, disk = threading.Event(), {}
    writes = WriteBehind()

    def write(key, value, block=False):
        def job():
            if block:
                assert gate.wait(60), "the gate was never opened"
            disk[key] = value
        return job

    writes.submit("a", write("a", 1, block=True))
    writes.submit("b", write("b", 1))
    writes.submit("a", write("a", 2))
    assert writes.pending("a") and "a" not in disk
    gate.set()  # the reader comes while the first write of "a" still runs: its wait covers the second one too
    writes.wait_for("a")
    assert disk == {"a": 2, "b": 1} and not writes.pending("a")
    writes.close()


def test_drain_waits_for_every_job_in_order():
    order: list[int] = []
    writes = WriteBehind()
    for i in range(20):
        writes.submit(i % 3, lambda i=i: order.append(i))
    writes.drain()
    assert order == list(range(20))
    writes.close()


def test_a_failed_write_surfaces_on_check_and_drain():
    writes = WriteBehind()

    def fail():
        raise OSError("disk full")

    writes.submit("a", fail)
    with pytest.raises(OSError, match="disk full"):
        writes.drain()
    writes.check()  # reported once
    writes.close()


def test_a_reader_of_a_key_whose_write_failed_gets_the_error():
    writes = WriteBehind()
    writes.submit("a", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        writes.wait_for("a")
    writes.drain()  # reported once
    writes.close()
