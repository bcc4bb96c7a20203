"""train.compile: each transformer block compiled with torch.compile as one graph, forward and backward (no graph
breaks: fullgraph), so the elementwise work around the GEMMs fuses (norms, rope, activations, the router). The MoE
layer traces its plain forms there (runtime/moe: dispatch, combine, activations) and the experts' grouped GEMM as a
custom operator (runtime/moe/grouped_mm_op.py). A model converter: parameter names and checkpoints do not change."""

from __future__ import annotations

from runtime.model.transformer import Transformer


def compile_blocks(model: Transformer) -> None:
    """Compile every block of `model` in place (its first call compiles; later calls reuse the graph)."""
    for block in model.layers:
        block.compile(fullgraph=True, dynamic=False)
