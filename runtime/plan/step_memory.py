"""What a training step allocates on a rank's device beyond its states, counted from what the model code keeps
(runtime/model, runtime/moe, runtime/train): activations saved for backward, half-precision copies of the weights,
gradient buckets, the optimizer's temporaries and CUDA's library workspaces; and the peak of the step.

The peak is the larger of two moments. At the start of backward the states are there without gradients (they were
set to None after the last step) beside every saved activation and weight copy; at the optimizer step the gradients
are there and the activations are gone, but AdamW allocates its temporaries.

Legend: T tokens per rank (micro_batch_size x seq_len), D model dim, F ffn dim, V vocabulary, E experts,
K top-k, R rows routed to this rank's experts.
"""

from __future__ import annotations

import math

from runtime.config import MoesysConfig
from runtime.plan.params import ParamCounts, ffn_params

MiB = 2**20
CUDA_WORKSPACE_BYTES = 2 * 32 * MiB
"""cuBLAS workspaces, which torch allocates through its caching allocator (so CUDA's max allocated counts them):
32 MiB per (handle, stream) on Hopper, cuBLASLt sharing it, and a handle per thread: one for the forward (the
training thread) and one for backward (autograd's device thread)."""
CUDA_CONTEXT_BYTES = int(0.5e9)
"""Device memory the CUDA context and its kernels' modules take on each GPU before torch allocates anything:
memory the plan cannot give to the states (not in CUDA's max allocated either)."""
CUDA_HOST_BYTES = int(1.0e9)
"""Host memory (anonymous RSS) of a worker that uses CUDA, beyond a CPU worker's: the CUDA runtime and driver state,
cuBLAS and cuDNN's host allocations (a tiny-recipe CUDA worker's, benchmarks/train-memory_*.md)."""

TRANSIENT = ("activations", "weight_casts", "optimizer_step")
"""Device entries that exist at one of the two moments only (the others are held throughout the step)."""


def compute_bytes(cfg: MoesysConfig) -> int:
    """Bytes of an element computed under train.precision (autocast's dtype; fp32 without it)."""
    return 4 if cfg.train.precision == "fp32" else 2


def routed_rows(cfg: MoesysConfig, tokens: int) -> int:
    """R: rows one MoE layer computes on a rank, the routing balanced (expert parallelism sends a rank as many
    rows as it sends out); capped by the experts' capacity when model.capacity_factor > 0."""
    m = cfg.model
    rows = tokens * m.top_k
    if m.capacity_factor > 0 and m.num_experts:
        rows = min(rows, m.num_experts * math.ceil(m.capacity_factor * rows / m.num_experts))
    return rows


def activation_bytes(cfg: MoesysConfig) -> int:
    """Bytes saved for backward by one micro-batch's forward, at the start of backward, with the loss's gradient, and
    with train.recompute the largest part recomputed in backward on top (one block, or one MoE layer's experts).

    The residual stream is fp32 (fp32 weights under autocast); a norm keeps its input (RMSNorm also its normalized
    fp32 value); under autocast each projection keeps its own half-precision copy of its input; attention is
    scaled_dot_product_attention (flash or memory-efficient: q, k, v at all heads and the output, no S x S
    scores); an MoE layer keeps its fp32 norm output (the router's input), the routed rows in the compute dtype,
    the experts' [R, F] intermediates (gelu: input and output; SwiGLU: both projections and their product) and
    the rows they return; the loss keeps the logits, their fp32 log-softmax, and backward starts with two fp32
    [T, V] gradients. recompute=moe keeps no [R, F] intermediate; recompute=block keeps each block's fp32 input only.
    """
    blocks, experts_RF, tail = _saved_bytes(cfg)
    T, D = cfg.train.micro_batch_size * cfg.train.seq_len, cfg.model.hidden_size
    if cfg.train.recompute == "block":
        return int(len(blocks) * 4 * T * D + max(blocks) + tail)
    if cfg.train.recompute == "moe" and experts_RF:
        return int(sum(blocks) - (cfg.model.num_moe_layers - 1) * experts_RF + tail)
    return int(sum(blocks) + tail)


def _saved_bytes(cfg: MoesysConfig) -> tuple[list[int], int, int]:
    """(what each block saves for backward, what one MoE layer's experts save of [R, F] intermediates, what the
    final norm and the loss keep), per micro-batch (activation_bytes' terms)."""
    m, c = cfg.model, compute_bytes(cfg)
    half = c < 4
    T = cfg.train.micro_batch_size * cfg.train.seq_len
    D, F, V = m.hidden_size, m.ffn_size, m.vocab_size
    rms = 4 * T * D if m.norm == "rmsnorm" else 0
    swiglu = m.expert_type == "swiglu"

    def inputs(readers: int) -> int:
        """A norm's output as its projections keep it: a copy each under autocast, else the fp32 output once."""
        return readers * c * T * D if half else 4 * T * D

    attention = 4 * T * D + rms + inputs(3) + 4 * c * T * m.num_heads * m.head_width
    R = routed_rows(cfg, T)
    experts_RF = (3 if swiglu else 2) * c * R * F  # the experts' [R, F]
    moe = (4 * T * D + rms + 4 * T * D + 12 * T * m.num_experts  # residual, norm output for the router, routing
           + 2 * c * R * D + experts_RF)  # routed rows in and out

    def dense_ffn_rows(width: int) -> int:
        return inputs(2 if swiglu else 1) + (4 if swiglu else 2) * c * T * width

    dense_ffn = 4 * T * D + rms + dense_ffn_rows(m.dense_ffn_size)
    if m.shared_expert_hidden_size:  # every token's shared expert beside the routed rows
        moe += dense_ffn_rows(m.shared_expert_hidden_size)
    blocks = [attention + (moe if m.is_moe_layer(i) else dense_ffn) for i in range(m.num_layers)]
    logits = (c if half else 0) * T * V + 4 * T * V + 8 * T * V
    return blocks, experts_RF if m.num_moe_layers else 0, 4 * T * D + rms + inputs(1) + logits


def weight_cast_params(cfg: MoesysConfig, p: ParamCounts, resident_experts: int) -> int:
    """Parameters autocast (or the experts' explicit cast) copies to the compute dtype in a forward, each copy kept
    until its backward: every projection's weight and bias, the output head (or the tied embedding it reads) and the
    resident experts; not norms, routers (fp32) or embedding lookups. 0 in fp32."""
    m = cfg.model
    if compute_bytes(cfg) == 4:
        return 0
    hd = m.head_width
    attention = ((m.num_heads * hd + 2 * m.kv_heads * hd) * (m.hidden_size + m.qkv_bias)
                 + m.hidden_size * (m.num_heads * hd + m.out_bias))
    dense_ffns = (m.num_layers - p.moe_layers) * ffn_params(m, m.dense_ffn_size)
    dense_ffns += p.moe_layers * ffn_params(m, m.shared_expert_hidden_size) if m.shared_expert_hidden_size else 0
    return m.num_layers * attention + dense_ffns + m.vocab_size * m.hidden_size + resident_experts


def largest_tensor(cfg: MoesysConfig, local_experts_per_layer: int) -> int:
    """Elements of the largest parameter tensor a rank steps with torch's AdamW."""
    m = cfg.model
    return max(m.vocab_size * m.hidden_size, m.max_seq_len * m.hidden_size if m.position == "learned" else 0,
               m.num_heads * m.head_width * m.hidden_size, m.ffn_size * m.hidden_size * max(1, local_experts_per_layer))


def optimizer_step_bytes(cfg: MoesysConfig, resident_params: int, local_experts_per_layer: int) -> int:
    """AdamW's temporaries in torch.optim.AdamW's default implementation: on CUDA the foreach kernels take sqrt of
    every second moment of a parameter group at once (a fp32 copy of the group); on CPU the single-tensor loop takes
    two fp32 temporaries of one tensor at a time."""
    if cfg.topology.gpus_per_node:
        return 4 * resident_params
    return 2 * 4 * largest_tensor(cfg, local_experts_per_layer)


def step_peak(device: dict[str, int], gradient_bytes: int) -> tuple[int, str]:
    """(peak bytes, the moment it happens): the start of backward (states without gradients, activations and
    weight copies) or the optimizer step (states with gradients and AdamW's temporaries)."""
    held = sum(n for k, n in device.items() if k not in TRANSIENT)
    backward = held - gradient_bytes + device.get("activations", 0) + device.get("weight_casts", 0)
    step = held + device.get("optimizer_step", 0)
    return (backward, "backward") if backward >= step else (step, "optimizer step")
