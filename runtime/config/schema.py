"""The dataclass schema of every config key, one class a section, each with its docstring, bounds and rules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Literal

from runtime.config.checks import ConfigSection, Problems
from runtime.config.machine import MachineRates
from runtime.config.model import ModelConfig

AUTO_LAYERS = None
"""storage.resident_layers=auto as the schema stores it (0 is a value of its own: no layer kept)."""

FREEZABLE = ("router", "attention", "norms", "embeddings", "experts", "shared_experts")
"""The parameter sets train.freeze names (runtime/train/freeze.py says which parameters each holds)."""


@dataclass
class TopologyConfig(MachineRates, ConfigSection):
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

    BOUNDS = (("positive", "nodes expert_parallel nproc_per_node"),
              (">= 0", "gpus_per_node gpu_memory_gb cpu_memory_gb ssd_gb"), *MachineRates.RATE_BOUNDS)

    def rules(self, p: Problems, at: str) -> None:
        """expert_parallel is resolved from auto (0) before this runs."""
        if self.expert_parallel > 0 and self.nodes > 0 and self.nproc_per_node > 0:
            p.need(self.world_size % self.expert_parallel == 0,
                   f"{at}.expert_parallel={self.expert_parallel} must divide the world size ({at}.nodes x "
                   f"{'gpus_per_node' if self.gpus_per_node else 'nproc_per_node'} = {self.world_size})")


@dataclass
class StorageConfig(ConfigSection):
    """Where expert states live (the paper's "Training Phase", Eq. 1 and Algorithm 2)."""

    alpha: float = 1.0
    """Probability that a sparse parameter is activated."""
    offload: Annotated[str, Literal["none", "cpu", "ssd", "auto"]] = "none"
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
    direct_io: bool = True
    """storage.offload=ssd: the store's reads and writes bypass the page cache (O_DIRECT) where its filesystem
    allows, so the disk moves the states without a CPU copy. false: through the page cache, which costs the CPU
    several times a memcpy per byte but keeps recently written experts in free RAM (faster only where it holds the
    store)."""
    resident_layers: int | None = 0
    """storage.offload=cpu|ssd: the first N MoE layers keep their expert states on the device, trained by the resident
    optimizer as with offload=none; the rest are offloaded (ZeRO-Offload++'s Twin-Flow, by layer). Spends spare GPU
    memory so that the CPU optimizer steps fewer experts; `moesys plan` counts both parts. `auto` (stored as null): as
    many as the plan's schedule finds fastest among those that fit."""
    delayed_update: bool = False
    """ZeRO-Offload's one-step delayed parameter update (storage.offload=cpu): step t's CPU AdamW runs during step
    t+1's forward and backward, which see the weights of step t-1. Hides the CPU optimizer when it is slower than
    the device's step; not bit-equal to training without it."""

    BOUNDS = (("in (0, 1]", "alpha"), (">= 0", "cpu_cache_experts hit_threshold"), ("in (0, 1]", "decay_beta"),
              ("positive", "decay_every"), (">= 0", "prefetch_depth"))

    def rules(self, p: Problems, at: str) -> None:
        p.need(self.direct_io or self.offload in ("ssd", "auto"),
               f"{at}.direct_io=false applies to the SSD store only (got {at}.offload={self.offload}); set "
               f"{at}.offload=ssd or drop {at}.direct_io")
        kept = self.resident_layers or 0
        p.need(kept >= 0, f"{at}.resident_layers must be >= 0 or auto (got {self.resident_layers})")
        p.need(kept <= 0 or self.offload in ("cpu", "ssd"),
               f"{at}.resident_layers={self.resident_layers} needs {at}.offload=cpu or ssd (got {self.offload}): it "
               f"keeps some offloaded layers on the device; set {at}.offload or drop {at}.resident_layers")
        p.need(not self.delayed_update or self.offload == "cpu",
               f"{at}.delayed_update=true needs {at}.offload=cpu (got {self.offload}): the update runs beside the next "
               f"step on expert states held in host memory; set {at}.offload=cpu or {at}.delayed_update=false")


@dataclass
class ParallelConfig(ConfigSection):
    """How ranks communicate."""

    alltoall: Annotated[str, Literal["flat", "hierarchical"]] = "flat"
    """flat or hierarchical (intra-node, then inter-node)."""
    bucket_mb: float = 25.0
    """Size of a dense gradient bucket in MB."""
    ranks_per_node: int = 0
    """Ranks that share a node for hierarchical AlltoAll; 0 means the launcher's processes per node. Set it
    smaller to treat one machine as several nodes (tests, benchmarks)."""

    BOUNDS = ((">= 0", "ranks_per_node"), ("positive", "bucket_mb"))


@dataclass
class TrainConfig(ConfigSection):
    """The training loop and its run directory."""

    max_steps: int = 100
    """Optimizer steps."""
    micro_batch_size: int = 8
    """Sequences per rank in one forward and backward (a micro-batch)."""
    grad_accum_steps: int = 1
    """Micro-batches each rank runs per optimizer step, their gradients summed before one update: tokens per step =
    ranks x micro_batch_size x grad_accum_steps x seq_len. `auto` (stored as 0): the plan splits micro_batch_size
    sequences into micro-batch x accumulation for this machine (moesys plan's schedule)."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    min_lr: float = 1e-4
    """Learning rate at train.max_steps, where the cosine or linear decay (train.lr_schedule) ends."""
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
    run_dir: str | None = None
    """Run directory; None makes one under ./outputs/."""
    data: str | None = None
    """Training data: a text file, a directory of *.txt files, a .jsonl file (one JSON object a line, its text under
    train.data_text_key), or a token file (.bin: raw uint16 ids, uint32 for a vocabulary over 65,536; .npy of uint16
    or uint32) read through a memory map; None uses the corpus shipped with moesys."""
    data_format: Annotated[str, Literal["auto", "text", "chat"]] = "auto"
    """How train.data and train.eval_data are read: text (a token stream cut into windows), chat (a .jsonl of
    OpenAI-style messages or prompt/completion records, rendered with the chat template, the loss on the assistant's
    tokens only), or auto: chat for a .jsonl whose first record has messages or a prompt and a completion."""
    pack: bool = True
    """Chat data: several samples to a row of train.seq_len positions, attention kept within each sample and
    positions restarting in each; false: one sample a row, padded."""
    long_samples: Annotated[str, Literal["cut", "refuse"]] = "cut"
    """Chat data: a sample longer than train.seq_len + 1 tokens is cut to it (their count is said once before
    training), or refused before training starts."""
    data_text_key: str = "text"
    """The key of each .jsonl record that holds its text (train.data, train.eval_data)."""
    data_errors: Annotated[str, Literal["strict", "replace"]] = "strict"
    """Text sources' bytes that are not UTF-8 text: strict refuses the file naming the first bad byte's offset (a
    binary file given as text), replace reads each bad sequence as U+FFFD."""
    tokenizer: str = "bytes"
    """bytes (UTF-8 bytes as ids 0..255) or the path of a Hugging Face tokenizer.json (moesys tokenizer train writes
    one); the run, its checkpoints and its exports carry a copy."""
    eval_data: str | None = None
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
    precision: Annotated[str, Literal["fp32", "bf16", "fp16"]] = "fp32"
    """fp32, bf16 or fp16 compute (fp32 master weights)."""
    log_every: int = 1
    """Steps between metrics lines; a line averages its steps, which read nothing back to the host until it."""
    collective_timeout_s: float = 300.0
    """Seconds a rank waits in a collective for its peers before the job fails with a line naming it."""
    recompute: Annotated[str, Literal["none", "moe", "block", "auto"]] = "none"
    """Activation recomputation in backward: none, moe (the experts' FFNs keep only their input rows), block (each
    transformer block keeps only its input), or auto (the plan's schedule picks); gradients are exact."""
    compile: bool = False
    """Compile each transformer block with torch.compile, one graph a block (no graph breaks)."""
    tensorboard: bool = False
    """Also write TensorBoard event files (RUN_DIR/tensorboard/, rank 0) with the metrics.jsonl values: scalars per
    step, each MoE layer's expert load as a histogram. Needs the extra: pip install 'moesys[tensorboard]'."""
    init_from: str | None = None
    """The weights a new run starts from: a Hugging Face model directory (config.json + safetensors, sharded or not)
    or a moesys run, step directory or export. Its model section replaces the recipe's (an explicit model.* override
    that contradicts it is refused) and its tokenizer.json, when it has one, is train.tokenizer's. Weights only: the
    optimizer starts from zero moments. A run directory that holds a checkpoint resumes from it instead (said once)."""
    freeze: list[str] = field(default_factory=list)
    """Parameter sets not trained: router, attention, norms, embeddings (input and output), experts, shared_experts.
    Frozen parameters get no gradient and no optimizer state; frozen offloaded experts move no gradients."""
    lr_schedule: Annotated[str, Literal["cosine", "linear", "constant"]] = "cosine"
    """After the warm-up: cosine or linear decay from train.lr to train.min_lr at train.max_steps, or train.lr
    throughout (constant)."""

    BOUNDS = (("positive", "max_steps micro_batch_size seq_len log_every lr collective_timeout_s"),
              (">= 0", "checkpoint_every max_restarts warmup_steps grad_clip weight_decay eval_every eval_windows "
                      "grad_accum_steps"))

    def rules(self, p: Problems, at: str) -> None:
        p.need(bool(self.tokenizer), f"{at}.tokenizer is empty; set it to bytes or the path of a tokenizer.json")
        p.need(bool(self.data_text_key), f"{at}.data_text_key is empty; set it to the key of a .jsonl record's text")
        p.need(self.keep_checkpoints >= 1, f"{at}.keep_checkpoints must be >= 1 (got {self.keep_checkpoints}): the "
               "newest checkpoint is what a restart resumes from")
        for name in self.freeze:
            p.need(name in FREEZABLE, f"{at}.freeze: {name!r} is not one of {', '.join(FREEZABLE)}")
        p.need(len(set(self.freeze)) == len(self.freeze), f"{at}.freeze={self.freeze} names a set twice")
        p.need(resume_step(self.resume_from) is not False, f"{at}.resume_from={self.resume_from!r} is not latest, "
               f"none or step_N (e.g. {at}.resume_from=step_100)")


@dataclass
class InferConfig(ConfigSection):
    """Generation."""

    max_new_tokens: int = 32
    """Tokens generated per prompt."""
    prompt: str | None = None
    """Prompt text."""
    prompt_ids: list[int] | None = None
    """Prompt as token ids, for checkpoints without a tokenizer."""
    temperature: float = 0.0
    """0 is greedy."""
    top_k: int = 0
    """Sample from the k most likely tokens; 0 means all."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the most likely tokens whose probabilities first add up to top_p; 1 means all."""
    presence_penalty: float = 0.0
    """-2..2, subtracted from the logit of every token already generated (OpenAI's presence_penalty)."""
    frequency_penalty: float = 0.0
    """-2..2, subtracted from a token's logit once per time it has been generated (OpenAI's frequency_penalty)."""
    logit_bias: dict[str, float] = field(default_factory=dict)
    """{token id: bias}, each bias -100..100 added to that token's logit before sampling (OpenAI's logit_bias)."""
    seed: int = 0
    """Sampling seed."""
    ring_slots: int = 2
    """The device budget for experts: K slots of one MoE layer's experts each (ring memory's slots; auto's
    resident layers and expert cache)."""
    offload: Annotated[str, Literal["auto", "ring", "ondemand", "none"]] = "auto"
    """auto (per-layer placement within the budget, experts fetched or computed where they lie only when routed),
    ring, ondemand or none."""
    prefetch: bool = False
    """auto: start reading a streamed layer's likely experts (the layer's gate applied to the previous layer's
    input) while the previous layer computes. Off by default: its wrong guesses evict pages still needed, so it
    gained nothing from a cold page cache and slowed decode under a memory cap
    (benchmarks/infer-prefetch_*.md)."""
    compile: bool | None = None
    """Wrap the decode step in torch.compile (CUDA graphs on a GPU); null: where it pays, on CUDA, not on the CPU."""
    cache_dir: str | None = None
    """Where ring and ondemand keep each checkpoint's copy of its experts (reused while the checkpoint is unchanged);
    null: $XDG_CACHE_HOME/moesys/experts, else ~/.cache/moesys/experts."""
    cache_gb: float = 100.0
    """Most GB of copies infer.cache_dir keeps: the least recently used checkpoints' copies go first, never one a
    running process uses. 100 holds one Mixtral-8x7B's experts in bf16."""

    BOUNDS = (("positive", "max_new_tokens cache_gb"), (">= 0", "temperature top_k"), (">= 1", "ring_slots"),
              ("in (0, 1]", "top_p"))

    def rules(self, p: Problems, at: str) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            p.need(-2 <= value <= 2, f"{at}.{name} must be between -2 and 2 (got {value})")
        for token, bias in self.logit_bias.items():
            p.need(str(token).isdigit(), f"{at}.logit_bias: key {token!r} is not a token id (give {{104: 5.0}})")
            p.need(isinstance(bias, (int, float)) and -100 <= bias <= 100,
                   f"{at}.logit_bias[{token}] must be between -100 and 100 (got {bias})")


@dataclass
class ExportConfig(ConfigSection):
    """`moesys export`: one servable model from a training checkpoint or a Hugging Face model directory."""

    format: Annotated[str, Literal["moesys", "hf"]] = "moesys"
    """moesys (a checkpoint `moesys infer` and `moesys serve` read, without optimizer state) or hf (the model's own
    Hugging Face family, model.family; moesys's own SwiGLU/RoPE models as Mixtral)."""
    dtype: Annotated[str, Literal["fp32", "bf16", "fp16"]] | None = None
    """fp32, bf16 or fp16; null keeps the checkpoint's."""
    max_shard_gb: float = 5.0
    """Largest safetensors file written; larger models are split into shards with an index."""

    BOUNDS = (("positive", "max_shard_gb"),)


@dataclass
class StudentConfig(ConfigSection):
    """`moesys distill`: the smaller model trained from a teacher."""

    num_experts: int = 0
    """Experts per MoE layer of the student (fewer than the teacher's); 0 means not set."""

    BOUNDS = ((">= 0", "num_experts"),)


@dataclass
class DistillConfig(ConfigSection):
    """`moesys distill`: how the student learns from the teacher."""

    temperature: float = 2.0
    """Softmax temperature of the soft targets."""
    kd_weight: float = 0.5
    """Weight of the distillation loss; the language-model loss gets 1 - kd_weight."""
    teacher: str | None = None
    """The teacher's checkpoint (a step directory) a student run learns from; `moesys distill` sets it from
    checkpoint=. null: the run is not a distillation."""
    heldout_data: str | None = None
    """Held-out text (a file or a directory of *.txt) for the teacher's expert usage and both held-out losses;
    null holds out the last distill.heldout_fraction of train.data, which the student then does not train on."""
    heldout_fraction: float = 0.05
    """Share of train.data's tokens held out when distill.heldout_data is null."""
    heldout_windows: int = 64
    """Most train.seq_len windows of held-out text used (the first ones, not overlapping)."""

    BOUNDS = (("positive", "temperature"), ("between 0 and 1", "kd_weight"), ("in (0, 1)", "heldout_fraction"),
              ("positive", "heldout_windows"))


@dataclass
class ServeConfig(ConfigSection):
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
    max_sequences_per_request: int = 256
    """Sequences one request may ask for, prompts x n (x best_of when larger); more is refused with HTTP 400."""
    drain_timeout_s: float = 60.0
    """On SIGTERM, how long requests in flight may take to finish before they are cancelled."""
    request_timeout_s: float = 600.0
    """A request with no answer after this many seconds (a stream: no new token for this long) gets HTTP 504 and
    its generation is cancelled; /health says 'stuck' (503) while one generation has run longer than this."""

    BOUNDS = (("between 0 and 65535", "port"), (">= 1", "max_batch_size max_queue max_sequences_per_request"),
              ("positive", "drain_timeout_s request_timeout_s"))


@dataclass
class LauncherConfig(ConfigSection):
    """How `moesys train` starts its processes."""

    name: Annotated[str, Literal["local", "multinode", "slurm"]] = "local"
    """local, multinode or slurm; the number of nodes is topology.nodes."""
    node_rank: int = 0
    """This node's rank (multinode)."""
    rdzv_endpoint: str = "localhost:29500"
    """c10d rendezvous host:port (multinode)."""
    rdzv_id: str = "moesys"
    """Rendezvous job id (multinode)."""
    local_addr: str | None = None
    """This node's address on the network the nodes share (multinode); null: its hostname. torchrun publishes it
    to the other nodes and gloo/NCCL bind to its interface: set it where the hostname resolves to a loopback
    address or to another network."""
    partition: str | None = None
    """SLURM partition."""
    time: str = "24:00:00"
    """SLURM time limit."""
    master_port: int = 29500
    """Rendezvous port on the SLURM head node."""



@dataclass
class TaskConfig(ConfigSection):
    """One task of a multi-task load (the paper's "Elastic MoE Training")."""

    batch_size: int = 1
    """Samples per step."""
    data: str | None = None
    """The task's text data; None uses the shipped corpus."""
    cost_per_sample: float = 1.0
    """Relative compute cost of one sample."""
    gpus: int = 0
    """GPUs allocated to the task; 0 means decided by `moesys rebalance`."""

    BOUNDS = (("positive", "batch_size cost_per_sample"), (">= 0", "gpus"))


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
    tasks: dict[str, TaskConfig] = field(default_factory=dict)
    recipe: str | None = None
    """Name of the recipe this config came from."""
    purpose: Annotated[str, Literal["train", "serve"]] = "train"
    """What `moesys plan` judges: train (Eq. 1 and the per-rank training estimate) or serve (ring-memory
    inference: dense weights plus the expert layers infer.offload keeps on the device)."""

    def problems(self) -> Problems:
        """What is wrong with each section alone and with the top-level keys; the cross-section rules are apart."""
        p = Problems()
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if isinstance(section, ConfigSection):
                p += section.problems(f.name)
        for name, task in self.tasks.items():
            p += task.problems(f"tasks.{name}")
        p.chosen(self, "")
        return p


def resume_step(value: str) -> int | None | bool:
    """train.resume_from as a step: None for latest and none (no fixed step), N for step_N, False when malformed."""
    if value in ("latest", "none"):
        return None
    head, _, digits = str(value).partition("_")
    return int(digits) if head == "step" and digits.isdigit() else False
