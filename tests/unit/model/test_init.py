"""Initial weights are a pure function of (seed, name, expert): drawn on several threads, an expert gets the values
one thread draws, in the order asked for, and the threads hold no more than their byte budget."""

from __future__ import annotations

import threading

import torch

from runtime.model import init
from runtime.model.init import drawn_in_parallel, init_expert

SHAPES = {"w1": (48, 16), "b1": (48,), "w2": (16, 48)}


def test_experts_drawn_on_threads_equal_those_drawn_one_by_one(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    serial = [init_expert(7, "blocks.0.ffn.experts", SHAPES, g) for g in range(6)]
    threaded = list(drawn_in_parallel(lambda g: init_expert(7, "blocks.0.ffn.experts", SHAPES, g), range(6), 1))
    assert all(torch.equal(a[n], b[n]) for a, b in zip(serial, threaded) for n in SHAPES)
    assert not torch.equal(serial[0]["w1"], serial[1]["w1"]) and not serial[0]["b1"].any()


def test_a_draw_larger_than_the_budget_runs_alone(monkeypatch):
    monkeypatch.setattr(init, "PARALLEL_DRAW_BYTES", 100)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    names = []
    assert list(drawn_in_parallel(lambda i: names.append(threading.current_thread().name) or i, range(4), 60)) == \
        [0, 1, 2, 3]
    assert names == [threading.current_thread().name] * 4  # one at a time, on the calling thread
    names.clear()
    list(drawn_in_parallel(lambda i: names.append(threading.current_thread().name) or i, range(4), 50))
    assert all(name.startswith("moesys-init") for name in names)
