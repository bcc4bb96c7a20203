"""Bucket assignment and the single-process behaviour of runtime/parallel/grad_buckets.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from runtime.parallel.grad_buckets import GradBucketReducer, assign_buckets
from tests.references import allreduce_grads


@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(4, 128))
def test_buckets_are_reverse_order_and_bounded(numels, bucket_bytes):
    params = [torch.zeros(n) for n in numels]
    buckets = assign_buckets(params, bucket_bytes)
    assert [i for b in buckets for i in b] == list(reversed(range(len(params))))
    for b in buckets:
        size = sum(params[i].numel() * 4 for i in b)
        assert size <= bucket_bytes or len(b) == 1
    # greedy: the next bucket's first param would not have fitted into the previous bucket
    for prev, nxt in zip(buckets, buckets[1:]):
        assert sum(params[i].numel() * 4 for i in prev + nxt[:1]) > bucket_bytes


def test_dtype_change_starts_a_bucket():
    params = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2)]
    assert assign_buckets(params, 1 << 20) == [[2], [1], [0]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        assign_buckets(params, 0)


def test_single_process_reducer_keeps_gradients():
    params = [torch.randn(3, requires_grad=True), torch.randn(2, 2, requires_grad=True)]
    reducer = GradBucketReducer(params, group=None, bucket_bytes=8)
    (params[0].sum() * 2 + params[1].pow(2).sum()).backward()
    want = [p.grad.clone() for p in params]
    reducer.finish()
    allreduce_grads(params)
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))
    assert len(reducer.buckets) == 2
    reducer.remove()
