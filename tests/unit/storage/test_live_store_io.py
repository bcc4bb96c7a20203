"""The live store at speed: one write-behind job per layer with updated experts, a reader of a key waits for the
batch that writes it, and live files are rewritten in place without fsync (durable writes are renamed into place and
fsynced)."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors import safe_open

from runtime.config import ConfigError, ModelConfig, MoesysConfig, TrainConfig, validate
from runtime.storage.optim import lr_at
from runtime.parallel.groups import build_groups
from runtime.storage.expert_slots import IO_BLOCK, ExpertSlot, SlotLayout, io_slot, new_slots
from runtime.storage.expert_store import ExpertStore
from runtime.storage.host_home import initial_slot
from runtime.storage.live_files import read_file, write_file
from runtime.storage.offload_install import install_offload
from runtime.files.tensorfile import ChecksumError, verify
from tests.builders import build_model

CPU = torch.device("cpu")


def offloaded(store: ExpertStore, layers: int = 3, experts: int = 4, cache: int = 0):
    cfg = MoesysConfig(model=ModelConfig(hidden_size=16, ffn_hidden_size=32, num_layers=layers, num_heads=2,
                                         num_experts=experts, top_k=2, max_seq_len=16),
                       train=TrainConfig(seq_len=8, micro_batch_size=2, warmup_steps=1))
    model = build_model(cfg, build_groups(1, 0, 1, 1), CPU)
    mgr = install_offload(model, store, CPU, seed=0, cache_experts=cache,
                          lr_schedule=lambda step: lr_at(step, cfg.train))
    return model, mgr


def forward_backward(model, mgr, experts_of_layer):
    """Route 3 rows of every MoE layer to each expert of `experts_of_layer(layer)` and backpropagate; returns the
    keys of the experts that got gradients."""
    keys = []
    for index, layer in enumerate(model.moe_layers()):
        active = experts_of_layer(index)
        counts = torch.tensor([3 if e in active else 0 for e in range(mgr.specs[index].num_local)])
        layer.experts(torch.randn(int(counts.sum()), 16), counts).square().sum().backward()
        keys += [mgr.specs[index].key(e) for e in active]
    mgr.finish_backward()
    return keys


class CountingFsync:
    """os.fsync and os.fdatasync, counted on their way to the real calls."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for name in ("fsync", "fdatasync"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, lambda fd, real=real: (self.count(), real(fd))[1])

    def count(self) -> None:
        self.calls += 1


def test_one_write_job_per_layer_with_updates_and_reads_wait_for_it(tmp_path):
    store = ExpertStore(tmp_path)
    model, engine = offloaded(store, layers=3)  # nothing cached: every updated expert goes home to SSD
    home = engine.home
    home.spare_slots = 0  # the test compares with slots written home: no read may take their memory over
    real_write, reader_came = store.write, threading.Event()

    def held_write(key, slot):  # the batch is still being written when the reader comes
        assert reader_came.wait(60), "no reader came for the batch"
        real_write(key, slot)

    store.write = held_write
    for step, idle_layer in enumerate([None, 1]):
        reader_came.clear()
        keys = forward_backward(model, engine, lambda i: {(i + step) % 4, (i + step + 1) % 4})
        if idle_layer is not None:  # drop one layer's gradients: it has no update this step
            keys = [k for k in keys if k[0] != idle_layer]
            engine._pending = [lg for lg in engine._pending if lg.layer != idle_layer]
        updated = {key: slot for lg in engine._pending for key, slot in zip(lg.keys, lg.slots)}
        jobs = home.writes.jobs
        engine.step(1e-2)
        engine.wait_step()
        assert len(keys) == 2 * len({k[0] for k in keys})
        assert home.writes.jobs - jobs == len({k[0] for k in keys})  # one job per layer with updated experts
        assert home.writes.pending(keys[0])
        reader_came.set()
        for key in keys:
            back = home._read(key)  # waits for the job writing it
            assert float(back.step) == step + 1
            assert all(torch.equal(t, updated[key].state_tensors()[name]) for name, t in back.state_tensors().items())
            home._drop_host(back)
    engine.close()


def one_tensor_slot(value: float):
    layout = SlotLayout.of({"w1": (4, 4)})
    return initial_slot(new_slots(layout.numel, 1, torch.float32, False)[0], layout, {"w1": torch.full((4, 4), value)})


def test_live_files_are_rewritten_in_place_without_fsync_and_durable_ones_renamed(tmp_path, monkeypatch):
    fsyncs = CountingFsync(monkeypatch)
    model, engine = offloaded(ExpertStore(tmp_path / "live"), layers=2)
    forward_backward(model, engine, lambda i: {1, 2})
    engine.step(1e-2)
    engine.drain()
    assert engine.home.store.bytes_written > 0 and fsyncs.calls == 0  # created and written back, never fsynced
    engine.close()

    store = ExpertStore(tmp_path / "s")
    store.write((0, 0), one_tensor_slot(0.0))
    inode = store.path((0, 0)).stat().st_ino
    store.write((0, 0), one_tensor_slot(1.0))  # the same file, its blocks rewritten
    assert store.path((0, 0)).stat().st_ino == inode
    assert torch.equal(store.read((0, 0))["master"], torch.ones(16))
    assert sorted(p.name for p in store.live.iterdir()) == [store.path((0, 0)).name]  # no temp file left
    durable = ExpertStore(tmp_path / "d", durable=True)
    durable.write((0, 0), one_tensor_slot(0.0))
    before = durable.path((0, 0)).read_bytes()
    with open(durable.path((0, 0)), "rb") as old:  # replaced by a rename: an open reader keeps the whole old file
        durable.write((0, 0), one_tensor_slot(1.0))
        assert old.read() == before
    assert torch.equal(durable.read((0, 0))["master"], torch.ones(16))
    assert fsyncs.calls >= 1  # durable writes are still there for what needs them


def test_a_live_file_is_a_safetensors_file_read_back_exactly_and_a_durable_one_is_checksummed(tmp_path):
    tensors = {"w": torch.randn(5, 3), "h": torch.randn(7).to(torch.bfloat16), "step": torch.tensor(3.0),
               "ids": torch.arange(4), "none": torch.zeros(0, 2), "t": torch.randn(3, 4).t()}
    durable = tmp_path / "d.safetensors"
    write_file(durable, tensors, durable=True)
    verify(durable)
    data = bytearray(durable.read_bytes())
    data[-3] ^= 0xFF
    durable.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="d.safetensors is damaged"):
        verify(durable)
    path = tmp_path / "x.safetensors"
    size = write_file(path, tensors, durable=False)
    assert size == path.stat().st_size
    assert write_file(path, tensors, durable=False) == size  # rewritten in place
    verify(path)  # no checksum to check
    back = read_file(path)
    with safe_open(str(path), framework="pt") as f:  # any safetensors reader reads it
        theirs = {k: f.get_tensor(k) for k in f.keys()}
    for got in (back, theirs):
        assert got.keys() == tensors.keys()
        for k, t in tensors.items():
            assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t)
    assert len({t.untyped_storage().data_ptr() for t in back.values() if t.numel()}) == 5  # each its own memory
    path.write_bytes(path.read_bytes()[:-9])
    with pytest.raises(ChecksumError, match="x.safetensors is damaged"):
        read_file(path)


class OpenFlags:
    """The flags of every os.open, recorded on their way to the real call."""

    def __init__(self, monkeypatch):
        self.flags: list[int] = []
        real = os.open
        monkeypatch.setattr(os, "open", lambda path, flags, *a, **k: (self.flags.append(flags), real(path, flags, *a, **k))[1])

    def direct(self) -> int:
        return sum(bool(f & os.O_DIRECT) for f in self.flags)


def random_io_slot(numel: int) -> ExpertSlot:
    slot = io_slot(numel, torch.float32, separate_stage=False)
    for t in (slot.master, slot.exp_avg, slot.exp_avg_sq):
        t.normal_()
    slot.exp_avg_sq.abs_()
    slot.step.fill_(7)
    return slot


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_an_aligned_slot_moves_with_direct_io_and_any_other_through_the_page_cache(tmp_path, monkeypatch):
    store = ExpertStore(tmp_path / "s")
    if not store.direct:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    numel = SlotLayout.of({"w1": (40, 24), "b1": (40,)}).numel
    slot = random_io_slot(numel)
    start, end = slot.master.data_ptr(), slot.pad.data_ptr() + slot.pad.nbytes  # states and padding: one run
    assert start % IO_BLOCK == 0 and end % IO_BLOCK == 0 and end - start == 3 * slot.master.nbytes + 4 + slot.pad.nbytes
    store.write((0, 0), slot)  # created (buffered, renamed into place)
    opens = OpenFlags(monkeypatch)
    store.write((0, 0), slot)  # rewritten in place, straight from the slot's memory
    back = store.read_into((0, 0), io_slot(numel, torch.float32, separate_stage=False, zero=False))
    assert opens.direct() == 2
    for name, t in slot.state_tensors().items():
        assert torch.equal(back.state_tensors()[name], t), name
    path = store.path((0, 0))
    assert path.stat().st_size % IO_BLOCK == 0
    with safe_open(str(path), framework="pt") as f:  # still a safetensors file any reader takes
        assert torch.equal(f.get_tensor("master"), slot.master) and f.get_tensor("step").item() == 7
    assert store.bytes_read == 3 * slot.master.nbytes + 4  # the states, not the padding
    os.truncate(path, path.stat().st_size - IO_BLOCK)
    with pytest.raises(ChecksumError, match="is damaged"):
        store.read_into((0, 0), io_slot(numel, torch.float32, separate_stage=False))
    store.write((0, 0), slot)  # a file of another size: written anew

    plain = new_slots(numel, 1, torch.float32, False)[0]  # a row of a block: not aligned for direct I/O
    plain.master.copy_(slot.master)
    opens.flags.clear()
    store.write((0, 1), plain)
    store.write((0, 1), plain)
    assert torch.equal(store.read_into((0, 1), new_slots(numel, 1, torch.float32, False)[0]).master, slot.master)
    assert ExpertStore(tmp_path / "s", direct=False).read_into((0, 0), io_slot(numel, torch.float32, False)).step == 7
    assert opens.direct() == 0  # through the page cache, as asked


def test_direct_io_false_is_refused_where_no_ssd_store_would_read_it():
    cfg = MoesysConfig()
    cfg.storage.direct_io = False
    with pytest.raises(ConfigError, match="storage.direct_io=false applies to the SSD store only"):
        validate(cfg)
    cfg.storage.offload = "ssd"
    validate(cfg)


def test_a_read_takes_over_the_memory_of_a_slot_released_before_it(tmp_path):
    """A fresh slot per read makes the kernel fault in and zero its pages (for a multi-GB expert, more CPU than the
    read): the store's reads reuse the memory of slots written home, up to the experts a step moves through host
    memory beside the cache."""
    model, engine = offloaded(ExpertStore(tmp_path / "s"), layers=2, cache=1)
    for _ in range(3):
        forward_backward(model, engine, lambda i: {0, 1, 2})
        engine.step(1e-2)
    engine.drain()
    home = engine.home
    assert home.spare_slots == 7  # 2 layers x 4 experts, less the one the cache holds
    # the experts not cached went home and kept their memory, but for what the next step's first layer read ahead
    assert len(home._spares) + len(home.prefetcher.staged) >= 5
    spare, used = home._spares[-1], engine.tiers.host.used
    slot = home.new_slot(0, zero=False)
    assert slot.master.data_ptr() == spare.master.data_ptr() and spare not in home._spares
    assert engine.tiers.host.used < used  # a spare counts in the host tier until a read takes it
    engine.close()


def test_a_changed_expert_evicted_while_still_marked_in_use_is_written_home(tmp_path):
    """An update settles an expert in the cache (dirty) a moment before it stops being in use; an eviction in that
    moment (the next step's forward runs beside the update) must still write it, or its update is lost."""
    model, engine = offloaded(ExpertStore(tmp_path / "s"), layers=1, cache=1)
    forward_backward(model, engine, lambda i: {2})
    engine.step(1e-2)
    engine.drain()
    home, key = engine.home, engine.specs[0].key(2)
    slot = home.cache.entries[key]
    assert key in home.cache.dirty
    engine._in_use.add(key)  # the update's settle done, its release not yet
    home.cache.request(engine.specs[0].key(0))  # evicts it
    engine.drain()
    assert torch.equal(home.store.read(key)["master"], slot.master) and float(home.store.read(key)["step"][0]) == 1
    engine._in_use.discard(key)
    engine.close()
