"""Every path name of a run directory and of the checkpoints in it: the one place each is spelled.

RUN_DIR/                config.yaml, metrics.jsonl, summary.json, plan.json, tokenizer.json, distill.json,
                        chat_template.jinja, generation_tokens.json (train.init_from's), fatal_error.txt, .lock,
                        job.sbatch (SLURM)
  logs/                 torchrun's logs (logs/node<N>/ for each node of a multinode job), slurm-<job>.out
  tokens/               text sources tokenized once for every rank
  memory/rank<R>.json   each rank's last measured memory
  tensorboard/          event files (train.tensorboard)
  expert_store/ep<r>-of-<n>-edp<k>/   one rank's SSD expert store (storage.ssd_path when set): OWNER, live/
  checkpoints/          latest, step_<N>/, .tmp-step_<N>/ (being written), superseded-<time>/
    step_<N>/           meta.json, tokenizer.json (and the run's chat_template.jinja, generation_tokens.json),
                        dense.safetensors, experts-ep<p>.safetensors (or one experts-ep<p>-L<l>.safetensors per
                        offloaded layer), dense-sharded.safetensors, heads-<task>.safetensors, tasks.json,
                        rng-rank<r>.safetensors
"""

from __future__ import annotations

import time
from pathlib import Path

from runtime.config import MoesysConfig

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PLAN = "plan.json"
"""The placement `moesys train` decided, with the full plan (runtime/plan/placement.py)."""
SELECTION = "distill.json"
"""The experts a distillation student started from (runtime/train/student_init.py)."""
FATAL = "fatal_error.txt"
LOCK = ".lock"
LOGS = "logs"
CHECKPOINTS = "checkpoints"
TOKENS = "tokens"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""The chat template of the model train.init_from started a run from, kept by the run, its checkpoints and moesys
exports (none: ChatML); also a Hugging Face model's own file of it."""
GENERATION_TOKENS_FILE = "generation_tokens.json"
"""Beside CHAT_TEMPLATE_FILE: that model's named special tokens (eos, bos, pad, ...) and the ids its generation ends
at (runtime/data/generation_facts.py)."""
MEMORY_DIR = "memory"
TENSORBOARD = "tensorboard"
EXPERT_STORE = "expert_store"
SLURM_SCRIPT = "job.sbatch"
SLURM_LOG = "slurm-%j.out"
RUN_MARKS = (LOGS, CHECKPOINTS, METRICS)
"""What `moesys train` writes beside its config.yaml; a directory with the config and one of these is a run."""
RUN_WRITES = (METRICS, CHECKPOINTS, PLAN, LOGS)
"""What a run writes into its directory that a directory without a run's config.yaml must not hold already (another
tool's files of these names would be appended to or mixed with the run's)."""

TOKENIZER_FILE = "tokenizer.json"
"""The tokenizer a run, its checkpoints and its exports carry (Hugging Face tokenizer.json format)."""
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
"""Beside tokenizer.json in an hf export, so that AutoTokenizer loads it."""
GENERATION_CONFIG = "generation_config.json"
"""In an hf export and a Hugging Face model: the token ids generation ends at (eos_token_id)."""
META = "meta.json"
"""A checkpoint's (and an export's) step, layout and config."""
MODEL_FILES = ("config.json", META)
"""Files at the top of a model directory (a moesys export, a Hugging Face model), never at the top of a run."""

LATEST = "latest"
"""CHECKPOINTS/latest: the name of the newest complete checkpoint."""
STEP_PREFIX = "step_"
PARTIAL = ".tmp-"
"""The prefix of a checkpoint's directory while it is written (CHECKPOINTS/.tmp-step_N), renamed when complete."""
SUPERSEDED = "superseded-"
"""CHECKPOINTS/superseded-TIME/: the checkpoints a launch with train.resume_from=none|step_N started before."""
DENSE = "dense.safetensors"
DENSE_SHARDED = "dense-sharded.safetensors"
TASKS = "tasks.json"
RNG_PREFIX = "rng-"
"""RNG state files (rng-rank<r>.safetensors) hold no model or optimizer tensor."""

LIVE = "live"
"""An expert store's working files, one per (layer, expert)."""
OWNER = "OWNER"
"""An expert store's marker naming the run directory it belongs to."""


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory's name (step_N), None for any other name."""
    digits = name.removeprefix(STEP_PREFIX)
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


def experts_file(ep_rank: int, layer: int | None = None) -> str:
    """The experts of expert-parallel rank `ep_rank`: all of them, or one offloaded MoE layer's."""
    return f"experts-ep{ep_rank}.safetensors" if layer is None else f"experts-ep{ep_rank}-L{layer:04d}.safetensors"


def experts_file_stem(ep_rank: int) -> str:
    """What every file of experts_file(ep_rank, ...) starts with."""
    return f"experts-ep{ep_rank}"


def rng_file(rank: int) -> str:
    return f"{RNG_PREFIX}rank{rank}.safetensors"


def heads_file(task: str) -> str:
    return f"heads-{task}.safetensors"


def rank_memory_file(rank: int) -> str:
    return f"rank{rank}.json"


def live_expert_file(layer: int, expert: int) -> str:
    return f"L{layer:04d}-E{expert:06d}.safetensors"


def expert_store_dir(ep_rank: int, ep_size: int, edp_rank: int) -> str:
    """One rank's store under the expert store root: every expert-parallel rank and replica keeps its own."""
    return f"ep{ep_rank}-of-{ep_size}-edp{edp_rank}"


def run_dir_of(cfg: MoesysConfig) -> Path:
    """train.run_dir of a config about to run (the CLI and the job API set it before anything else reads it)."""
    if cfg.train.run_dir is None:
        raise ValueError("train.run_dir is not set: resolve the run directory before preparing or checking a run")
    return Path(cfg.train.run_dir)


def default_run_dir(cfg: MoesysConfig) -> Path:
    return Path("outputs") / f"{cfg.recipe or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"


def node_logs(run_dir: Path, cfg: MoesysConfig) -> Path:
    """This node's logs: RUN_DIR/logs, or RUN_DIR/logs/node<N> in a multinode job, whose nodes share the run
    directory (each node's torchrun writes the same local-rank tree, and each launcher follows its own)."""
    if cfg.launcher.name == "multinode":
        return Path(run_dir) / LOGS / f"node{cfg.launcher.node_rank}"
    return Path(run_dir) / LOGS


def expert_store_root(cfg: MoesysConfig) -> Path:
    """Where this run's SSD expert store lives: storage.ssd_path, or expert_store/ inside the run directory."""
    if cfg.storage.ssd_path:
        return Path(cfg.storage.ssd_path).expanduser().resolve()
    return Path(cfg.train.run_dir or default_run_dir(cfg)).resolve() / EXPERT_STORE
