"""Expert offloading for inference (the paper's "Ring Memory Offloading"): the layer store (one safetensors file per
MoE layer on disk, mapped into host memory; pinned on CUDA), device layer slots that MoE layers compute from, and the
`none` and `ondemand` modes; each offloader records its copies and compute on a Timeline. The ring itself is in
runtime/inference/ring.py; the words are docs/glossary.md's.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from runtime.files.tensorfile import DTYPES, save_tensors
from runtime.host.timeline import Timeline, overlap_s
from runtime.inference.cpu_bandwidth import empty_weight
from runtime.inference.errors import InferError
from runtime.inference.expert_source import ExpertSource
from runtime.inference.mapped import MappedFileError, read_header
from runtime.inference.store_cache import StoreHold
from runtime.model.transformer import Transformer
from runtime.moe.experts import expert_ffn
from runtime.moe.routed import routed_ffn

MODES = ("auto", "ring", "ondemand", "none")
TOKEN_SPANS = ("copy", "compute", "wait")
"""The kinds of span an offloader records: `--json`'s `timeline` has one list of each for the last decoded token."""


@dataclass(frozen=True)
class Field:
    """One stacked expert weight inside a layer's byte region: bytes [begin, end) as dtype, shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class LayerStore:
    """The store ring and ondemand copy from: every MoE layer's stacked experts as one file on disk, exported once
    from the checkpoint, DIR/layer{m}.safetensors (m = MoE layer order).

    `regions` are the layers in the host tier, one contiguous byte region each: the files memory-mapped on CPU (the
    page cache holds them), read once into pinned memory on CUDA so copies to the device are asynchronous.
    """

    def __init__(self, directory: Path, num_layers: int, pin: bool = False):
        self.directory, self.num_layers = Path(directory), num_layers
        self._maps: list[mmap.mmap] = []
        self.regions: list[Tensor] = []
        self.fields: dict[str, Field] = {}
        for m in range(num_layers):
            path = self.directory / f"layer{m}.safetensors"
            header, start = read_header(path)
            header.pop("__metadata__", None)
            fields = {k: Field(DTYPES[v["dtype"]], tuple(v["shape"]), *v["data_offsets"]) for k, v in header.items()}
            if m == 0:
                self.fields = fields
            elif fields != self.fields:
                raise InferError(f"{path}: layout differs from layer0 (MoE layers must have equal shapes)")
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: pages shared, never written
            self._maps.append(mm)
            region = torch.frombuffer(mm, dtype=torch.uint8, count=self.layer_bytes, offset=start)
            self.regions.append(region.pin_memory() if pin else region)
        for name, field in self.fields.items():
            if field.begin % field.dtype.itemsize:
                raise InferError(f"expert store field {name} is not aligned for {field.dtype}")

    @property
    def layer_bytes(self) -> int:
        return max(f.end for f in self.fields.values())

    @property
    def host_bytes(self) -> int:
        return self.layer_bytes * self.num_layers

    def views(self, region: Tensor) -> dict[str, Tensor]:
        """Typed weight views (w1 [E, F, D], ...) of a layer-sized byte buffer (a layer slot or a region)."""
        return {k: region[f.begin:f.end].view(f.dtype).view(f.shape) for k, f in self.fields.items()}

    @staticmethod
    def export(source: ExpertSource, directory: Path, fingerprint: str = "") -> None:
        """Write each layer's stacked experts once, one layer in memory at a time, atomically (a killed export
        leaves no torn or temporary file); files whose fingerprint, dtypes and shapes match are kept."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for m in range(source.num_layers):
            path = directory / f"layer{m}.safetensors"
            if path.is_file() and fingerprint and _matches(path, source.stacked_specs(m), fingerprint):
                continue
            save_tensors(path, source.stacked(m), {"fingerprint": fingerprint})


def _matches(path: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], fingerprint: str) -> bool:
    """The stored layer was written from this checkpoint with these (dtype, shape)s: reusable as it is."""
    try:
        header, _ = read_header(path)
        meta = header.pop("__metadata__", {}) or {}
        stored = {k: (DTYPES.get(v["dtype"]), tuple(v["shape"])) for k, v in header.items()}
    except (MappedFileError, TypeError, KeyError, AttributeError):
        return False
    return meta.get("fingerprint") == fingerprint and stored == specs


# ---- offloaders ----

class LayerSlotExperts(nn.Module):
    """Stands in for a layer's GroupedExperts: computes on the weights its offloader puts in a device layer slot."""

    def __init__(self, offloader: LayerSlotOffloader, index: int, expert_type: str):
        super().__init__()
        self.offloader, self.index, self.expert_type = offloader, index, expert_type

    def forward(self, x_RD: Tensor, tokens_per_expert_e: Tensor) -> Tensor:
        weights: dict[str, Any] = self.offloader.acquire(self.index)
        y_RD = expert_ffn(x_RD, tokens_per_expert_e, **weights, kind=self.expert_type)
        self.offloader.release(self.index)
        return y_RD

    @torch.compiler.disable  # waits on and schedules copies: runs outside a compiled decode step
    def routed(self, x_TD: Tensor, expert_ids_TK: Tensor, weights_TK: Tensor) -> Tensor:
        """RoutedExperts: the routed experts gathered from the slot's stacked weights; no host read."""
        weights: dict[str, Any] = self.offloader.acquire(self.index)
        y_TD = routed_ffn(x_TD, expert_ids_TK, weights_TK, **weights, kind=self.expert_type)
        self.offloader.release(self.index)
        return y_TD


class Offloader:
    """Base: counts device/host bytes and copies; marks compute spans with hooks around the model's forward."""

    mode = "none"

    def __init__(self, model: Transformer, device: torch.device, source: ExpertSource | None = None,
                 hold: StoreHold | None = None):
        """source: where the experts were placed from (close() lets go of its mapped files); hold: the layer store
        this offloader uses (runtime/inference/store_cache.py), let go of by close()."""
        self.model, self.device = model, device
        self.num_layers = len(model.moe_layers())
        self.timeline = Timeline(device)
        self.copied_bytes = 0
        self.copies = 0
        self._started: Any = None
        self.source, self.hold = source, hold
        self.placement = ["resident"] * self.num_layers
        """Where each MoE layer's experts are computed from (--json's `placement`)."""
        self.budget_slots: int | None = None
        """The device budget in layers the mode was given (infer.ring_slots), where it takes one."""
        self._hooks = [model.register_forward_pre_hook(self._begin), model.register_forward_hook(self._end)]

    def _begin(self, module, args) -> None:
        self._started = self.timeline.mark()

    def _end(self, module, args, output) -> None:
        self.timeline.add("compute", self._started, self.timeline.mark(), critical=True)

    @contextmanager
    def computing(self) -> Iterator[None]:
        """A compute span around a decode step, as the hooks mark one around a forward."""
        self._begin(None, None)
        yield
        self._end(None, None, None)

    @property
    def expert_device_bytes(self) -> int:
        """Device memory set aside for expert weights, in the dtype placed (`peak_bytes.device.experts`): the
        budget of K layer-sized slots whatever fills them (resident layers, ring slots, auto's fetched experts)."""
        return sum(p.numel() * p.element_size() for layer in self.model.moe_layers()
                   for p in cast(nn.Module, layer.experts).parameters())

    @property
    def expert_host_bytes(self) -> int:
        """Expert weights served from the host tier, as stored (`peak_bytes.host.experts`): every MoE layer that is
        not resident on the device, on CPU (mapped files) and CUDA (mapped files, or the ring's pinned copies)
        alike. 0 when every layer is resident."""
        return 0

    def reset(self) -> None:
        """Before a generation: the next forward starts at MoE layer 0."""

    def reset_stats(self) -> None:
        self.timeline.clear()
        self.copied_bytes = self.copies = 0

    def stats(self) -> dict[str, Any]:
        copies = self.timeline.seconds("copy")
        copy_s = sum(e - s for s, e in copies)
        hidden = overlap_s(copies, self.timeline.seconds("compute")) - overlap_s(copies, self.timeline.seconds("wait"))
        return {
            "offload": self.mode, "moe_layers": self.num_layers, "slots": getattr(self, "num_slots", None),
            "placement": list(self.placement),
            "store_bytes": self.copied_bytes,
            "expert_device_bytes": self.expert_device_bytes, "expert_host_bytes": self.expert_host_bytes,
            "copied_bytes": self.copied_bytes, "copies": self.copies, "copy_s": copy_s,
            "copy_hidden_s": max(0.0, hidden), "copy_hidden_share": max(0.0, hidden) / copy_s if copy_s > 0 else None,
            "timeline": self.timeline.around_last("compute", TOKEN_SPANS),
        }

    def mode_fields(self, stats: dict[str, Any]) -> dict[str, Any]:
        """What `moesys infer --json` reports of this mode beyond every mode's fields (from `stats()`)."""
        return {}

    def close(self) -> None:
        """Wait for copies in flight, take the timing hooks off the model and let go of the source's files."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.hold is not None:
            self.hold.close()
            self.hold = None
        if self.source is not None:
            self.source.close()


class LayerSlotOffloader(Offloader):
    """Experts are read from a LayerStore into `num_slots` device layer slots (buffers of one MoE layer's experts
    each, allocated once)."""

    def __init__(self, model: Transformer, device: torch.device, store: LayerStore, num_slots: int,
                 source: ExpertSource | None = None, hold: StoreHold | None = None):
        super().__init__(model, device, source, hold)
        self.placement = [self.mode] * self.num_layers
        if store.num_layers != self.num_layers:
            raise InferError(f"expert store has {store.num_layers} layers, the model {self.num_layers} MoE layers")
        self.store, self.num_slots = store, num_slots
        self.slots = [empty_weight((store.layer_bytes,), torch.uint8, device) for _ in range(num_slots)]
        self.slot_views = [store.views(s) for s in self.slots]
        self.slot_layer: list[int | None] = [None] * num_slots
        for m, layer in enumerate(model.moe_layers()):  # the resident experts go; the store holds them now
            layer.experts = LayerSlotExperts(self, m, model.cfg.expert_type)

    @property
    def expert_device_bytes(self) -> int:
        return self.num_slots * self.store.layer_bytes

    @property
    def expert_host_bytes(self) -> int:
        return self.store.host_bytes

    def copy_now(self, slot: int, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Copy layer's experts into slot, timed (on `stream` when given, else the current one)."""
        start = self.timeline.mark(stream)
        self.slots[slot].copy_(self.store.regions[layer], non_blocking=stream is not None)
        self.timeline.add("copy", start, self.timeline.mark(stream))
        self.slot_layer[slot] = layer
        self.copied_bytes += self.store.layer_bytes
        self.copies += 1

    def acquire(self, layer: int) -> dict[str, Tensor]:
        """The layer's experts in a device slot, kept there until `release` (each mode fills its slots its way)."""
        raise NotImplementedError

    def release(self, layer: int) -> None:
        raise NotImplementedError


class OnDemandOffloader(LayerSlotOffloader):
    """The baseline: one slot; each layer's experts are copied synchronously just before the layer runs."""

    mode = "ondemand"

    def __init__(self, model: Transformer, device: torch.device, store: LayerStore,
                 source: ExpertSource | None = None, hold: StoreHold | None = None):
        super().__init__(model, device, store, 1, source, hold)

    def acquire(self, layer: int) -> dict[str, Tensor]:
        if self.slot_layer[0] != layer:
            start = self.timeline.mark()
            self.copy_now(0, layer)
            self.timeline.add("wait", start, self.timeline.mark(), critical=True)  # compute stood still for it
        return self.slot_views[0]

    def release(self, layer: int) -> None:
        pass
