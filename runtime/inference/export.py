"""`moesys export`: a training checkpoint, or a Hugging Face model directory, as one servable model (the paper's
"Graph Optimization", its inference pipeline figure).

A checkpoint's model tensors are already keyed by global name and global expert index whatever the expert-parallel
size, dense sharding or embedding partition of the run, and a Hugging Face directory opens under the same keys
(runtime/hf/checkpoint.py), so exporting is a streamed copy: each tensor is read from its source's memory map and
written into the output, one at a time (the model need not fit in memory), leaving out optimizer moments, step
counts and RNG states. Output files are bounded by export.max_shard_gb and carry checksums; the directory is written
under a temporary name and renamed when complete, with the mode mkdir would give it (readable by whoever may read its
parent, e.g. a serving user).

- moesys format: config.yaml + meta.json + model safetensors under the checkpoint's own keys, so `moesys infer`
  and `moesys serve` read it as they read a run.
- hf format: the model's own family (model.family: its model_type, config keys and tensor names; moesys's own
  SwiGLU/RoPE models as Mixtral), so transformers loads it with AutoModelForCausalLM; a model its family cannot
  express is refused before anything is written.
A training checkpoint's export carries its tokenizer.json and generation facts (runtime/data/generation_facts.py: the
chat template, special tokens and stop ids of the model a fine-tuned run started from, else ChatML and moesys's
own); in hf format as a tokenizer_config.json naming the special tokens (moesys's own: eos, also the pad) and the chat
template, and a generation_config.json, so AutoTokenizer renders chat as `moesys serve` does and transformers'
`generate` stops where `moesys infer` does (a tokenizer without eos, as runs made before the special tokens, is
exported saying so: eos_token_id null, not the family's default). A Hugging Face directory's export carries the
source's tokenizer files, chat template, generation config and special token ids as they are.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from runtime.config import MoesysConfig, config_to_dict
from runtime.data.generation_facts import write_facts
from runtime.data.tokenizer import Tokenizer, checkpoint_tokenizer, hf_tokenizer_config
from runtime.errors import UserError
from runtime.files.checkpoint_format import FILES, MODEL, STATE_KEYS, missing_tensor, tensor_key
from runtime.files.paths import GENERATION_CONFIG, HF_TOKENIZER_CONFIG, META, TOKENIZER_FILE
from runtime.files.tensorfile import write_tensors
from runtime.hf.checkpoint import HFCheckpoint
from runtime.hf.files import INDEX
from runtime.hf.names import TensorName, to_hf
from runtime.hf.save import hf_config, hf_entries
from runtime.host.io import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    fsync_dir,
    new_dir_mode,
    remove_stale_temps,
    temp_prefix,
)
from runtime.inference.load import checkpoint_kind, read_moesys, served_config
from runtime.inference.mapped import TensorFiles
from runtime.model.precision import PRECISION_DTYPES
from runtime.model.transformer import Transformer
from runtime.moe.layer import is_expert_param
from runtime.plan.disk import check_free

FORMATS = ("moesys", "hf")


class ExportError(UserError):
    """An export that cannot be written (output exists, model not of the requested family)."""


@dataclass(frozen=True)
class Entry:
    """One output tensor: its name in the export, its key in the source, and its Hugging Face layout (hf format)."""

    name: str
    key: str
    hf: TensorName | None = None


@dataclass
class Source:
    """What an export reads: the model's config and its tensors by checkpoint key (`model.NAME[.G]`)."""

    config: MoesysConfig
    tensors: TensorFiles | HFCheckpoint
    path: Path
    """The step directory, or the Hugging Face directory."""
    hf: HFCheckpoint | None = None
    """The Hugging Face directory's checkpoint, when the source is one."""

    def close(self) -> None:
        self.tensors.close()  # done with the source: its maps go once the last view is dropped


def open_source(checkpoint: str | Path) -> Source:
    """A moesys run, step directory or export, or a Hugging Face directory of a family moesys reads."""
    path = Path(checkpoint).expanduser()
    if checkpoint_kind(path) == "moesys":
        source = read_moesys(path)
        return Source(source.config, source.files, source.step_dir)
    hf = HFCheckpoint(path)
    return Source(served_config(hf.config), hf, path, hf)


def _entries(cfg: MoesysConfig, fmt: str) -> list[Entry]:
    """Every model tensor in output order: dense weights, then each MoE layer's router and experts."""
    if fmt == "hf":
        return [Entry(e.hf, tensor_key(MODEL, e.ours, e.expert), e) for e in hf_entries(cfg.model)]
    with torch.device("meta"):
        model = Transformer(cfg.model)
    out = []
    for name, p in model.named_parameters():
        if is_expert_param(name):
            out += [Entry(tensor_key(MODEL, name, g), tensor_key(MODEL, name, g)) for g in range(p.shape[0])]
        else:
            out.append(Entry(tensor_key(MODEL, name), tensor_key(MODEL, name)))
    return out


def hf_token_ids(tokenizer: Tokenizer | None) -> tuple[dict, dict]:
    """(config.json's token ids, generation_config.json) of an export carrying `tokenizer`: its bos, eos and pad
    (moesys's own: eos, also the pad, no bos; a released model's: its own), generation ending at each of its stop
    ids; null where the tokenizer has none (transformers would otherwise take Mixtral's defaults, ids 1 and 2)."""
    ids: dict[str, int | list[int] | None]
    if tokenizer is None:
        ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
        return ids, ids

    def token_id(token: str | None) -> int | None:
        return tokenizer.token_id(token) if token is not None else None

    ids = {"bos_token_id": token_id(tokenizer.bos_token), "eos_token_id": tokenizer.eos_id,
           "pad_token_id": token_id(tokenizer.pad_token)}
    return ids, {**ids, "eos_token_id": list(tokenizer.stop_ids) or None}


def _shards(entries: list[Entry], nbytes: dict[str, int], max_bytes: int) -> list[list[Entry]]:
    """Consecutive runs of entries of at most max_bytes each (a larger tensor gets a file of its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + nbytes[e.key] > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes[e.key]
    return shards


def export_checkpoint(checkpoint: str | Path, out: str | Path, fmt: str = "moesys", dtype: str | None = None,
                      max_shard_gb: float = 5.0) -> dict:
    """Write the checkpoint's (or Hugging Face directory's) model as one model in `out` (which must not exist or be
    empty); a summary dict."""
    if fmt not in FORMATS:
        raise ExportError(f"export.format={fmt!r} is not one of {', '.join(FORMATS)}")
    source = open_source(checkpoint)
    try:
        return _export(source, out, fmt, PRECISION_DTYPES[dtype] if dtype else None, max_shard_gb)
    finally:
        source.close()


def _export(source: Source, out: str | Path, fmt: str, to_dtype: torch.dtype | None, max_shard_gb: float) -> dict:
    cfg, files = source.config, source.tensors
    if fmt == "hf":
        try:
            config_json = hf_config(cfg.model, to_dtype or files.spec(tensor_key(MODEL, "tok_embeddings.weight"))[0],
                                    source.hf.source_config if source.hf else None)
        except UserError as exc:
            raise ExportError(f"export.format=hf: {exc}; use export.format=moesys") from None
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"out={out} already exists and is not empty; choose a new directory")
    entries = _entries(cfg, fmt)
    missing = [e.key for e in entries if e.key not in files]
    if missing:
        raise missing_tensor(source.path, missing[0])
    specs = {e.key: files.spec(e.key) for e in entries}
    nbytes = {e.key: torch.Size(specs[e.key][1]).numel() * (to_dtype or specs[e.key][0]).itemsize for e in entries}
    shards = _shards(entries, nbytes, max(1, int(max_shard_gb * 1e9)))
    smaller = "" if (to_dtype or torch.float32).itemsize < 4 else ", or export.dtype=bf16 (half the bytes of fp32)"
    check_free([(out, sum(nbytes.values()), f"{len(entries)} tensors of the {fmt} export")],
               f"free space there or choose out= on a larger disk{smaller}")

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), suffix=".tmp", dir=out.parent))
    except OSError as exc:
        raise _unwritable(out, exc) from None
    try:
        os.chmod(tmp, new_dir_mode())  # mkdtemp's 0700 would lock everyone else out of the renamed model
        names = _write_shards(tmp, shards, files, to_dtype)
        if len(shards) > 1:
            weight_map = {e.name: name for name, shard in zip(names, shards, strict=True) for e in shard}
            atomic_write_json(tmp / INDEX, {"metadata": {"total_size": sum(nbytes.values())},
                                            "weight_map": weight_map})
        tokenizer, eos_token, token_ids = _write_tokenizer(tmp, source, fmt)
        if fmt == "hf":
            atomic_write_json(tmp / "config.json", {**config_json, **token_ids})
        else:
            atomic_write_text(tmp / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
            atomic_write_json(tmp / META, {"step": _step(source.path), "exported_from": str(source.path.resolve()),
                                           "format": "moesys-export", FILES: names})
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
        fsync_dir(out.parent)
        remove_stale_temps(out)  # what an export killed mid-write left beside it
    except OSError as exc:  # the checkpoint is memory-mapped already: what fails here is a write
        raise _unwritable(out, exc) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    optimizer_state = source.hf is None and isinstance(files, TensorFiles) and any(
        key.startswith(f"{STATE_KEYS[0]}.") for key in files.where)
    return {"checkpoint": str(source.path), "out": str(out), "format": fmt, "files": names,
            "tensors": len(entries), "bytes": sum(nbytes.values()), "tokenizer": tokenizer, "eos_token": eos_token,
            "checkpoint_bytes": sum(f.stat().st_size for f in source.path.glob("*.safetensors")),
            "optimizer_state": optimizer_state}


def _write_tokenizer(directory: Path, source: Source, fmt: str) -> tuple[str | None, str | None, dict]:
    """The tokenizer the export carries: (its file name, None without one; its eos token; config.json's special
    token ids, {} where the source's own are kept). A Hugging Face source's tokenizer files are copied as they are; a
    training checkpoint's tokenizer.json is written with the generation facts its tokenizer carries: in moesys format
    as the checkpoint records them, in hf format as a tokenizer_config.json for AutoTokenizer (its special tokens and
    chat template) and a generation_config.json of its stop ids."""
    if source.hf is not None:
        files = source.hf.tokenizer_files()
        for file in files:
            atomic_write_bytes(directory / file.name, file.read_bytes())
        name = TOKENIZER_FILE if any(f.name == TOKENIZER_FILE for f in files) else (files[0].name if files else None)
        return name, _named_eos(source.path / HF_TOKENIZER_CONFIG), {}
    tokenizer = checkpoint_tokenizer(source.path, source.path, source.config)
    if tokenizer is not None:
        atomic_write_text(directory / TOKENIZER_FILE, tokenizer.to_str())  # the tokenizer the model was trained with
    token_ids, generation = hf_token_ids(tokenizer)
    if fmt == "moesys" and tokenizer is not None:
        write_facts(directory, tokenizer.facts)  # its chat template and stop tokens, as the checkpoint keeps them
    if fmt == "hf":
        atomic_write_json(directory / GENERATION_CONFIG, generation)
        if tokenizer is not None:
            atomic_write_json(directory / HF_TOKENIZER_CONFIG,
                              hf_tokenizer_config(source.config.model.max_seq_len, tokenizer))
    return (TOKENIZER_FILE if tokenizer is not None else None), (tokenizer.eos_token if tokenizer else None), token_ids


def _named_eos(tokenizer_config: Path) -> str | None:
    """The eos token a Hugging Face tokenizer_config.json names (a string, or an added token's content)."""
    try:
        eos = json.loads(tokenizer_config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


def _unwritable(out: Path, exc: OSError) -> ExportError:
    return ExportError(f"cannot write out={out} ({exc.strerror or exc}); nothing was left there: make room, or "
                       "choose another out=")


def _write_shards(directory: Path, shards: list[list[Entry]], files, to_dtype: torch.dtype | None) -> list[str]:
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it

    def tensor(e: Entry) -> torch.Tensor:
        t = files.get(e.key)
        t = t if e.hf is None else to_hf(e.hf, t)
        return t.to(to_dtype) if to_dtype is not None else t

    for name, shard in zip(names, shards, strict=True):
        specs = {}
        for e in shard:
            dtype, shape = files.spec(e.key)
            specs[e.name] = (to_dtype or dtype, shape if e.hf is None else e.hf.hf_shape)
        stream: Iterator = ((e.name, tensor(e)) for e in shard)
        write_tensors(directory / name, specs, stream, metadata)
    return names


def _step(step_dir: Path) -> int | None:
    try:
        return json.loads((step_dir / META).read_text()).get("step")
    except (OSError, ValueError):
        return None
