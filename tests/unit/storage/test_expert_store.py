"""The SSD tier: round trips, atomic replacement, versions published by snapshot and restored."""

from __future__ import annotations

import os

import pytest
import torch

from runtime.storage.expert_store import ExpertStore, StoreError, new_state, state_bytes


def expert(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(6, 4, generator=g), "w2": torch.randn(4, 6, generator=g), "b1": torch.randn(6, generator=g)}


def test_new_state_has_fp32_master_zero_moments_and_step():
    params = {k: v.to(torch.bfloat16) for k, v in expert(0).items()}
    state = new_state(params)
    assert set(state) == {f"{kind}.{n}" for kind in ("param", "exp_avg", "exp_avg_sq") for n in params} | {"step"}
    assert state["param.w1"].dtype == torch.float32 and torch.equal(state["param.w1"], params["w1"].float())
    assert not state["exp_avg_sq.b1"].any() and float(state["step"]) == 0.0
    assert state_bytes(state) == 3 * 4 * (24 + 24 + 6) + 4


@pytest.mark.parametrize("durable", [True, False])
def test_round_trip_is_exact_and_counts_bytes(tmp_path, durable):
    store = ExpertStore(tmp_path, durable=durable)
    state = new_state(expert(1))
    state["exp_avg.w1"].normal_()
    store.write((2, 13), state)
    assert (2, 13) in store and (2, 12) not in store
    back = store.read((2, 13))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert store.bytes_read == state_bytes(state) and store.bytes_written >= state_bytes(state)
    assert not list(store.live.glob("*.tmp")) and not list(store.live.glob(".*"))
    with pytest.raises(StoreError, match="layer 0 expert 0"):
        store.read((0, 0))


def test_snapshot_keeps_old_states_after_live_rewrites_and_restore_brings_them_back(tmp_path):
    store = ExpertStore(tmp_path)
    v1 = new_state(expert(1))
    store.write((0, 0), v1)
    store.write((0, 1), new_state(expert(2)))
    store.snapshot(10)
    v2 = new_state(expert(3))
    store.write((0, 0), v2)
    assert torch.equal(store.read((0, 0))["param.w1"], v2["param.w1"])
    snap_file = tmp_path / "v00000010" / store.path((0, 0)).name
    assert os.stat(snap_file).st_ino != os.stat(store.path((0, 0))).st_ino
    store.restore(10)
    assert torch.equal(store.read((0, 0))["param.w1"], v1["param.w1"])
    assert store.versions() == [10]
    with pytest.raises(StoreError, match="no version 7"):
        store.restore(7)


def test_a_snapshot_killed_midway_is_invisible_and_prune_keeps_the_newest(tmp_path):
    store = ExpertStore(tmp_path)
    store.write((0, 0), new_state(expert(1)))
    (tmp_path / ".tmp-v00000030").mkdir()  # a snapshot whose process died before the rename
    for v in (10, 20):
        store.snapshot(v)
    assert store.versions() == [10, 20]
    store.prune(1)
    assert store.versions() == [20]
