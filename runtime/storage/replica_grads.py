"""Offloaded experts with replicas (expert-data parallelism): the replicas of an expert may route different tokens,
so they first agree on the union of the experts that got gradients, then average those gradients in one fp32 buffer
per layer, in place."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.storage.expert_slots import ExpertSlot, SlotLayout
from runtime.storage.host_adamw import LayerGrads, squares


def average_over_replicas(pending: list[LayerGrads], all_keys: list, order: list[int],
                          layouts: dict[int, SlotLayout], acquire: Callable[[list], list[ExpertSlot]],
                          group, size: int) -> list[LayerGrads]:
    """One LayerGrads per layer with every expert any replica got gradients for, averaged over the `size` replicas
    of `group`; `acquire` hands out the slots of experts this rank did not compute (the caller marks them in use).
    The gradients of `pending` are copied and released."""
    mine = {key: (lg, i) for lg in pending for i, key in enumerate(lg.keys)}
    mask = torch.tensor([k in mine for k in all_keys], dtype=torch.float32)
    dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
    union = [k for k, m in zip(all_keys, mask.tolist(), strict=True) if m > 0]
    merged: list[tuple[LayerGrads, Tensor]] = []
    for layer in order:
        keys = [k for k in union if k[0] == layer]
        if not keys:
            continue
        missing = [k for k in keys if k not in mine]
        extra = dict(zip(missing, acquire(missing), strict=True))
        layout = layouts[layer]
        flat = torch.zeros(len(keys), layout.numel)  # the layer's fp32 gradients, reduced in place
        grads = layout.views(flat)
        for row, key in enumerate(keys):
            if key in mine:
                lg, i = mine[key]
                for n in layout.names:
                    grads[n][row] = lg.grads[n][lg.rows[i]]
        slots = [mine[k][0].slots[mine[k][1]] if k in mine else extra[k] for k in keys]
        merged.append((LayerGrads(layer, keys, slots, grads, list(range(len(keys))),
                                  flat=flat if layout.dense else None), flat))
    for lg, flat in merged:
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        lg.squares = squares(lg.grads)
    for lg in pending:
        lg.applied()  # copied into `merged`
    return [lg for lg, _ in merged]
