"""storage.offload=ssd: expert states on SSD behind the LFU CPU cache of Algorithm 2 (the paper's section 3.2.2),
fetching only experts that receive tokens (the MSc thesis on ZeRO-3 offload: fetching idle experts is the main
waste), the next layers' experts read ahead on a thread, evicted and updated experts written home by a write-behind
thread so that no write stalls the forward pass."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from runtime.host.timeline import Timeline
from runtime.prefetch.sparse import SparsePrefetcher
from runtime.storage.cache import LFUCache
from runtime.storage.expert_slots import ExpertSlot, SlotLayout, io_slot, slot_bytes
from runtime.storage.expert_store import ExpertKey, ExpertStore
from runtime.storage.tiers import Tiers
from runtime.storage.write_behind import WriteBehind


class SSDHome:
    """The store, the cache in front of it, the prefetcher and the write-behind queue of one rank.

    `wait_updated(layer)` blocks until the layer's last update is settled (its files final); `in_use(key)`: the
    expert is computing or awaiting its update this step, so an eviction must not write it (its update will)."""

    def __init__(self, store: ExpertStore, layouts: dict[int, SlotLayout], order: list[int], cache_experts: int,
                 hit_threshold: float, decay_beta: float, decay_every: int, prefetch_depth: int,
                 compute_dtype: torch.dtype, separate_stage: bool, pin: bool, tiers: Tiers, timeline: Timeline,
                 wait_updated: Callable[[int], None], in_use: Callable[[ExpertKey], bool], spare_slots: int = 0,
                 moments: bool = True):
        """spare_slots: released slots kept for the next reads to take over (install_offload: the experts a step
        moves through host memory beside the cache; a spare holds what its slot held, so the host tier's peak does
        not grow); a fresh slot costs its pages' faults and the kernel's zeroing of them, more CPU than the read."""
        self.store, self.layouts, self.order = store, layouts, order
        self.dtype, self.separate_stage, self.pin = compute_dtype, separate_stage, pin
        self.moments = moments
        """False: frozen experts (train.freeze=[experts]), whose slots and files hold weights and step only."""
        self.tiers, self.timeline, self.in_use = tiers, timeline, in_use
        self.fetch_all = False
        self.cache: LFUCache[ExpertKey, ExpertSlot] = LFUCache(
            cache_experts, hit_threshold, decay_beta, decay_every, self._load, self._write_back, self._forget)
        self.prefetcher = SparsePrefetcher(self._read_ahead, lambda k: k in self.cache, wait_updated, prefetch_depth,
                                           self.cache.lock, self._hint)
        self.writes = WriteBehind()
        self._on_host: dict[int, int] = {}
        self._host_lock = threading.Lock()
        self._spares: list[ExpertSlot] = []
        self.spare_slots = spare_slots
        self._read0 = self._written0 = 0

    # ---- reads ----

    def new_slot(self, layer: int, pin: bool = False, zero: bool = True) -> ExpertSlot:
        numel = self.layouts[layer].numel
        return io_slot(numel, self.dtype, self.separate_stage, pin, zero, run_of=self._take_spare(numel),
                       moments=self.moments)

    def _take_spare(self, numel: int) -> ExpertSlot | None:
        with self._host_lock:
            for i in range(len(self._spares) - 1, -1, -1):
                if self._spares[i].master.numel() == numel:
                    spare = self._spares.pop(i)
                    self.tiers.host.release(slot_bytes(numel, self.dtype, False, self.moments))
                    return spare
        return None

    def _read(self, key: ExpertKey) -> ExpertSlot:
        """A fresh slot with the expert's states from its file (after any write of it still queued); not zeroed
        first: the read fills all of it."""
        self.writes.wait_for(key)
        slot = self.store.read_into(key, self.new_slot(key[0], self.pin, zero=False))
        slot.refresh_stage()
        with self._host_lock:
            self.tiers.host.allocate(slot.nbytes)
            self._on_host[id(slot)] = slot.nbytes
        self.tiers.host.moved(slot.nbytes)
        return slot

    def _read_ahead(self, key: ExpertKey) -> ExpertSlot:
        with self.timeline.io_span("ssd_read"):
            return self._read(key)

    def _hint(self, keys: list[ExpertKey]) -> None:
        """The prefetcher is about to read `keys`: start the disk reads of those whose file is final."""
        self.store.will_need([k for k in keys if not self.writes.pending(k)])

    def _load(self, key: ExpertKey) -> ExpertSlot:
        staged = self.prefetcher.take(key)
        return staged if staged is not None else self._read(key)

    def _drop_host(self, slot: ExpertSlot, reusable: bool = False) -> None:
        """The slot left host memory (evicted, written home after a bypass, or unused); idempotent. `reusable`:
        nothing reads or writes its states any more, so the next read may take its memory over (a spare)."""
        with self._host_lock:
            nbytes = self._on_host.pop(id(slot), None)
            if nbytes is None:
                return
            self.tiers.host.release(nbytes)
            if reusable and slot.pad is not None and len(self._spares) < self.spare_slots:
                self._spares.append(slot)
                self.tiers.host.allocate(slot_bytes(slot.master.numel(), self.dtype, False, self.moments))

    def before_layer(self, layer: int, keys: list[ExpertKey]) -> None:
        pos = self.order.index(layer)
        self.prefetcher.schedule(self.order[pos + 1: pos + 1 + self.prefetcher.depth])
        self.prefetcher.record(layer, keys)

    def layer_slots(self, layer: int) -> list[ExpertSlot] | None:
        return None

    def acquire(self, keys: list[ExpertKey]) -> list[ExpertSlot]:
        if keys:
            with self.timeline.span("wait_prefetch", True):
                self.prefetcher.wait(keys[0][0])
        with self.timeline.io_span("acquire", critical=True):  # reads the prefetch did not predict wait for the disk
            return [self.cache.request(key)[0] for key in keys]

    # ---- writes ----

    def _write_back(self, key: ExpertKey, slot: ExpertSlot) -> None:
        """The cache evicts or flushes a changed expert: hand it to the write-behind thread. One still in use (a step
        computes with it, or its update has settled but not yet let it go) is written as it is and its memory
        kept: an update still to come writes it again, after this write, and frees it."""
        evicted = key not in self.cache.entries
        self._write_home([(key, slot)], drop=evicted, reusable=evicted and not self.in_use(key))

    def _forget(self, key: ExpertKey, slot: ExpertSlot) -> None:
        """The cache let go of an expert unchanged since it was read (its file holds it): its host memory is free,
        unless a step still uses it (its update's `settle` writes it home and frees it then)."""
        if not self.in_use(key):
            self._drop_host(slot, reusable=True)

    def _write_home(self, items: list[tuple[ExpertKey, ExpertSlot]], drop: bool, reusable: bool = True) -> None:
        """Write the slots to SSD as one write-behind job (one file per expert); drop them from the host tier
        afterwards when `drop` (their memory then free for the next reads, when `reusable`). A reader of any of
        the keys waits for the whole job."""
        def job() -> None:
            with self.timeline.io_span("ssd_write"):
                for key, slot in items:
                    self.store.write(key, slot)
                    self.tiers.ssd.moved(slot.nbytes)
                    if drop:
                        self._drop_host(slot, reusable)

        self.writes.submit_many([key for key, _ in items], job)

    def settle(self, keys: list[ExpertKey], slots: list[ExpertSlot]) -> None:
        """One layer's updated experts: those still in the cache become dirty; the others (bypassed, or evicted
        meanwhile) go home to SSD together."""
        with self.cache.lock:
            home = []
            for key, slot in zip(keys, slots, strict=True):
                if self.cache.entries.get(key) is slot:
                    self.cache.mark_dirty(key)
                else:
                    home.append((key, slot))
            if home:
                self._write_home(home, drop=True)

    def release_unused(self, keys: list[ExpertKey], slots: list[ExpertSlot]) -> None:
        with self.cache.lock:
            for key, slot in zip(keys, slots, strict=True):
                if self.cache.entries.get(key) is not slot:
                    self._drop_host(slot)

    def fetch_everything(self) -> None:
        """Become the ZeRO-3-offload baseline `moesys bench offload` compares with: every local expert fetched,
        stepped and written back each step, nothing kept in the CPU cache."""
        self.fetch_all = True
        self.cache.capacity = 0

    # ---- checkpoints ----

    def checkpoint_slot(self, key: ExpertKey) -> ExpertSlot:
        with self.cache.lock:
            slot = self.cache.entries.get(key)
        return slot if slot is not None else self.store.read_into(key, self.new_slot(key[0]))

    def peek(self, keys: list[ExpertKey]) -> list[ExpertSlot] | None:
        with self.cache.lock:
            slots = [self.cache.entries.get(key) for key in keys]
        found = [slot for slot in slots if slot is not None]
        return found if len(found) == len(slots) else None

    def restore_target(self, key: ExpertKey) -> ExpertSlot:
        return self.new_slot(key[0])

    def restore(self, key: ExpertKey, slot: ExpertSlot) -> None:
        self.store.write(key, slot)

    def forget(self) -> None:
        """Drop every cached and staged slot without writing (the store was just rebuilt from a checkpoint)."""
        self.drain()
        self.end_step()
        self.cache.clear()
        with self._host_lock:
            self._on_host.clear()
            self._spares.clear()
            self.tiers.host.used = 0
        self.store.bytes_written = 0

    # ---- steps ----

    def end_step(self) -> None:
        for slot in self.prefetcher.end_step():
            self._drop_host(slot)

    def after_update(self) -> None:
        """Count a step (Algorithm 2's decay) and start reading the first layers of the next one."""
        self.writes.check()
        self.cache.end_step()
        self.prefetcher.schedule(self.order[: self.prefetcher.depth])

    def metrics(self) -> dict[str, float]:
        c = self.cache.counters.snapshot_and_reset()
        requests = c["hits"] + c["misses"]
        out = {"cache_hit_rate": c["hits"] / requests if requests else 1.0, **{f"cache_{k}": v for k, v in c.items()},
               "ssd_read_bytes": self.store.bytes_read - self._read0,
               "ssd_write_bytes": self.store.bytes_written - self._written0,
               "prefetched_experts": self.prefetcher.prefetched, "ssd_bytes": self.store.disk_bytes()}
        self._read0, self._written0 = self.store.bytes_read, self.store.bytes_written
        self.prefetcher.prefetched = 0
        return out

    def drain(self) -> None:
        self.prefetcher.wait_all()
        self.writes.drain()

    def close(self) -> None:
        self.drain()
        self.end_step()
        self.prefetcher.close()
        self.writes.close()
