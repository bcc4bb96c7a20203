"""A timed-out collective is named by the torch.distributed call and the moesys function that issued it."""

from __future__ import annotations

import pytest
import torch

from runtime.parallel.alltoall import _exchange
from runtime.parallel.timeouts import collective_of, is_timeout, timeout_error


def test_the_collective_and_its_caller_are_named():
    with pytest.raises(Exception) as info:  # no process group: the call fails inside torch.distributed
        _exchange(torch.zeros(2, 3), [2], [2], None)
    assert collective_of(info.value) == "all_to_all_single in runtime/parallel/alltoall.py:_exchange"


def test_an_awaited_collective_is_named_where_it_was_awaited():
    def finish():
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")

    with pytest.raises(RuntimeError) as info:
        finish()
    assert collective_of(info.value) == "a collective"  # neither torch.distributed nor runtime/ frames here


def test_a_timeout_becomes_one_line_with_the_step():
    exc = RuntimeError("[/__w/pytorch/gloo/unbound_buffer.cc:129] Timed out waiting 5000ms for send operation")
    assert is_timeout(exc) and not is_timeout(RuntimeError("Connection closed by peer"))
    line = str(timeout_error(exc, 7, 5.0))
    assert "\n" not in line and line.startswith("step 7: a collective")
    assert "waited more than train.collective_timeout_s=5 s" in line
