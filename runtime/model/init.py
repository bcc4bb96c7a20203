"""Initial weights as a pure function of (seed, parameter name, global expert index).

Every tensor, and every expert's slice of a stacked expert tensor, draws from its own generator seeded by a hash of
those three, so a rank can create exactly its own part of the model (its experts, straight into the tier where
they live) without building the rest: expert g starts the same for any expert-parallel size, any tier and any
order of creation. GPT-2 style values: normal(0, 0.02) weights, zero biases, unit norm gains.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from torch import Tensor, nn

from runtime.model.norms import RMSNorm

INIT_STD = 0.02


def draw_seed() -> int:
    """A model seed from torch's global RNG, for models built without one (torch.manual_seed still decides)."""
    return int(torch.randint(0, 2**62, (1,)).item())


def generator(seed: int, name: str, expert: int | None = None) -> torch.Generator:
    """A CPU generator owned by one tensor (or one expert's slice of it)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{'' if expert is None else expert}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def fill_(tensor: Tensor, kind: str, seed: int, name: str, expert: int | None = None) -> Tensor:
    """Fill `tensor` in place: kind normal (INIT_STD), zeros or ones. Values are drawn on the CPU, so a CUDA
    tensor gets the same numbers as a CPU one."""
    with torch.no_grad():
        if kind == "zeros":
            return tensor.zero_()
        if kind == "ones":
            return tensor.fill_(1.0)
        gen = generator(seed, name, expert)
        if tensor.device.type == "cpu" and tensor.dtype == torch.float32:
            return tensor.normal_(0.0, INIT_STD, generator=gen)
        return tensor.copy_(torch.empty(tensor.shape).normal_(0.0, INIT_STD, generator=gen))


T = TypeVar("T")


PARALLEL_DRAW_BYTES = 1 << 30
"""Most bytes of drawn values held at once by `drawn_in_parallel` (memory the plan does not count)."""


def drawn_in_parallel(draw: Callable[[int], T], indices: Iterable[int], item_bytes: int) -> Iterator[T]:
    """draw(i) for each index, in order, computed up to `torch.get_num_threads()` at a time on threads: a
    generator's normal_ runs on one core, slowly for a model's experts (benchmarks/host-costs_*.md), and each
    expert's draws have their own generator, so the values do not depend on the threads. `item_bytes`: the memory
    one draw holds until it is consumed; the threads hold at most PARALLEL_DRAW_BYTES of it (one draw at a time for
    an expert larger than that)."""
    indices = list(indices)
    workers = max(1, min(torch.get_num_threads(), len(indices), PARALLEL_DRAW_BYTES // max(1, item_bytes)))
    if workers == 1:
        yield from map(draw, indices)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="moesys-init") as pool:
        for start in range(0, len(indices), workers):
            yield from pool.map(draw, indices[start:start + workers])


def expert_kind(param_name: str) -> str:
    """Stacked expert tensors: w1/w2/w3 are weights, b1/b2/b3 biases."""
    return "zeros" if param_name.rsplit(".", 1)[-1].startswith("b") else "normal"


def init_expert(seed: int, prefix: str, shapes: dict[str, tuple[int, ...]], expert: int) -> dict[str, Tensor]:
    """Global expert `expert`'s fp32 tensors of the experts module named `prefix` (`layers.1.ffn.experts`), one per
    entry of `shapes` (w1 -> its per-expert shape): what the resident model holds in row `expert` of each."""
    out = {}
    for name, shape in shapes.items():
        qualified = f"{prefix}.{name}"
        out[name] = fill_(torch.empty(shape), expert_kind(qualified), seed, qualified, expert)
    return out


def _module_kind(module: nn.Module, param_name: str) -> str:
    if param_name.endswith("bias"):  # a Linear's bias, a router's score_bias
        return "zeros"
    if isinstance(module, (nn.LayerNorm, RMSNorm)):
        return "ones"
    return "normal"


def materialized_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Parameter, int | None]]:
    """(qualified name, owning module, parameter, first global expert) of every parameter of `model` not on the meta
    device. A module with stacked experts says so with `first_expert` (its row j is global expert first_expert + j:
    expert parallelism keeps a block of a layer's experts on each rank); None for every other parameter."""
    for prefix, module in model.named_modules():
        first = getattr(module, "first_expert", None)
        for pname, param in module.named_parameters(recurse=False):
            if not param.is_meta:
                yield (f"{prefix}.{pname}" if prefix else pname), module, param, first


def _fill_row(table: Tensor, kind: str, seed: int, name: str, first: int, j: int) -> None:
    fill_(table[j], kind, seed, name, first + j)


def init_parameters(model: nn.Module, seed: int) -> None:
    """Initialize every parameter of `model` that is not on the meta device; each row of stacked experts is drawn as
    `init_expert` draws its global expert."""
    for qualified, module, param, first in materialized_parameters(model):
        if first is not None:
            kind = expert_kind(qualified)
            row_bytes = param[0].numel() * 4  # fp32 values drawn on the CPU (a temporary unless they land there)
            draw = functools.partial(_fill_row, param.data, kind, seed, qualified, first)
            for _ in drawn_in_parallel(draw, range(param.shape[0]), row_bytes):
                pass
        else:
            fill_(param.data, _module_kind(module, qualified.rsplit(".", 1)[-1]), seed, qualified)


def copy_weights(model: nn.Module, weight: Callable[[str, int | None, tuple[int, ...]], Tensor]) -> None:
    """Fill every parameter of `model` not on the meta device from weight(name, global expert, shape) (expert None
    for a tensor that is not a row of stacked experts), one tensor or one expert at a time: a rank holding a block of
    experts reads only those."""
    with torch.no_grad():
        for qualified, _, param, first in materialized_parameters(model):
            if first is None:
                param.copy_(weight(qualified, None, tuple(param.shape)))
                continue
            for j in range(param.shape[0]):
                param[j].copy_(weight(qualified, first + j, tuple(param.shape[1:])))
