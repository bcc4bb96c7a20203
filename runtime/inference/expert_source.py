"""Where each MoE layer's experts lie: one tensor per expert and weight, usually a view of the checkpoint's memory
map (the experts' home in inference), so nothing of an expert is read until it is placed on the device or computed
in place.

Every placement reads from here: `none` copies each layer into the model, ring/ondemand write the per-layer store
one layer at a time, and `auto` computes cold experts straight from these views.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.inference.cpu_bandwidth import empty_weight
from runtime.inference.mapped import TensorFiles
from runtime.model.transformer import Transformer
from runtime.moe.experts import Experts, GroupedExperts

ExpertWeights = dict[str, Tensor]
"""One expert's weights by GroupedExperts name: w1 [F, D], w2 [D, F], optional w3 [F, D], b1, b2, b3."""


class ExpertSource:
    """Per MoE layer, per weight name, one tensor per expert (layers in model order)."""

    def __init__(self, layers: list[dict[str, list[Tensor]]], expert_type: str, dtype: torch.dtype | None = None,
                 files: TensorFiles | None = None):
        self.layers, self.expert_type, self.files = layers, expert_type, files
        self.dtype = dtype
        """The dtype experts are placed and computed in; None keeps the stored one."""
        self.num_experts = len(next(iter(layers[0].values()))) if layers else 0
        self._pages: dict[tuple[int, int], list] = {}
        """(layer, expert) -> its views' page ranges in the files, for `will_need` (a streamed layer asks for its
        routed experts every token); at most one entry per expert."""

    @classmethod
    def from_model(cls, model: Transformer) -> ExpertSource:
        """The experts a model holds (views of its parameters): the source when a model was built in memory."""
        layers, kind = [], "gelu"
        for layer in model.moe_layers():
            experts = layer.experts
            if not isinstance(experts, GroupedExperts):
                raise TypeError(f"the model's experts are a {type(experts).__name__}: an offloader swapped them out")
            kind = experts.expert_type
            layers.append({k: list(v.detach().unbind(0)) for k, v in experts.weights().items() if v is not None})
        return cls(layers, kind)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def expert(self, layer: int, j: int) -> ExpertWeights:
        return {k: v[j] for k, v in self.layers[layer].items()}

    def will_need(self, layer: int, experts: list[int]) -> None:
        """Start reading these experts' bytes from the files (when they are mapped files) all at once, so the
        compute that follows faults on pages already on their way instead of reading them one by one."""
        if self.files is None:
            return
        for j in experts:
            pages = self._pages.get((layer, j))
            if pages is None:
                pages = self._pages[(layer, j)] = self.files.pages(v[j] for v in self.layers[layer].values())
            self.files.will_need_pages(pages)

    def random_access(self, layer: int) -> None:
        """Mark a layer whose experts are read piecemeal (streamed) for random access: no readahead into its
        unrouted experts. Layers copied whole keep the kernel's readahead."""
        if self.files is not None:
            self.files.random_access(t for v in self.layers[layer].values() for t in v)

    def placed_dtype(self, name: str, layer: int = 0) -> torch.dtype:
        """The dtype weight `name` is placed and computed in: self.dtype, else the stored one."""
        return self.dtype or self.layers[layer][name][0].dtype

    def expert_bytes(self, layer: int, j: int = 0, stored: bool = False) -> int:
        """Bytes of one expert as placed on a device (in placed_dtype), or as stored in the files (stored=True)."""
        return sum(v[j].numel() * (v[j].element_size() if stored else self.placed_dtype(k, layer).itemsize)
                   for k, v in self.layers[layer].items())

    def layer_bytes(self, layer: int, stored: bool = False) -> int:
        return sum(self.expert_bytes(layer, j, stored) for j in range(self.num_experts))

    def stacked_specs(self, layer: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Each weight's (dtype, shape) as `stacked` returns it."""
        return {k: (self.placed_dtype(k, layer), (len(v), *v[0].shape)) for k, v in self.layers[layer].items()}

    def close(self) -> None:
        """Let go of the files' maps (unmapped once no view of them is left: the views held here keep them)."""
        if self.files is not None:
            self.files.close()

    def stacked(self, layer: int, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The layer's experts as stacked CPU tensors (one copy of one layer: what ring/ondemand's store holds)."""
        out = {}
        for k, views in self.layers[layer].items():
            t = torch.empty((len(views), *views[0].shape), dtype=dtype or self.placed_dtype(k, layer))
            for j, v in enumerate(views):
                t[j].copy_(v)
            out[k] = t
        return out

    def place_resident(self, experts: Experts, layer: int, device: torch.device) -> None:
        """Make `experts` hold this layer's weights on `device`: filled from here when they are not materialized
        yet (a checkpoint opened streamed), else left as they are (the model's own, moved with the model)."""
        if not isinstance(experts, GroupedExperts):
            raise TypeError(f"layer {layer}'s experts are a {type(experts).__name__}, not the model's own "
                            "GroupedExperts: place them before an offloader swaps them")
        if experts.w1.is_meta:
            self.fill(experts, layer, device)

    def fill(self, experts: Experts, layer: int, device: torch.device) -> None:
        """Give a (meta or resident) GroupedExperts this layer's weights on `device`, copied expert by expert so
        at most one layer is ever in memory twice (its mapped pages and the device copy). Parameters keep their
        requires_grad, as the dense ones loaded beside them do."""
        for name, views in self.layers[layer].items():
            param = getattr(experts, name)
            if param is None:
                continue
            dtype = self.placed_dtype(name, layer) if param.is_meta else param.dtype
            data = empty_weight((len(views), *views[0].shape), dtype, device)
            for j, v in enumerate(views):
                data[j].copy_(v)
            setattr(experts, name, torch.nn.Parameter(data, requires_grad=param.requires_grad))
