"""The rules that read more than one section, each named, and `validate`, which runs them after the sections."""

from __future__ import annotations

import importlib.util
import ipaddress
import math
from collections.abc import Callable

from runtime.config.checks import ConfigError, Problems
from runtime.config.schema import MoesysConfig


def resolve_auto(cfg: MoesysConfig) -> None:
    """Replace values left to moesys (stored as 0) by what they mean for this config; runs before validate()."""
    t, experts = cfg.topology, cfg.model.num_experts
    if t.expert_parallel == 0:
        t.expert_parallel = math.gcd(t.world_size, experts) if experts > 0 and t.world_size > 0 else 1


BYTE_VOCAB = 256
"""The bytes of moesys's byte-level tokenizer (runtime/data/tokenizer.py): the smallest vocabulary it can train; its
special tokens (eos, the chat markers) take the next 3 ids where the vocabulary has them."""


# ---- cross-section rules: each reads more than one section and returns its messages ----

def experts_split_over_ranks(cfg: MoesysConfig) -> list[str]:
    """Each expert-parallel rank holds the same number of whole experts."""
    experts, ep = cfg.model.num_experts, cfg.topology.expert_parallel
    if ep > 0 and experts > 0 and experts % ep:
        return [f"model.num_experts={experts} is not divisible by topology.expert_parallel={ep}"]
    return []


def resident_layers_leave_some_offloaded(cfg: MoesysConfig) -> list[str]:
    """storage.resident_layers keeps fewer MoE layers on the device than the model has (all of them is offload=none)."""
    resident, moe = cfg.storage.resident_layers or 0, cfg.model.num_moe_layers
    if resident and resident >= moe:
        return [f"storage.resident_layers={resident} keeps every one of the model's {moe} MoE layers on the device; "
                f"set it below {moe}, or storage.offload=none"]
    return []


def node_rank_in_range(cfg: MoesysConfig) -> list[str]:
    """A multinode launch's node rank names one of topology.nodes."""
    rank, nodes = cfg.launcher.node_rank, cfg.topology.nodes
    if cfg.launcher.name == "multinode" and nodes > 0 and not 0 <= rank < nodes:
        return [f"launcher.node_rank={rank} must be in 0..{nodes - 1} (topology.nodes={nodes})"]
    return []


def endpoint_reachable(cfg: MoesysConfig) -> list[str]:
    """launcher.rdzv_endpoint is host:port (an IPv6 host in brackets), and, for several nodes, not a loopback
    address: the other nodes would connect to themselves."""
    if cfg.launcher.name != "multinode":
        return []
    endpoint, nodes = cfg.launcher.rdzv_endpoint, cfg.topology.nodes
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


def hierarchical_spans_nodes(cfg: MoesysConfig) -> list[str]:
    """Hierarchical AlltoAll over more ranks than a node needs expert groups made of whole nodes."""
    t = cfg.topology
    per_node = cfg.parallel.ranks_per_node or t.processes_per_node
    if cfg.parallel.alltoall == "hierarchical" and 0 < per_node < t.expert_parallel and t.expert_parallel % per_node:
        return [f"parallel.alltoall=hierarchical needs topology.expert_parallel={t.expert_parallel} to span whole "
                f"nodes (a multiple of the {per_node} ranks per node); use parallel.alltoall=flat"]
    return []


def embedding_columns_split(cfg: MoesysConfig) -> list[str]:
    """The partitioned embedding gives every data-parallel rank the same number of columns."""
    m, t = cfg.model, cfg.topology
    if m.embedding_partition and t.nodes > 0 and t.nproc_per_node > 0 and m.hidden_size % t.world_size:
        return [f"model.embedding_partition needs model.hidden_size={m.hidden_size} divisible by the "
                f"{t.world_size} data-parallel ranks"]
    return []


def vocab_holds_bytes(cfg: MoesysConfig) -> list[str]:
    """Training on the byte tokenizer needs a vocabulary of at least its 256 byte ids."""
    vocab = cfg.model.vocab_size
    if cfg.purpose == "train" and cfg.train.tokenizer == "bytes" and vocab < BYTE_VOCAB and cfg.train.init_from:
        return [f"train.init_from={cfg.train.init_from} has no tokenizer.json and a vocabulary of {vocab} tokens, "
                f"fewer than the byte tokenizer's {BYTE_VOCAB} (train.tokenizer=bytes); set train.tokenizer to the "
                "model's tokenizer.json"]
    if cfg.purpose == "train" and cfg.train.tokenizer == "bytes" and vocab < BYTE_VOCAB:
        from runtime.data.tokenizer import SPECIAL_VOCAB  # the data package reads this one at import

        return [f"model.vocab_size={vocab} is smaller than the byte tokenizer's {BYTE_VOCAB} tokens it trains on; "
                f"set model.vocab_size>={SPECIAL_VOCAB} (the bytes, eos and the two chat markers)"]
    return []


def eval_needs_language_model(cfg: MoesysConfig) -> list[str]:
    """train.eval_data measures a language model, which a multi-task config is not."""
    if cfg.train.eval_data and cfg.tasks:
        return ["train.eval_data measures a language model, and this config has tasks (multi-task heads); set "
                "train.eval_data=null"]
    return []


def sequence_fits_model(cfg: MoesysConfig) -> list[str]:
    """Training windows fit the model's positions."""
    seq, longest = cfg.train.seq_len, cfg.model.max_seq_len
    return [f"train.seq_len={seq} exceeds model.max_seq_len={longest}"] if seq > longest else []


def distillation_student(cfg: MoesysConfig) -> list[str]:
    """A distillation sets the student's experts with student.num_experts only; without a teacher it is unset."""
    p, student, m = Problems(), cfg.student.num_experts, cfg.model
    if cfg.distill.teacher:  # that the student has fewer experts than its teacher is checked where the teacher is read
        p.need(student > 0, "student.num_experts must be set (e.g. student.num_experts=4) for a distillation")
        p.need(student <= 0 or student == m.num_experts, f"student.num_experts={student} and model.num_experts="
               f"{m.num_experts} differ: set the student's experts with student.num_experts only")
        p.need(student <= 0 or student >= m.top_k,
               f"student.num_experts={student} is below model.top_k={m.top_k}: each token needs top_k experts")
        p.need(not cfg.tasks, "moesys distill trains a language model, and this config has tasks (multi-task heads)")
    else:  # set by `moesys distill` together with distill.teacher; alone it would be ignored
        p.need(student <= 0, f"student.num_experts={student} applies to a distillation only: run moesys distill "
               f"checkpoint=TEACHER_RUN_DIR student.num_experts={student} (or set model.num_experts to train a "
               "model of that size from scratch)")
    return p


def fine_tune_has_weights(cfg: MoesysConfig) -> list[str]:
    """recipe=finetune starts from a model's weights: without train.init_from there is no model to fine-tune."""
    if cfg.recipe == "finetune" and not cfg.train.init_from:
        return ["recipe=finetune fine-tunes a model: set train.init_from=DIR (a Hugging Face model directory, or a "
                "moesys run or export)"]
    return []


def init_from_starts_a_language_model(cfg: MoesysConfig) -> list[str]:
    """train.init_from loads a language model's weights, which a distillation student (its weights come from the
    teacher) and multi-task heads (they replace the output layer) do not take."""
    if not cfg.train.init_from:
        return []
    if cfg.distill.teacher:
        return ["train.init_from and moesys distill both choose the starting weights (the student's come from the "
                "teacher); drop train.init_from"]
    if cfg.tasks:
        return ["train.init_from loads a language model, and this config has tasks (multi-task heads); set "
                "train.init_from=null"]
    return []


def freeze_applies(cfg: MoesysConfig) -> list[str]:
    """train.freeze names sets of a language model's parameters: multi-task heads replace its output layer, and a
    column-partitioned embedding is a layout for training the table."""
    freeze = cfg.train.freeze
    if freeze and cfg.tasks:
        return ["train.freeze applies to a language model, and this config has tasks (multi-task heads); set "
                "train.freeze=[]"]
    if "embeddings" in freeze and cfg.model.embedding_partition:
        return ["train.freeze=[embeddings] leaves the table as it is, and model.embedding_partition=true splits it for "
                "training it; set one of them"]
    return []


def chat_data_is_jsonl(cfg: MoesysConfig) -> list[str]:
    """train.data_format=chat reads .jsonl files of conversations, and a language model's (no tasks, no teacher)."""
    tr = cfg.train
    if tr.data_format != "chat":
        return []
    problems = [f"train.data_format=chat reads a .jsonl file of chat records; {key}={path} is not one"
                for key, path in (("train.data", tr.data), ("train.eval_data", tr.eval_data))
                if (key == "train.data" or path) and not str(path).lower().endswith(".jsonl")]
    if cfg.tasks or cfg.distill.teacher:
        problems.append("train.data_format=chat trains a language model on conversations; multi-task heads and "
                        "moesys distill read text (set train.data_format=text)")
    return problems


def step_schedule_combines(cfg: MoesysConfig) -> list[str]:
    """train.grad_accum_steps, train.recompute and train.compile with what they are built and tested with: grad
    accumulation on the language model (not multi-task heads, a distillation or sharded dense states); recompute=block
    not with offloaded experts (a block's forward again would fetch them again) and no recomputation with sharded
    dense states; compile on one expert-parallel rank, experts resident, no recomputation."""
    p, tr, st = Problems(), cfg.train, cfg.storage
    if tr.grad_accum_steps > 1:
        for on, what in ((cfg.tasks, "multi-task heads (tasks)"), (cfg.distill.teacher, "a distillation"),
                         (st.dense_shard, "storage.dense_shard=true")):
            p.need(not on, f"train.grad_accum_steps={tr.grad_accum_steps} is not built for {what}; set "
                           "train.grad_accum_steps=1 and raise train.micro_batch_size instead")
    p.need(not (tr.recompute == "block" and st.offload in ("cpu", "ssd")),
           f"train.recompute=block would fetch the offloaded experts (storage.offload={st.offload}) again in backward; "
           "use train.recompute=moe, which recomputes only their FFNs")
    p.need(tr.recompute in ("none", "auto") or not st.dense_shard,
           f"train.recompute={tr.recompute} is not built for storage.dense_shard=true (it gathers each block's "
           "weights once a forward); set train.recompute=none")
    if tr.compile:
        for on, what in ((cfg.topology.expert_parallel > 1, f"topology.expert_parallel={cfg.topology.expert_parallel} "
                                                            "(the AlltoAll dispatch reads split sizes on the host)"),
                         (st.offload in ("cpu", "ssd"), f"storage.offload={st.offload} (experts fetched as they run)"),
                         (tr.recompute not in ("none", "auto"), f"train.recompute={tr.recompute}"),
                         (st.dense_shard, "storage.dense_shard=true")):
            p.need(not on, f"train.compile=true compiles each block whole, which it cannot with {what}; set "
                           "train.compile=false")
    return p


CROSS_SECTION_RULES: tuple[Callable[[MoesysConfig], list[str]], ...] = (
    experts_split_over_ranks, node_rank_in_range, endpoint_reachable, hierarchical_spans_nodes,
    embedding_columns_split, vocab_holds_bytes, eval_needs_language_model, sequence_fits_model,
    distillation_student, resident_layers_leave_some_offloaded, init_from_starts_a_language_model,
    chat_data_is_jsonl, freeze_applies, step_schedule_combines,
)
"""The rules that read more than one section, in the order their messages are listed."""


def packages_installed(cfg: MoesysConfig) -> list[str]:
    """The optional packages the config asks for are importable."""
    if cfg.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        return ["train.tensorboard=true needs the tensorboard package, which is not installed: pip install "
                "'moesys[tensorboard]' (or set train.tensorboard=false)"]
    return []


def validate(cfg: MoesysConfig, packages: bool = True) -> None:
    """Check each section's own fields, then the cross-section rules, and raise one ConfigError that lists every
    problem. packages: also check that the optional packages the config asks for are installed; off for a config
    read back from a run or a checkpoint, which may be served or reported on a machine without them."""
    missing = fine_tune_has_weights(cfg)
    if missing:  # nothing else can be judged of a model that is not there
        raise ConfigError(missing[0])
    problems = cfg.problems()
    for rule in CROSS_SECTION_RULES + ((packages_installed,) if packages else ()):
        problems += rule(cfg)
    if problems:
        raise ConfigError("; ".join(problems))
