"""The SSD tier: round trips, atomic replacement, checksummed files, one owning run per store."""

from __future__ import annotations

import pytest
import torch

from runtime.storage.expert_store import ExpertStore, StoreError, new_state, state_bytes
from runtime.tensorfile import ChecksumError, verify


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


def test_a_store_belongs_to_the_run_that_made_it(tmp_path):
    ExpertStore(tmp_path / "s", owner="/runs/A").write((0, 0), new_state(expert(1)))
    ExpertStore(tmp_path / "s", owner="/runs/A")  # the same run reopens it (resume)
    with pytest.raises(StoreError, match=r"holds the expert store of another run \(/runs/A\)"):
        ExpertStore(tmp_path / "s", owner="/runs/B")


def test_store_files_carry_a_checksum(tmp_path):
    store = ExpertStore(tmp_path)
    store.write((0, 0), new_state(expert(1)))
    verify(store.path((0, 0)))
    data = bytearray(store.path((0, 0)).read_bytes())
    data[-3] ^= 0xFF
    store.path((0, 0)).write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="L0000-E000000.safetensors is damaged"):
        verify(store.path((0, 0)))
