"""The one typed configuration of moesys: dataclass schemas and their cross-field validation.

The CLI composes these with Hydra; torchrun workers rebuild them from the run directory's
config.yaml with `config_from_dict`, so workers never import Hydra or OmegaConf.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import ipaddress
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from runtime.errors import UserError


class ConfigError(UserError):
    """A configuration problem, phrased for the user: names the dotted key and what is allowed."""


@dataclass
class ModelConfig:
    """The transformer and its MoE layers (seed 004 section 5; Mixtral for the SwiGLU/RoPE family)."""

    hidden_size: int = 128
    """Model width D."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention (query) heads."""
    num_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention; None means num_heads."""
    vocab_size: int = 256
    """Vocabulary V: at least train.tokenizer's (256 for bytes); more leaves ids no text maps to."""
    ffn_hidden_size: Optional[int] = None
    """Expert / dense FFN width F; None means 4 x hidden_size."""
    num_experts: int = 8
    """Experts per MoE layer E."""
    top_k: int = 2
    """Experts each token is routed to (1 = Switch, 2 = GShard)."""
    expert_type: str = "gelu"
    """FFN kind: gelu (GPT) or swiglu (Mixtral)."""
    moe_layer_freq: int = 1
    """Every k-th block is an MoE block (1 = all)."""
    max_seq_len: int = 256
    """Longest sequence; sizes learned positions and the RoPE table."""
    norm: str = "layernorm"
    """layernorm or rmsnorm."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    bias: bool = True
    """Biases in linear layers and LayerNorm."""
    position: str = "learned"
    """learned positions or rope."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    capacity_factor: float = 0.0
    """Expert capacity = factor x tokens x top_k / experts; 0 means dropless."""
    drop_policy: str = "cut"
    """Which tokens an over-full expert drops: cut (latest), random, routing_weight (lowest weight)."""
    router_jitter: float = 0.0
    """Multiplicative jitter epsilon on router inputs while training."""
    router_input_dropout: float = 0.0
    """Dropout on router inputs while training."""
    router_gumbel: bool = False
    """Gumbel-max sampling of the second..k-th expert while training."""
    normalize_top_k: bool = True
    """Renormalise the top-k routing weights to sum to 1 (Mixtral)."""
    aux_loss_weight: float = 0.01
    """Weight of the Switch load-balancing loss."""
    z_loss_weight: float = 0.0
    """Weight of the router z-loss."""
    sparsity_loss_weight: float = 0.0
    """Weight of the L1 sparsity loss on routing probabilities."""
    importance_loss_weight: float = 0.0
    """Weight of the mean-importance loss."""
    embedding_partition: bool = False
    """Split the [V, H] embedding column-wise over data-parallel ranks (the paper's "Embedding Partition in Data
    Parallelism")."""

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def is_moe_layer(self, index: int) -> bool:
        """Block `index` (0-based) is an MoE block when it is the last of each group of moe_layer_freq."""
        return self.num_experts > 0 and index % self.moe_layer_freq == self.moe_layer_freq - 1

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))


@dataclass
class TopologyConfig:
    """The machines: nodes, GPUs and memory per node (a node is the paper's 'device')."""

    nodes: int = 1
    """Nodes N."""
    gpus_per_node: int = 0
    """GPUs per node; 0 runs on CPU."""
    gpu_memory_gb: float = 0.0
    """Memory of one GPU in GB."""
    cpu_memory_gb: float = 16.0
    """Host memory of one node in GB."""
    ssd_gb: float = 100.0
    """SSD space of one node in GB."""
    expert_parallel: int = 1
    """Ranks the experts of a layer are split over; `auto` (stored as 0 until resolved): the largest divisor of the
    world size that also divides model.num_experts. Resolved to an int before any verb or worker sees it."""
    nproc_per_node: int = 2
    """Processes per node for local runs."""
    detect: bool = False
    """Fill gpus_per_node, gpu_memory_gb, cpu_memory_gb and ssd_gb from this machine."""

    @property
    def processes_per_node(self) -> int:
        """Ranks per node: one per GPU when gpus_per_node is set, else nproc_per_node CPU processes."""
        return self.gpus_per_node or self.nproc_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node


@dataclass
class StorageConfig:
    """Where expert states live (seed 004 section 3.2, Eq. 1 and Algorithm 2)."""

    alpha: float = 1.0
    """Probability that a sparse parameter is activated."""
    offload: str = "none"
    """none, cpu, ssd, or auto (placement from Eq. 1)."""
    ssd_path: str = ""
    """Directory of the on-disk expert state store; empty: `expert_store/` in the run directory. One run per store."""
    cpu_cache_experts: int = 0
    """Experts held in the CPU cache; 0 means from the plan."""
    hit_threshold: int = 1
    """Hits an entry needs before it may be evicted (Algorithm 2)."""
    decay_beta: float = 0.5
    """Hit counts are multiplied by this every decay_every steps."""
    decay_every: int = 10
    """Steps between hit-count decays."""
    dense_shard: bool = False
    """Shard dense parameters and optimizer states over data-parallel ranks (Algorithm 1)."""
    prefetch_depth: int = 1
    """Layers fetched ahead of the one computing."""
    delayed_update: bool = False
    """ZeRO-Offload's one-step delayed parameter update (storage.offload=cpu): step t's CPU AdamW runs during step
    t+1's forward and backward, which see the weights of step t-1. Hides the CPU optimizer when it is slower than
    the device's step; not bit-equal to training without it."""


@dataclass
class ParallelConfig:
    """How ranks communicate."""

    alltoall: str = "flat"
    """flat or hierarchical (intra-node, then inter-node)."""
    bucket_mb: float = 25.0
    """Size of a dense gradient bucket in MB."""
    ranks_per_node: int = 0
    """Ranks that share a node for hierarchical AlltoAll; 0 means the launcher's processes per node. Set it
    smaller to treat one machine as several nodes (tests, benchmarks)."""


@dataclass
class TrainConfig:
    """The training loop and its run directory."""

    max_steps: int = 100
    """Optimizer steps."""
    micro_batch_size: int = 8
    """Sequences per rank per step."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    seed: int = 1234
    """Seed of parameters, data order and routing noise."""
    checkpoint_every: int = 50
    """Steps between checkpoints; 0 keeps only the final one."""
    final_checkpoint: bool = True
    """Write a checkpoint when training ends (max_steps or a stop request). False for throwaway runs, e.g. a
    benchmark whose checkpoint would not fit on the disk beside its expert store."""
    max_restarts: int = 3
    """Times torchrun restarts failed workers."""
    run_dir: Optional[str] = None
    """Run directory; None makes one under ./outputs/."""
    data: Optional[str] = None
    """Training data: a text file, a directory of *.txt files, a .jsonl file (one JSON object a line, its text under
    train.data_text_key), or a token file (.bin: raw uint16 ids, uint32 for a vocabulary over 65,536; .npy of uint16
    or uint32) read through a memory map; None uses the corpus shipped with moesys."""
    data_text_key: str = "text"
    """The key of each .jsonl record that holds its text (train.data, train.eval_data)."""
    tokenizer: str = "bytes"
    """bytes (UTF-8 bytes as ids 0..255) or the path of a Hugging Face tokenizer.json (moesys tokenizer train writes
    one); the run, its checkpoints and its exports carry a copy."""
    eval_data: Optional[str] = None
    """Held-out data in any train.data format; its loss and perplexity go to metrics.jsonl (eval_loss,
    eval_perplexity, eval_tokens) every train.eval_every steps. None: no evaluation."""
    eval_every: int = 0
    """Steps between evaluations on train.eval_data, and always at the last step; 0: at the last step only."""
    eval_windows: int = 64
    """Windows of train.seq_len + 1 tokens evaluated: the first ones of train.eval_data, not overlapping; 0: all."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept, the newest ones: an older one is removed once a new one is complete, so N + 1 are
    on disk while the next is written (what the plan's disk bytes count)."""
    resume_from: str = "latest"
    """Where a launch starts: latest (the newest checkpoint of train.run_dir, if any), none (from scratch), or step_N
    (that checkpoint). Checkpoints newer than the start are moved to checkpoints/superseded-TIME/."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 compute (fp32 master weights)."""
    log_every: int = 1
    """Steps between metrics lines."""
    collective_timeout_s: float = 300.0
    """Seconds a rank waits in a collective for its peers before the job fails with a line naming it."""
    tensorboard: bool = False
    """Also write TensorBoard event files (RUN_DIR/tensorboard/, rank 0) with the metrics.jsonl values: scalars per
    step, each MoE layer's expert load as a histogram. Needs the extra: pip install 'moesys[tensorboard]'."""


@dataclass
class InferConfig:
    """Generation."""

    max_new_tokens: int = 32
    """Tokens generated per prompt."""
    prompt: Optional[str] = None
    """Prompt text."""
    prompt_ids: Optional[List[int]] = None
    """Prompt as token ids, for checkpoints without a tokenizer."""
    temperature: float = 0.0
    """0 is greedy."""
    top_k: int = 0
    """Sample from the k most likely tokens; 0 means all."""
    seed: int = 0
    """Sampling seed."""
    ring_slots: int = 2
    """The device budget for experts: K slots of one MoE layer's experts each (ring memory's slots; auto's
    resident layers and expert cache)."""
    offload: str = "auto"
    """auto (per-layer placement within the budget, experts fetched or computed where they lie only when routed),
    ring, ondemand or none."""
    prefetch: bool = False
    """auto: start reading a streamed layer's likely experts (the layer's gate applied to the previous layer's
    input) while the previous layer computes. Off by default: measured on the CPU machine it guessed 64% of the
    routed experts, gained nothing from a cold page cache and halved decode speed under a memory cap."""
    compile: Optional[bool] = None
    """Wrap the decode step in torch.compile (CUDA graphs on a GPU); null: where it pays, on CUDA, not on the CPU."""


@dataclass
class ExportConfig:
    """`moesys export`: one servable model from a training checkpoint."""

    format: str = "moesys"
    """moesys (a checkpoint `moesys infer` and `moesys serve` read, without optimizer state) or hf (the Hugging
    Face Mixtral layout; Mixtral-style models only)."""
    dtype: Optional[str] = None
    """fp32, bf16 or fp16; null keeps the checkpoint's."""
    max_shard_gb: float = 5.0
    """Largest safetensors file written; larger models are split into shards with an index."""


@dataclass
class StudentConfig:
    """`moesys distill`: the smaller model trained from a teacher."""

    num_experts: int = 0
    """Experts per MoE layer of the student (fewer than the teacher's); 0 means not set."""


@dataclass
class DistillConfig:
    """`moesys distill`: how the student learns from the teacher."""

    temperature: float = 2.0
    """Softmax temperature of the soft targets."""
    kd_weight: float = 0.5
    """Weight of the distillation loss; the language-model loss gets 1 - kd_weight."""
    teacher: Optional[str] = None
    """The teacher's checkpoint (a step directory) a student run learns from; `moesys distill` sets it from
    checkpoint=. null: the run is not a distillation."""
    heldout_data: Optional[str] = None
    """Held-out text (a file or a directory of *.txt) for the teacher's expert usage and both held-out losses;
    null holds out the last distill.heldout_fraction of train.data, which the student then does not train on."""
    heldout_fraction: float = 0.05
    """Share of train.data's tokens held out when distill.heldout_data is null."""
    heldout_windows: int = 64
    """Most train.seq_len windows of held-out text used (the first ones, not overlapping)."""


@dataclass
class ServeConfig:
    """`moesys serve`: the HTTP service."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """TCP port to listen on; 0 picks a free one (printed when the server listens)."""
    max_batch_size: int = 16
    """Sequences decoding together (continuous batching, on a dropless model: model.capacity_factor=0; else 1):
    requests of any prompt length, max_tokens and sampling settings join and leave at token granularity, each
    row computed as a lone decode step, so every request's tokens are exactly `moesys infer`'s for it alone."""
    max_queue: int = 64
    """Requests waiting for the generation worker; one more is refused with HTTP 503."""
    drain_timeout_s: float = 60.0
    """On SIGTERM, how long requests in flight may take to finish before they are cancelled."""
    request_timeout_s: float = 600.0
    """A request with no answer after this many seconds (a stream: no new token for this long) gets HTTP 504 and
    its generation is cancelled; /health says 'stuck' (503) while one generation has run longer than this."""


@dataclass
class LauncherConfig:
    """How `moesys train` starts its processes."""

    name: str = "local"
    """local, multinode or slurm; the number of nodes is topology.nodes."""
    node_rank: int = 0
    """This node's rank (multinode)."""
    rdzv_endpoint: str = "localhost:29500"
    """c10d rendezvous host:port (multinode)."""
    rdzv_id: str = "moesys"
    """Rendezvous job id (multinode)."""
    local_addr: Optional[str] = None
    """This node's address on the network the nodes share (multinode); null: its hostname. torchrun publishes it
    to the other nodes and gloo/NCCL bind to its interface: set it where the hostname resolves to a loopback
    address or to another network."""
    partition: Optional[str] = None
    """SLURM partition."""
    time: str = "24:00:00"
    """SLURM time limit."""
    master_port: int = 29500
    """Rendezvous port on the SLURM head node."""


@dataclass
class TaskConfig:
    """One task of a multi-task load (seed 004 section 4.1)."""

    batch_size: int = 1
    """Samples per step."""
    data: Optional[str] = None
    """The task's text data; None uses the shipped corpus."""
    cost_per_sample: float = 1.0
    """Relative compute cost of one sample."""
    gpus: int = 0
    """GPUs allocated to the task; 0 means decided by `moesys rebalance`."""


@dataclass
class MoesysConfig:
    """Everything a verb needs; composed from conf/ and a recipe."""

    model: ModelConfig = field(default_factory=ModelConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    infer: InferConfig = field(default_factory=InferConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    tasks: Dict[str, TaskConfig] = field(default_factory=dict)
    recipe: Optional[str] = None
    """Name of the recipe this config came from."""
    purpose: str = "train"
    """What `moesys plan` judges: train (Eq. 1 and the per-rank training estimate) or serve (ring-memory
    inference: dense weights plus the expert layers infer.offload keeps on the device)."""


CHOICES: dict[str, tuple[str, ...]] = {
    "model.expert_type": ("gelu", "swiglu"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.position": ("learned", "rope"),
    "model.drop_policy": ("cut", "random", "routing_weight"),
    "storage.offload": ("none", "cpu", "ssd", "auto"),
    "parallel.alltoall": ("flat", "hierarchical"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "infer.offload": ("auto", "ring", "ondemand", "none"),
    "launcher.name": ("local", "multinode", "slurm"),
    "export.format": ("moesys", "hf"),
}


PURPOSES = ("train", "serve")


def resolve_auto(cfg: MoesysConfig) -> None:
    """Replace values left to moesys (stored as 0) by what they mean for this config; runs before validate()."""
    t, experts = cfg.topology, cfg.model.num_experts
    if t.expert_parallel == 0:
        t.expert_parallel = math.gcd(t.world_size, experts) if experts > 0 and t.world_size > 0 else 1


BYTE_VOCAB = 256
"""Tokens of moesys's byte-level tokenizer (runtime/data/tokenizer.py): the smallest vocabulary it can train."""


def resume_step(value: str) -> int | None | bool:
    """train.resume_from as a step: None for latest and none (no fixed step), N for step_N, False when malformed."""
    if value in ("latest", "none"):
        return None
    head, _, digits = str(value).partition("_")
    return int(digits) if head == "step" and digits.isdigit() else False


def _endpoint_problems(endpoint: str, nodes: int) -> list[str]:
    """launcher.rdzv_endpoint is host:port (an IPv6 host in brackets), and, for several nodes, not a loopback
    address: the other nodes would connect to themselves."""
    host, _, port = str(endpoint).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return [f"launcher.rdzv_endpoint={endpoint!r} is not host:port with a port in 1..65535; set it to node 0's "
                "address and a free port, e.g. launcher.rdzv_endpoint=10.0.0.1:29500"]
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: only localhost is known without a lookup
        loopback = host.lower() == "localhost" or host.lower().endswith(".localhost")
    if loopback and nodes > 1:
        return [f"launcher.rdzv_endpoint={endpoint} is a loopback address, which the other nodes of topology.nodes="
                f"{nodes} cannot reach; set launcher.rdzv_endpoint=<node 0's address on the network the nodes "
                f"share>:{port}"]
    return []


def validate(cfg: MoesysConfig, packages: bool = True) -> None:
    """Check every cross-field rule and raise one ConfigError that lists all problems. packages: also check that the
    optional packages the config asks for are installed (train.tensorboard); off for a config read back from a run or
    a checkpoint, which may be served or reported on a machine without them."""
    problems: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        need(value in allowed, f"{key}={value!r} is not one of {', '.join(allowed)}")

    m, t, s = cfg.model, cfg.topology, cfg.storage
    for key in ("hidden_size", "num_layers", "num_heads", "vocab_size", "max_seq_len", "moe_layer_freq"):
        need(getattr(m, key) > 0, f"model.{key} must be positive (got {getattr(m, key)})")
    for key in ("num_kv_heads", "ffn_hidden_size"):
        value = getattr(m, key)
        need(value is None or value > 0, f"model.{key} must be positive or null (got {value})")
    need(m.num_experts >= 0, f"model.num_experts must be >= 0 (got {m.num_experts})")
    need(m.top_k > 0, f"model.top_k must be positive (got {m.top_k})")
    if m.num_experts > 0:
        need(m.top_k <= m.num_experts, f"model.top_k={m.top_k} exceeds model.num_experts={m.num_experts}")
    if m.num_heads > 0:
        need(m.hidden_size % m.num_heads == 0,
             f"model.num_heads={m.num_heads} must divide model.hidden_size={m.hidden_size}")
        if m.kv_heads > 0:
            need(m.num_heads % m.kv_heads == 0,
                 f"model.num_kv_heads={m.kv_heads} must divide model.num_heads={m.num_heads}")
        if m.position == "rope":
            need(m.head_dim % 2 == 0, f"model.position=rope needs an even head dim (got {m.head_dim})")
    need(m.capacity_factor >= 0, f"model.capacity_factor must be >= 0 (got {m.capacity_factor})")
    for key in ("router_jitter", "router_input_dropout", "aux_loss_weight", "z_loss_weight",
                "sparsity_loss_weight", "importance_loss_weight"):
        need(getattr(m, key) >= 0, f"model.{key} must be >= 0 (got {getattr(m, key)})")

    for key in ("nodes", "expert_parallel", "nproc_per_node"):
        need(getattr(t, key) > 0, f"topology.{key} must be positive (got {getattr(t, key)})")
    for key in ("gpus_per_node", "gpu_memory_gb", "cpu_memory_gb", "ssd_gb"):
        need(getattr(t, key) >= 0, f"topology.{key} must be >= 0 (got {getattr(t, key)})")
    if t.expert_parallel > 0 and m.num_experts > 0:
        need(m.num_experts % t.expert_parallel == 0,
             f"model.num_experts={m.num_experts} is not divisible by topology.expert_parallel={t.expert_parallel}")
    if t.expert_parallel > 0 and t.nodes > 0 and t.nproc_per_node > 0:
        need(t.world_size % t.expert_parallel == 0,
             f"topology.expert_parallel={t.expert_parallel} must divide the world size (topology.nodes x "
             f"{'gpus_per_node' if t.gpus_per_node else 'nproc_per_node'} = {t.world_size})")

    if cfg.launcher.name == "multinode" and t.nodes > 0:
        need(0 <= cfg.launcher.node_rank < t.nodes,
             f"launcher.node_rank={cfg.launcher.node_rank} must be in 0..{t.nodes - 1} (topology.nodes={t.nodes})")
    if cfg.launcher.name == "multinode":
        problems.extend(_endpoint_problems(cfg.launcher.rdzv_endpoint, t.nodes))
    per_node = cfg.parallel.ranks_per_node or t.processes_per_node
    if cfg.parallel.alltoall == "hierarchical" and per_node > 0 and t.expert_parallel > per_node:
        need(t.expert_parallel % per_node == 0,
             f"parallel.alltoall=hierarchical needs topology.expert_parallel={t.expert_parallel} to span whole "
             f"nodes (a multiple of the {per_node} ranks per node); use parallel.alltoall=flat")
    if m.embedding_partition and t.nodes > 0 and t.nproc_per_node > 0:
        need(m.hidden_size % t.world_size == 0,
             f"model.embedding_partition needs model.hidden_size={m.hidden_size} divisible by the "
             f"{t.world_size} data-parallel ranks")
    need(cfg.purpose in PURPOSES, f"purpose={cfg.purpose!r} is not one of {', '.join(PURPOSES)}")
    need(0 < s.alpha <= 1, f"storage.alpha must be in (0, 1] (got {s.alpha})")
    need(s.cpu_cache_experts >= 0, f"storage.cpu_cache_experts must be >= 0 (got {s.cpu_cache_experts})")
    need(s.hit_threshold >= 0, f"storage.hit_threshold must be >= 0 (got {s.hit_threshold})")
    need(0 < s.decay_beta <= 1, f"storage.decay_beta must be in (0, 1] (got {s.decay_beta})")
    need(s.decay_every > 0, f"storage.decay_every must be positive (got {s.decay_every})")
    need(s.prefetch_depth >= 0, f"storage.prefetch_depth must be >= 0 (got {s.prefetch_depth})")
    need(cfg.parallel.ranks_per_node >= 0,
         f"parallel.ranks_per_node must be >= 0 (got {cfg.parallel.ranks_per_node})")
    need(cfg.parallel.bucket_mb > 0, f"parallel.bucket_mb must be positive (got {cfg.parallel.bucket_mb})")

    tr = cfg.train
    for key in ("max_steps", "micro_batch_size", "seq_len", "log_every"):
        need(getattr(tr, key) > 0, f"train.{key} must be positive (got {getattr(tr, key)})")
    for key in ("checkpoint_every", "max_restarts", "warmup_steps", "grad_clip", "weight_decay"):
        need(getattr(tr, key) >= 0, f"train.{key} must be >= 0 (got {getattr(tr, key)})")
    need(tr.lr > 0, f"train.lr must be positive (got {tr.lr})")
    need(cfg.purpose != "train" or tr.tokenizer != "bytes" or m.vocab_size >= BYTE_VOCAB,
         f"model.vocab_size={m.vocab_size} is smaller than the byte tokenizer's {BYTE_VOCAB} tokens it trains on; "
         f"set model.vocab_size>={BYTE_VOCAB}")
    need(bool(tr.tokenizer), "train.tokenizer is empty; set it to bytes or the path of a tokenizer.json")
    need(bool(tr.data_text_key), "train.data_text_key is empty; set it to the key of a .jsonl record's text")
    need(tr.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1 (got {tr.keep_checkpoints}): the newest "
         "checkpoint is what a restart resumes from")
    for key in ("eval_every", "eval_windows"):
        need(getattr(tr, key) >= 0, f"train.{key} must be >= 0 (got {getattr(tr, key)})")
    need(resume_step(tr.resume_from) is not False,
         f"train.resume_from={tr.resume_from!r} is not latest, none or step_N (e.g. train.resume_from=step_100)")
    need(not (tr.eval_data and cfg.tasks), "train.eval_data measures a language model, and this config has tasks "
         "(multi-task heads); set train.eval_data=null")
    need(tr.collective_timeout_s > 0, f"train.collective_timeout_s must be positive (got {tr.collective_timeout_s})")
    need(not s.delayed_update or s.offload == "cpu",
         f"storage.delayed_update=true needs storage.offload=cpu (got {s.offload}): the update runs beside the next "
         "step on expert states held in host memory; set storage.offload=cpu or storage.delayed_update=false")
    need(tr.seq_len <= m.max_seq_len,
         f"train.seq_len={tr.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    need(not (packages and tr.tensorboard) or importlib.util.find_spec("tensorboard") is not None,
         "train.tensorboard=true needs the tensorboard package, which is not installed: pip install "
         "'moesys[tensorboard]' (or set train.tensorboard=false)")

    inf = cfg.infer
    need(inf.max_new_tokens > 0, f"infer.max_new_tokens must be positive (got {inf.max_new_tokens})")
    need(inf.temperature >= 0, f"infer.temperature must be >= 0 (got {inf.temperature})")
    need(inf.top_k >= 0, f"infer.top_k must be >= 0 (got {inf.top_k})")
    need(inf.ring_slots >= 1, f"infer.ring_slots must be >= 1 (got {inf.ring_slots})")
    ex = cfg.export
    need(ex.dtype in (None, "fp32", "bf16", "fp16"), f"export.dtype={ex.dtype!r} is not one of fp32, bf16, fp16, null")
    need(ex.max_shard_gb > 0, f"export.max_shard_gb must be positive (got {ex.max_shard_gb})")
    need(cfg.student.num_experts >= 0, f"student.num_experts must be >= 0 (got {cfg.student.num_experts})")
    need(cfg.distill.temperature > 0, f"distill.temperature must be positive (got {cfg.distill.temperature})")
    need(0 <= cfg.distill.kd_weight <= 1, f"distill.kd_weight must be between 0 and 1 (got {cfg.distill.kd_weight})")
    d, student = cfg.distill, cfg.student.num_experts
    need(0 < d.heldout_fraction < 1, f"distill.heldout_fraction must be in (0, 1) (got {d.heldout_fraction})")
    need(d.heldout_windows > 0, f"distill.heldout_windows must be positive (got {d.heldout_windows})")
    if d.teacher:  # a student run; that it has fewer experts than its teacher is checked where the teacher is read
        need(student > 0, "student.num_experts must be set (e.g. student.num_experts=4) for a distillation")
        need(student <= 0 or student == m.num_experts, f"student.num_experts={student} and model.num_experts="
             f"{m.num_experts} differ: set the student's experts with student.num_experts only")
        need(student <= 0 or student >= m.top_k,
             f"student.num_experts={student} is below model.top_k={m.top_k}: each token needs top_k experts")
        need(not cfg.tasks, "moesys distill trains a language model, and this config has tasks (multi-task heads)")
    else:  # set by `moesys distill` together with distill.teacher; alone it would be ignored
        need(student <= 0, f"student.num_experts={student} applies to a distillation only: run moesys distill "
             f"checkpoint=TEACHER_RUN_DIR student.num_experts={student} (or set model.num_experts to train a model "
             "of that size from scratch)")
    need(0 <= cfg.serve.port <= 65535, f"serve.port must be between 0 and 65535 (got {cfg.serve.port})")
    need(cfg.serve.max_batch_size >= 1, f"serve.max_batch_size must be >= 1 (got {cfg.serve.max_batch_size})")
    need(cfg.serve.max_queue >= 1, f"serve.max_queue must be >= 1 (got {cfg.serve.max_queue})")
    need(cfg.serve.drain_timeout_s > 0, f"serve.drain_timeout_s must be positive (got {cfg.serve.drain_timeout_s})")
    need(cfg.serve.request_timeout_s > 0,
         f"serve.request_timeout_s must be positive (got {cfg.serve.request_timeout_s})")

    for name, task in cfg.tasks.items():
        need(task.batch_size > 0, f"tasks.{name}.batch_size must be positive (got {task.batch_size})")
        need(task.cost_per_sample > 0,
             f"tasks.{name}.cost_per_sample must be positive (got {task.cost_per_sample})")
        need(task.gpus >= 0, f"tasks.{name}.gpus must be >= 0 (got {task.gpus})")

    if problems:
        raise ConfigError("; ".join(problems))


# ---- plain-data round trip (workers and checkpoints read configs without Hydra) ----

def config_to_dict(cfg: Any) -> Any:
    """A dataclass tree as plain dicts and lists (YAML/JSON ready)."""
    return dataclasses.asdict(cfg)


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping (got {value!r})")
        return _build(tp, value, key)
    if origin in (dict, Dict):
        return {k: _convert(v, args[1], f"{key}.{k}") for k, v in (value or {}).items()}
    if origin in (list, List):
        return [_convert(v, args[0], key) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise ConfigError(f"{key}={value!r} is not a {tp.__name__}")
    return value


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {dotted}{hint}")
        kwargs[key] = _convert(value, hints[key], dotted)
    return cls(**kwargs)


def config_from_dict(data: dict) -> MoesysConfig:
    """Rebuild and validate a MoesysConfig from plain data (the inverse of config_to_dict)."""
    cfg = _build(MoesysConfig, data, "")
    resolve_auto(cfg)
    validate(cfg, packages=False)
    return cfg
