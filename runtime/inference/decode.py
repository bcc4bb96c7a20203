"""The decode token as one static step (gpt-fast's recipe: no host sync per token): a static KV cache, routed experts
gathered by index, the position a device tensor, so a token reads nothing on the host and `torch.compile` captures
the step whole (`infer.compile`; CUDA graphs on a GPU). Prefill stays the model's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from runtime.inference.cpu_bandwidth import decode_kernels
from runtime.inference.errors import InferError
from runtime.model.attention import StaticKVCache
from runtime.model.transformer import Transformer
from runtime.moe.experts import GroupedExperts
from runtime.moe.routed import ROUTED_FORMS

CACHE_BUCKET = 64
"""Static caches are sized up to a multiple of this many positions, so generations of nearby lengths share one
cache (and one compiled step) while a short one does not attend over the model's whole context."""


def compile_default(device: torch.device) -> bool:
    """infer.compile=null: compile where it pays. On CUDA the step is launch-bound and CUDA graphs replay it in
    one launch; on the CPU compiling costs more seconds than a generation of the default length saves."""
    return device.type == "cuda"


def compile_options(device: torch.device,
                    experts_form: str = "auto") -> dict[str, str | int | bool | Callable[..., Any]]:
    """inductor's options for a decode step: CUDA graphs on CUDA (reduce-overhead mode's option), and eager's
    rounding of low-precision intermediates. With gathered experts on CUDA, gpt-fast's coordinate-descent tuning:
    inductor then makes each one-row product a reduction of its own, which loads a routed expert's weights where
    they lie (the gather fused into the load) instead of copying them out for a batched GEMM."""
    cuda = device.type == "cuda"
    return {"triton.cudagraphs": cuda, "emulate_precision_casts": True,
            **({"coordinate_descent_tuning": True} if cuda and experts_form == "gather" else {})}


class DecodeStep:
    """`Transformer.decode` with the static cache it writes, eager or compiled; one per model, reused across
    generations (a compiled step is compiled once per batch size and cache capacity).

    Compiled: `fullgraph=True` where every MoE layer's experts are resident (GroupedExperts); an offloader's
    stand-in experts run outside the graph (their copies and host reads are not capturable), splitting it.
    On CUDA the graph is replayed as CUDA graphs (reduce-overhead's `triton.cudagraphs`): the weights are
    parameters and the cache's buffers are marked static, so every replay reads and writes the same addresses and
    only the token and position are copied in. inductor rounds where eager rounds (`emulate_precision_casts`):
    compiled tokens are eager tokens in bf16 too."""

    def __init__(self, model: Transformer, compile: bool = False, backend: str | Callable = "inductor",
                 dynamic: bool | None = False, experts_form: str = "auto"):
        """backend: torch.compile's (tests check graph breaks around stand-ins with aot_eager: seconds to compile);
        dynamic: its dynamic-shape setting (a lone step's shapes are static); experts_form: how resident experts
        read their routed weights (runtime/moe/routed.py's ROUTED_FORMS), set on every MoE layer's experts."""
        if experts_form not in ROUTED_FORMS:
            raise ValueError(f"experts_form={experts_form!r} is not one of {', '.join(ROUTED_FORMS)}")
        self.model = model
        self.device = model.tok_embeddings.weight.device
        self.compiled = compile
        self.fullgraph = all(isinstance(layer.experts, GroupedExperts) for layer in model.moe_layers())
        for layer in model.moe_layers():  # routers compute in fp32: an exact fp32 gate is not cast every token
            layer.router.gate.float()
            if isinstance(layer.experts, GroupedExperts):
                layer.experts.routed_form = experts_form
        self.cache: StaticKVCache | None = None
        fn: Callable[[Tensor, Tensor, StaticKVCache], Tensor] = model.decode
        if compile:
            options = compile_options(self.device, experts_form) if backend == "inductor" else None
            fn = torch.compile(model.decode, fullgraph=self.fullgraph, dynamic=dynamic, backend=backend,
                               options=options)
        self._decode = fn

    def cache_for(self, batch: int, positions: int) -> StaticKVCache:
        """A static cache of at least `positions` for `batch` rows: the last one when it fits (its stale slots are
        masked until overwritten), else a new one."""
        capacity = -(-positions // CACHE_BUCKET) * CACHE_BUCKET
        cache = self.cache
        if cache is None or cache.keys[0].shape[0] != batch or cache.capacity != capacity or \
                cache.keys[0].dtype != self.model.tok_embeddings.weight.dtype:
            self.cache = cache = None  # let go of the old buffers before allocating the new ones
            cache = self.model.new_static_cache(batch, capacity)
            if self.compiled and self.device.type == "cuda":
                for buf in cache.buffers():
                    torch._dynamo.mark_static_address(buf)
            self.cache = cache
        return cache

    def prefill(self, tokens_BS: Tensor, cache: StaticKVCache) -> Tensor:
        """The prompt's forward (sort-based MoE dispatch), filling positions 0..S-1 -> last position's logits."""
        return self.model.prefill(tokens_BS, cache)

    def __call__(self, tokens_B1: Tensor, pos_1: Tensor, cache: StaticKVCache) -> Tensor:
        """Next-token logits [B, V] for tokens [B, 1] at position pos_1 (device tensor)."""
        if self.compiled and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs have been read
        try:
            with decode_kernels(self.device):
                return self._decode(tokens_B1, pos_1, cache)
        except torch._dynamo.exc.TorchDynamoException as exc:  # only a compiled step raises these
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise InferError(f"infer.compile=true: torch.compile failed ({reason}); set infer.compile=false") from exc


class BatchDecodeStep(DecodeStep):
    """The continuous batch's decode step (vLLM's CUDA-graph decode batches): `Transformer.decode` over rows 0..n-1
    of the batch's cache, each row at its own position, n padded up to a bucket (a power of two, at most the
    batch's rows). Compiled, the batch dimension is dynamic: one graph serves every bucket above one row (and one
    the single row), and on CUDA each bucket replays its own CUDA graph, recorded the first time it runs. Padding
    rows decode a dummy token into free rows of the cache (a row taken later is written over by its prefill). A
    row's logits are its lone step's up to the kernels' batch (in)variance: one product over the rows where a lone
    step makes a one-row product; greedy tokens agree, and are equal where the kernels are batch-invariant."""

    def __init__(self, model: Transformer, max_rows: int, compile: bool = False, backend: str | Callable = "inductor"):
        super().__init__(model, compile, backend, dynamic=None)
        self.buckets = sorted({min(max_rows, 1 << i) for i in range(max(1, max_rows).bit_length() + 1)})
        self._static: StaticKVCache | None = None

    def bucket(self, rows: int) -> int:
        """The batch size a step over `rows` rows runs at."""
        return next(b for b in self.buckets if b >= rows)

    def rows(self, tokens_n: Tensor, pos_n: Tensor, cache: StaticKVCache) -> Tensor:
        """Next-token logits [n, V] for token tokens_n[b] at position pos_n[b] of cache row b."""
        n = tokens_n.shape[0]
        pad = self.bucket(n) - n
        if pad:
            tokens_n = torch.cat((tokens_n, tokens_n.new_zeros(pad)))
            pos_n = torch.cat((pos_n, pos_n.new_zeros(pad)))
        tokens_B1 = tokens_n[:, None]
        if self.compiled:
            if self.device.type == "cuda" and self._static is not cache:
                for buf in cache.buffers():
                    torch._dynamo.mark_static_address(buf)
                self._static = cache
            if pos_n.shape[0] > 1:  # one graph for every bucket above one row
                torch._dynamo.mark_dynamic(pos_n, 0)
                torch._dynamo.mark_dynamic(tokens_B1, 0)
        return self(tokens_B1, pos_n, cache)[:n]
