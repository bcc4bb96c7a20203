"""Dense parameter sharding (the paper's "2D Prefetch Scheduling", Algorithm 1): each data-parallel rank keeps 1/N of
every layer's dense parameters and AdamW states; a layer is all-gathered into one fused flat buffer before it computes,
prefetched `depth` layers ahead (the horizontal half of 2D prefetch), and its gradient is reduce-scattered.

Memory trade-off: a gathered layer stays materialised from its forward until its own gradients are reduced in
backward (no re-gather in backward), so the persistent dense states (master weights, grads, moments) are 1/N
while the full fp32 dense weights exist once, transiently, between forward and backward.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from runtime.parallel.groups import ProcessGroup, group_rank, group_size
from runtime.storage.optim import square_sum

# torch >= 2.13 names the fused collectives *_single; older releases only have *_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ROOT = "root"


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a unit lives in its flat buffer: decayed (>= 2-D) parameters first, then the rest."""

    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    decay_numel: int
    """Elements [0, decay_numel) get weight decay; [decay_numel, padded) do not (padding included)."""
    padded: int
    """Total elements rounded up to a multiple of the world size."""
    world: int

    @property
    def shard(self) -> int:
        return self.padded // self.world

    def shard_ranges(self, rank: int) -> list[tuple[int, int, bool]]:
        """(start, end, decay) ranges of rank's shard, relative to the shard; one or two non-empty ranges."""
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        cut = min(max(self.decay_numel, lo), hi)
        return [(a - lo, b - lo, decay) for a, b, decay in ((lo, cut, True), (cut, hi, False)) if b > a]


def flat_layout(numels: list[int], decay: list[bool], world: int) -> tuple[FlatLayout, list[int]]:
    """Layout of parameters with these sizes, and the order (indices) in which they are laid out."""
    order = [i for i in range(len(numels)) if decay[i]] + [i for i in range(len(numels)) if not decay[i]]
    offsets, total = [0] * len(numels), 0
    for i in order:
        offsets[i] = total
        total += numels[i]
    decay_numel = sum(numels[i] for i in order if decay[i])
    padded = -(-max(total, 1) // world) * world
    return FlatLayout(tuple(offsets), tuple(numels), decay_numel, padded, world), order


class _Unit:
    """One layer's dense parameters: the rank's flat fp32 shard (aliased by the optimizer's parameters), the
    gathered full buffer while the layer is materialised, and the flat gradient while it is being reduced."""

    def __init__(self, name: str, named: list[tuple[str, nn.Parameter]], world: int, rank: int):
        self.name = name
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.layout, _ = flat_layout([p.numel() for p in self.params], [p.dim() >= 2 for p in self.params], world)
        p0 = self.params[0]
        flat = torch.zeros(self.layout.padded, dtype=torch.float32, device=p0.device)
        for p, off in zip(self.params, self.layout.offsets, strict=True):
            if p.dtype != torch.float32:
                raise ValueError(f"storage.dense_shard needs fp32 master weights; {name} holds {p.dtype}")
            flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
        s = self.layout.shard
        self.shard = flat[rank * s:(rank + 1) * s].clone()
        self.ranges = self.layout.shard_ranges(rank)
        self.opt_params = [nn.Parameter(self.shard[a:b]) for a, b, _ in self.ranges]  # views: steps edit the shard
        self.full: torch.Tensor | None = None
        self.gather_work: _Work | None = None
        self.materialized = False
        self.grad_flat: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.reduce_work: _Work | None = None
        self.ready: set[int] = set()
        self.release()

    def release(self) -> None:
        """Drop the gathered weights: module parameters become empty until the next gather."""
        for p in self.params:
            p.data = torch.empty(0, dtype=torch.float32, device=self.shard.device)
        self.full, self.gather_work, self.materialized = None, None, False

    def materialize(self) -> None:
        assert self.full is not None, "a unit materialises from its gathered buffer"
        for p, off, shape in zip(self.params, self.layout.offsets, self.shapes, strict=True):
            p.data = self.full[off:off + shape.numel()].view(shape)
        self.materialized = True


class DenseShard:
    """ZeRO-3-style sharding of `dense` (non-expert) parameters of a Transformer over `group` (Algorithm 1).

    Units: one per transformer block (its norms, attention, dense FFN or router) and one root unit (embeddings,
    final norm, head). Hooks gather a unit before it computes and start the gathers of the next `prefetch_depth`
    blocks; post-accumulate-grad hooks reduce-scatter a unit's flat gradient as soon as it is complete, in a
    fixed order (last block first, root last). After finish(), `opt_params` (flat shard views) hold the averaged
    gradients of this rank's shard; the optimizer steps those, and the next forward's gather distributes them.
    """

    def __init__(self, model: nn.Module, dense: Iterable[nn.Parameter], group: ProcessGroup = None,
                 prefetch_depth: int = 1):
        self.group, self.world, self.rank = group, group_size(group), group_rank(group)
        self.depth = prefetch_depth
        wanted = {id(p) for p in dense}
        per_block: dict[str, list] = {ROOT: []}
        for name, p in model.named_parameters():
            if id(p) in wanted and p.requires_grad:
                parts = name.split(".")
                key = f"layers.{parts[1]}" if parts[0] == "layers" else ROOT
                per_block.setdefault(key, []).append((name, p))
        layers = model.get_submodule("layers")
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(f"dense sharding needs a model whose blocks are a ModuleList `layers`, not {type(model)}")
        self.blocks = [_Unit(f"layers.{i}", per_block.get(f"layers.{i}", []), self.world, self.rank)
                       for i in range(len(layers)) if per_block.get(f"layers.{i}")]
        self.block_of = {int(u.name.split(".")[1]): k for k, u in enumerate(self.blocks)}
        self.root = _Unit(ROOT, per_block[ROOT], self.world, self.rank) if per_block[ROOT] else None
        self.units = ([self.root] if self.root else []) + self.blocks  # gather order
        self.reduce_order = self.blocks[::-1] + ([self.root] if self.root else [])
        self._where = {id(p): (u, k) for u in self.units for k, p in enumerate(u.params)}
        self._next_reduce = 0
        self.gather_wait_s = 0.0
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self._hooks = [model.register_forward_pre_hook(self._pre_forward),
                       model.register_forward_hook(self._post_forward)]
        for i, block in enumerate(layers):
            if i in self.block_of:
                self._hooks.append(block.register_forward_pre_hook(partial(self._pre_block, self.block_of[i])))
        for u in self.units:
            self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in u.params]

    # ---- parameters the optimizer steps
    @property
    def decay_params(self) -> list[nn.Parameter]:
        return [p for u in self.units for p, (_, _, d) in zip(u.opt_params, u.ranges, strict=True) if d]

    @property
    def no_decay_params(self) -> list[nn.Parameter]:
        return [p for u in self.units for p, (_, _, d) in zip(u.opt_params, u.ranges, strict=True) if not d]

    def param_shapes(self) -> dict[str, torch.Size]:
        return {n: s for u in self.units for n, s in zip(u.names, u.shapes, strict=True)}

    # ---- forward: fused gather, prefetched
    def _launch_gather(self, u: _Unit) -> None:
        if u.materialized or u.gather_work is not None:
            return
        if self.world == 1:
            u.full = u.shard
            u.gather_work = _Done()
        else:
            u.full = torch.empty(u.layout.padded, dtype=u.shard.dtype, device=u.shard.device)
            u.gather_work = _all_gather(u.full, u.shard, group=self.group, async_op=True)
        self.gathered_bytes += u.full.numel() * u.full.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _ensure(self, u: _Unit) -> None:
        if u.materialized:
            return
        self._launch_gather(u)
        assert u.gather_work is not None, "a unit not materialised has its gather launched"
        began = time.perf_counter()
        u.gather_work.wait()
        self.gather_wait_s += time.perf_counter() - began
        u.gather_work = None
        u.materialize()

    def _prefetch_after(self, k: int) -> None:
        for j in range(k + 1, min(k + 1 + self.depth, len(self.blocks))):
            self._launch_gather(self.blocks[j])

    def _pre_forward(self, module, args) -> None:
        if self.root:
            self._launch_gather(self.root)
        self._prefetch_after(-1)
        if self.root:
            self._ensure(self.root)

    def _pre_block(self, k: int, module, args) -> None:
        self._ensure(self.blocks[k])
        self._prefetch_after(k)  # block k+1.. gathers while block k computes

    def _post_forward(self, module, args, output) -> None:
        if not torch.is_grad_enabled():  # no backward will come: free now
            for u in self.units:
                self._release(u)

    def _release(self, u: _Unit) -> None:
        if u.gather_work is not None:
            u.gather_work.wait()
        if u.full is not None:
            self.gathered_bytes -= u.full.numel() * u.full.element_size()
        u.release()

    # ---- backward: fused reduce-scatter as each unit's gradients complete
    def _on_grad(self, p: torch.Tensor) -> None:
        u, k = self._where[id(p)]
        if u.grad_flat is None:
            u.grad_flat = torch.zeros(u.layout.padded, dtype=torch.float32, device=u.shard.device)
        off = u.layout.offsets[k]
        assert p.grad is not None, "the hook runs once the gradient is accumulated"
        u.grad_flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None
        u.ready.add(k)
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next_reduce < len(self.reduce_order):
            u = self.reduce_order[self._next_reduce]
            if not force and len(u.ready) < len(u.params):
                return
            if u.grad_flat is None:  # no gradient reached this unit on this rank: zeros
                u.grad_flat = torch.zeros(u.layout.padded, dtype=torch.float32, device=u.shard.device)
            if self.world == 1:
                u.grad_shard, u.reduce_work = u.grad_flat, _Done()
            else:
                u.grad_shard = torch.empty_like(u.shard)
                u.reduce_work = _reduce_scatter(u.grad_shard, u.grad_flat, op=dist.ReduceOp.SUM,
                                                group=self.group, async_op=True)
            self._release(u)
            self._next_reduce += 1

    def finish(self) -> None:
        """After backward: reduce what is left, wait, average, and hand each shard its gradient."""
        self._launch_ready(force=True)
        for u in self.reduce_order:
            assert u.reduce_work is not None and u.grad_shard is not None, "launched with force=True above"
            u.reduce_work.wait()
            if self.world > 1:
                u.grad_shard.div_(self.world)  # sum then divide, as GradBucketReducer does
            for p, (a, b, _) in zip(u.opt_params, u.ranges, strict=True):
                p.grad = u.grad_shard[a:b]
            u.grad_flat, u.reduce_work, u.ready = None, None, set()
        self._next_reduce = 0

    # ---- clipping and metrics
    def grad_sq(self) -> torch.Tensor:
        """Collective: squared L2 norm of the dense gradients over all shards (padding is zero)."""
        total = sum((square_sum(p.grad) for u in self.units for p in u.opt_params if p.grad is not None),
                    torch.zeros((), device=self.units[0].shard.device if self.units else None))
        total = total.reshape(1)
        if self.world > 1:
            dist.all_reduce(total, group=self.group)
        return total

    def scale_grads(self, coef: float) -> None:
        for u in self.units:
            for p in u.opt_params:
                if p.grad is not None:
                    p.grad.mul_(coef)

    def step_metrics(self) -> dict:
        out = {"dense_gather_wait_s": self.gather_wait_s, "dense_gathered_peak_bytes": self.peak_gathered_bytes}
        self.gather_wait_s = 0.0
        return out

    # ---- checkpoints: full tensors under the parameter names, as an unsharded run writes them
    def full_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
        """Collective: {name: {model, exp_avg, exp_avg_sq, step}} of every dense parameter, gathered."""
        out = {}
        for u in self.units:
            moments = [torch.cat([_state(optimizer, p, key) for p in u.opt_params]) for key in ("exp_avg",
                                                                                            "exp_avg_sq")]
            local = torch.stack([u.shard, *moments])  # [3, shard]: one collective for weights and moments
            full = local
            if self.world > 1:
                full = torch.empty(self.world * 3, local.shape[1], dtype=local.dtype, device=local.device)
                _all_gather(full, local, group=self.group)  # rank-major [N * 3, shard]
                full = full.view(self.world, 3, -1).transpose(0, 1).reshape(3, -1)
            step = optimizer.state.get(u.opt_params[0], {}).get("step", torch.tensor(0.0))
            step = torch.as_tensor(step, dtype=torch.float32).reshape(1)
            for name, shape, off in zip(u.names, u.shapes, u.layout.offsets, strict=True):
                n = shape.numel()
                kinds = {k: full[i, off:off + n].view(shape).clone()  # own storage: safetensors refuses aliases
                         for i, k in enumerate(("model", "exp_avg", "exp_avg_sq"))}
                out[name] = {**kinds, "step": step.clone()}
        return out

    def load_full_state(self, state: dict[str, dict[str, torch.Tensor]],
                        optimizer: torch.optim.Optimizer | None) -> None:
        """Fill this rank's shards (and AdamW states) from full tensors keyed like full_state(), whatever world
        size wrote them."""
        for u in self.units:
            self._release(u)
            flats = {k: torch.zeros(u.layout.padded, dtype=torch.float32) for k in ("model", "exp_avg", "exp_avg_sq")}
            for name, off, shape in zip(u.names, u.layout.offsets, u.shapes, strict=True):
                for k, flat in flats.items():
                    flat[off:off + shape.numel()] = state[name][k].reshape(-1).float()
            lo = self.rank * u.layout.shard
            with torch.no_grad():
                u.shard.copy_(flats["model"][lo:lo + u.layout.shard])
            step = float(state[u.names[0]]["step"])
            if optimizer is None:
                continue
            for p, (a, b, _) in zip(u.opt_params, u.ranges, strict=True):
                optimizer.state.pop(p, None)
                if step > 0:
                    optimizer.state[p] = {"step": torch.tensor(step, device=p.device),
                                          **{k: flats[k][lo + a:lo + b].to(p.device).clone()
                                             for k in ("exp_avg", "exp_avg_sq")}}

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _Work(Protocol):
    """A collective's work handle (torch.distributed's Work, or _Done)."""

    def wait(self) -> bool: ...


class _Done:
    """The work handle of a collective that needed no communication."""

    def wait(self) -> bool:
        return True


def _state(optimizer: torch.optim.Optimizer, p: nn.Parameter, key: str) -> torch.Tensor:
    state = optimizer.state.get(p, {})
    return state[key] if key in state else torch.zeros_like(p)
