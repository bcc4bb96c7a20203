"""train.init_from: a new run's first weights from a released model (a Hugging Face directory: config.json and
safetensors, sharded or not) or from a moesys run, step directory or export. The model section is the source's
config; the weights stream from its files into what each rank holds (its dense part, its block of experts, its
offloaded experts' home), one tensor or one expert at a time, so no rank holds the whole model. Weights only: the
optimizer starts with zero moments (torchtitan's initial load). A run directory holding a checkpoint resumes from it.
A run that starts from the source keeps its generation facts (chat template, eos, stop ids) in the run directory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from runtime.config import ConfigError, ModelConfig, MoesysConfig
from runtime.data.generation_facts import GenerationFacts, checkpoint_facts, hf_facts, recorded_facts, write_facts
from runtime.errors import UserError
from runtime.files.checkpoint_format import MODEL, CheckpointError, missing_tensor, tensor_key
from runtime.files.paths import CONFIG, META, TOKENIZER_FILE, run_dir_of
from runtime.files.resume import chosen_checkpoint

if TYPE_CHECKING:  # for annotations only: InitialWeights.__init__ imports them when it runs
    from runtime.hf.checkpoint import HFCheckpoint
    from runtime.inference.mapped import TensorFiles

KEY = "train.init_from"
WEIGHT_FREE_KEYS = ("capacity_factor", "drop_policy", "router_jitter", "router_input_dropout", "router_gumbel",
                    "load_balancing", "aux_loss_weight", "z_loss_weight", "sparsity_loss_weight",
                    "importance_loss_weight", "embedding_partition")
"""model.* keys the weights do not fix (how the router trains, how the embedding is split over ranks): a command-line
override of one applies to the loaded model; any other must agree with the source."""


@dataclass(frozen=True)
class InitialModel:
    """What a source says without its weights being read: enough to plan and to resolve a run's config."""

    path: Path
    kind: str
    """hf (a Hugging Face directory) or moesys (a run, step directory or export)."""
    model: ModelConfig
    tokenizer: Path | None
    """Its tokenizer.json, None when it has none (the run trains with train.tokenizer)."""
    facts: GenerationFacts | None = None
    """Its chat template, named special tokens and stop ids; None: it states none."""


def _kind(path: Path) -> str:
    if not path.is_dir():
        raise UserError(f"{KEY}={path}: {'not a directory' if path.exists() else 'no such directory'}; give a "
                        "Hugging Face model directory (config.json + safetensors) or a moesys run or export")
    if (path / CONFIG).is_file() or (path / META).is_file() or (path / "checkpoints").is_dir():
        return "moesys"
    if (path / "config.json").is_file():
        return "hf"
    raise UserError(f"{KEY}={path}: neither a Hugging Face model directory (config.json) nor a moesys run or export "
                    f"({CONFIG})")


def describe(source: str | Path) -> InitialModel:
    """The model section and tokenizer of `source` from its config files alone (a plan needs no weights)."""
    from runtime.data.tokenizer import checkpoint_tokenizer_file
    from runtime.hf.checkpoint import read_hf_config
    from runtime.hf.files import TOKENIZER_FILES
    from runtime.inference.load import moesys_config

    path = Path(source).expanduser().resolve()
    kind = _kind(path)
    try:
        if kind == "hf":
            model = read_hf_config(path)[0]
            tokenizer = path / TOKENIZER_FILE if (path / TOKENIZER_FILE).is_file() else None
            others = [name for name in TOKENIZER_FILES[:7] if (path / name).is_file()]
            if tokenizer is None and others:
                raise UserError(f"{path} has a tokenizer ({others[0]}) but no {TOKENIZER_FILE}, which moesys reads; "
                                f"write one (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)) or set "
                                "train.tokenizer")
            facts = hf_facts(path)
        else:
            step, cfg = moesys_config(path)
            model, tokenizer = cfg.model, checkpoint_tokenizer_file(path, step)
            facts = checkpoint_facts(path, step)
    except UserError as exc:
        raise UserError(f"{KEY}={source}: {exc}") from None
    return InitialModel(path, kind, model, tokenizer, facts)


def apply_init_from(cfg: MoesysConfig, explicit: Iterable[str]) -> InitialModel | None:
    """Give `cfg` the model section (and tokenizer) of train.init_from, or of the checkpoint the run resumes from
    when its run directory holds one. `explicit`: the dotted keys the user set on the command line; the recipe's
    and the defaults' model.* give way, an explicit one the weights do not fix applies, one they fix must agree
    (ConfigError naming both values). Returns the source described, None without train.init_from."""
    if not cfg.train.init_from:
        return None
    explicit = set(explicit)
    if "model" in explicit:
        raise ConfigError(f"model=GROUP and {KEY} both choose the model; drop model=... (the model comes from "
                          f"{cfg.train.init_from})")
    resumed = chosen_checkpoint(cfg) if cfg.train.run_dir else None
    source = describe(resumed if resumed is not None else cfg.train.init_from)
    model = dataclasses.replace(source.model)
    for dotted in sorted(k for k in explicit if k.startswith("model.")):
        key = dotted.removeprefix("model.")
        ours, theirs = getattr(cfg.model, key), getattr(model, key)
        if key in WEIGHT_FREE_KEYS or (key == "max_seq_len" and model.position == "rope"):
            setattr(model, key, ours)
        elif ours != theirs:
            raise ConfigError(f"{dotted}={ours!r} contradicts {KEY}={cfg.train.init_from}, whose weights have "
                              f"{key}={theirs!r}; drop the override (the model comes from the checkpoint)")
    cfg.model = model
    if source.tokenizer is not None and "train.tokenizer" not in explicit:
        cfg.train.tokenizer = str(source.tokenizer)
    return source


def record_source_facts(cfg: MoesysConfig) -> GenerationFacts | None:
    """What `moesys train` records in the run directory when the run starts afresh (no checkpoint to resume): the
    generation facts of train.init_from's model, the chat template only where the run trains with another tokenizer
    than the source's (its ids and tokens would be another vocabulary's); none without train.init_from. A resumed run
    keeps what it recorded. Returns what the run now keeps."""
    from runtime.data.tokenizer import BYTES

    run_dir = run_dir_of(cfg)
    if chosen_checkpoint(cfg) is not None:
        return recorded_facts(run_dir)
    facts = None
    if cfg.train.init_from:
        source = describe(cfg.train.init_from)
        facts = source.facts
        ours = cfg.train.tokenizer
        same = source.tokenizer is not None and ours != BYTES and \
            Path(ours).expanduser().resolve() == source.tokenizer.resolve()
        if facts is not None and not same:
            facts = GenerationFacts(facts.chat_template) if facts.chat_template is not None else None
    write_facts(run_dir, facts)
    return facts


class InitialWeights:
    """The tensors of train.init_from by checkpoint key (`model.NAME`, `model.NAME.G` for global expert G), each read
    when asked: a view of the mapped file where the layouts agree, else one tensor's converted copy."""

    def __init__(self, source: str | Path):
        from runtime.hf.checkpoint import HFCheckpoint
        from runtime.inference.load import read_moesys

        self.path = Path(source).expanduser().resolve()
        self.files: HFCheckpoint | TensorFiles
        if _kind(self.path) == "hf":
            self.files = HFCheckpoint(self.path)
        else:
            self.files = read_moesys(self.path).files

    def tensor(self, name: str, expert: int | None, shape: tuple[int, ...]) -> Tensor:
        """Parameter `name` (global expert `expert`'s row of it), checked to have `shape`."""
        key = tensor_key(MODEL, name, expert)
        if key not in self.files:
            raise missing_tensor(self.path, key)
        value = self.files.get(key)
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"{KEY}={self.path}: {key} has shape {tuple(value.shape)}, the model expects "
                                  f"{tuple(shape)}")
        return value

    def copy_into(self, model: nn.Module) -> None:
        """Fill every materialized parameter of `model` (this rank's part), one tensor or one expert at a time."""
        from runtime.model.init import copy_weights

        copy_weights(model, lambda name, expert, shape: self.tensor(name, expert, shape))

    def expert(self, prefix: str, shapes: dict[str, tuple[int, ...]], expert: int) -> dict[str, Tensor]:
        """Global expert `expert`'s fp32 tensors of the experts module `prefix`, for its offloaded home."""
        return {name: self.tensor(f"{prefix}.{name}", expert, shape).to(torch.float32)
                for name, shape in shapes.items()}

    def close(self) -> None:
        self.files.close()
