"""The SSD tier: round trips, atomic replacement, checksummed files, one owning run per store."""

from __future__ import annotations

import pytest
import torch

from runtime.storage.expert_slots import SlotLayout, new_slots
from runtime.storage.expert_store import ExpertStore, StoreError
from runtime.storage.host_home import initial_slot
from runtime.files.tensorfile import ChecksumError, read_header, verify


def expert(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(6, 4, generator=g), "w2": torch.randn(4, 6, generator=g), "b1": torch.randn(6, generator=g)}


def slot_of(params: dict[str, torch.Tensor], dtype=torch.float32):
    layout = SlotLayout.of({k: tuple(v.shape) for k, v in params.items()})
    return initial_slot(new_slots(layout.numel, 1, dtype, dtype != torch.float32)[0], layout, params), layout


def test_an_initial_slot_has_the_weights_as_fp32_master_zero_moments_and_step():
    params = {k: v.to(torch.bfloat16) for k, v in expert(0).items()}
    slot, layout = slot_of(params, torch.bfloat16)
    assert layout.numel == 32 + 32 + 16  # each tensor padded to 16 elements
    views = layout.views(slot.master)
    assert slot.master.dtype == torch.float32 and torch.equal(views["w1"], params["w1"].float())
    assert torch.equal(layout.views(slot.stage)["b1"], params["b1"])  # the compute-dtype copy the device reads
    assert not slot.exp_avg_sq.any() and float(slot.step) == 0.0
    assert slot.nbytes == 3 * 4 * 80 + 4 + 2 * 80


@pytest.mark.parametrize("durable", [True, False])
def test_round_trip_is_exact_and_counts_bytes(tmp_path, durable):
    store = ExpertStore(tmp_path, durable=durable)
    slot, layout = slot_of(expert(1))
    slot.exp_avg.normal_()
    slot.step.fill_(3)
    store.write((2, 13), slot)
    assert (2, 13) in store and (2, 12) not in store
    back = store.read((2, 13))
    assert back.keys() == slot.state_tensors().keys()
    assert all(torch.equal(back[k], t) for k, t in slot.state_tensors().items())
    into, _ = slot_of({k: torch.zeros_like(v) for k, v in expert(1).items()})
    store.read_into((2, 13), into)
    assert torch.equal(into.exp_avg, slot.exp_avg) and float(into.step) == 3.0
    assert store.bytes_read == 2 * (3 * 4 * 80 + 4) and store.bytes_written >= 3 * 4 * 80
    assert not list(store.live.glob("*.tmp")) and not list(store.live.glob(".*"))
    with pytest.raises(StoreError, match="layer 0 expert 0"):
        store.read((0, 0))


def test_a_store_belongs_to_the_run_that_made_it(tmp_path):
    ExpertStore(tmp_path / "s", owner="/runs/A").write((0, 0), slot_of(expert(1))[0])
    ExpertStore(tmp_path / "s", owner="/runs/A")  # the same run reopens it (resume)
    with pytest.raises(StoreError, match=r"holds the expert store of another run \(/runs/A\)"):
        ExpertStore(tmp_path / "s", owner="/runs/B")


def test_durable_store_files_carry_a_checksum_and_live_ones_none(tmp_path):
    """Live files are working memory nothing verifies (a resume rebuilds them from the checkpoint): no CRC is
    computed for them. A durable store's files carry one, and verify names a damaged file."""
    live = ExpertStore(tmp_path / "live")
    live.write((0, 0), slot_of(expert(1))[0])
    with open(live.path((0, 0)), "rb") as f:
        assert "__metadata__" not in read_header(f)[0]
    store = ExpertStore(tmp_path / "durable", durable=True)
    store.write((0, 0), slot_of(expert(1))[0])
    verify(store.path((0, 0)))
    data = bytearray(store.path((0, 0)).read_bytes())
    data[-3] ^= 0xFF
    store.path((0, 0)).write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="L0000-E000000.safetensors is damaged"):
        verify(store.path((0, 0)))
