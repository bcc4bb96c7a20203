"""`moesys export`: a training checkpoint fused into one servable model (the paper's "Graph Optimization", its
inference pipeline figure).

The checkpoint's model tensors are already keyed by global name and global expert index whatever the expert-
parallel size, dense sharding or embedding partition of the run, so fusing is a streamed copy: each tensor is read
from the checkpoint's memory map and written into the output, one at a time (the model need not fit in memory),
leaving out optimizer moments, step counts and RNG states. Output files are bounded by export.max_shard_gb and
carry checksums; the directory is written under a temporary name and renamed when complete, with the mode mkdir
would give it (readable by whoever may read its parent, e.g. a serving user). Both formats carry the checkpoint's
tokenizer.json.

- moesys format: config.yaml + meta.json + model safetensors under the checkpoint's own keys, so `moesys infer`
  and `moesys serve` read it as they read a run.
- hf format: the Hugging Face Mixtral layout (config.json, model.safetensors or shards with an index, and
  tokenizer_config.json), so transformers loads the model and AutoTokenizer the tokenizer; models that are not
  Mixtral-style are refused before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
import yaml

from runtime.files.checkpoint_format import FILES, MODEL, STATE_KEYS, missing_tensor, tensor_key
from runtime.config import MoesysConfig, config_to_dict
from runtime.errors import UserError
from runtime.inference.hf_mixtral import INDEX, config_to_hf, hf_tensor_names
from runtime.inference.load import MoesysCheckpoint, read_moesys
from runtime.io import (atomic_write_json, atomic_write_text, fsync_dir, new_dir_mode, remove_stale_temps,
                       temp_prefix)
from runtime.model.transformer import Transformer
from runtime.plan.disk import check_free
from runtime.moe.layer import is_expert_param
from runtime.files.tensorfile import write_tensors
from runtime.files.paths import HF_TOKENIZER_CONFIG, META, TOKENIZER_FILE
from runtime.data.tokenizer import checkpoint_tokenizer, hf_tokenizer_config
from runtime.model.precision import PRECISION_DTYPES

FORMATS = ("moesys", "hf")


class ExportError(UserError):
    """An export that cannot be written (output exists, model not of the requested family)."""


@dataclass(frozen=True)
class Entry:
    """One output tensor: its name in the export and its key in the checkpoint."""

    name: str
    key: str


def _entries(cfg: MoesysConfig, fmt: str) -> list[Entry]:
    """Every model tensor in output order: dense weights, then each MoE layer's router and experts."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    params = dict(model.named_parameters())
    if fmt == "moesys":
        out = []
        for name, p in params.items():
            if is_expert_param(name):
                out += [Entry(tensor_key(MODEL, name, g), tensor_key(MODEL, name, g)) for g in range(p.shape[0])]
            else:
                out.append(Entry(tensor_key(MODEL, name), tensor_key(MODEL, name)))
        return out
    return [Entry(hf, tensor_key(MODEL, ours, j)) for hf, ours, j in hf_tensor_names(cfg.model)]


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


def export_checkpoint(checkpoint: str | Path, out: str | Path, fmt: str = "moesys", dtype: Optional[str] = None,
                      max_shard_gb: float = 5.0) -> dict:
    """Write the checkpoint's model as one model in `out` (which must not exist or be empty); a summary dict."""
    if fmt not in FORMATS:
        raise ExportError(f"export.format={fmt!r} is not one of {', '.join(FORMATS)}")
    source = read_moesys(Path(checkpoint).expanduser())
    try:
        return _export(source, out, fmt, PRECISION_DTYPES[dtype] if dtype else None, max_shard_gb)
    finally:
        source.files.close()  # done with the checkpoint: its maps go once the last view is dropped


def _export(source: MoesysCheckpoint, out: str | Path, fmt: str, to_dtype: Optional[torch.dtype],
            max_shard_gb: float) -> dict:
    cfg, files = source.config, source.files
    if fmt == "hf":
        try:
            hf_config = config_to_hf(cfg.model, to_dtype or files.get(tensor_key(MODEL, "tok_embeddings.weight")).dtype)
        except UserError as exc:
            raise ExportError(f"export.format=hf: {exc}; use export.format=moesys") from None
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"out={out} already exists and is not empty; choose a new directory")
    entries = _entries(cfg, fmt)
    missing = [e.key for e in entries if e.key not in files]
    if missing:
        raise missing_tensor(source.step_dir, missing[0])
    itemsize = {e.key: (to_dtype or files.get(e.key).dtype).itemsize for e in entries}
    nbytes = {e.key: files.nbytes(e.key) // files.get(e.key).element_size() * itemsize[e.key] for e in entries}
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
        names = _write_shards(tmp, shards, files, to_dtype, fmt)
        if len(shards) > 1:
            weight_map = {e.name: name for name, shard in zip(names, shards) for e in shard}
            atomic_write_json(tmp / INDEX, {"metadata": {"total_size": sum(nbytes.values())},
                                            "weight_map": weight_map})
        tokenizer = checkpoint_tokenizer(source.step_dir, source.step_dir, cfg)
        if tokenizer is not None:  # the export carries the tokenizer the model was trained with
            atomic_write_text(tmp / TOKENIZER_FILE, tokenizer.to_str())
        if fmt == "hf":
            atomic_write_json(tmp / "config.json", hf_config)
            if tokenizer is not None:
                atomic_write_json(tmp / HF_TOKENIZER_CONFIG, hf_tokenizer_config(cfg.model.max_seq_len))
        else:
            atomic_write_text(tmp / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
            atomic_write_json(tmp / META, {"step": _step(source.step_dir), "exported_from":
                                                  str(source.step_dir.resolve()), "format": "moesys-export",
                                                  FILES: names})
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
    return {"checkpoint": str(source.step_dir), "out": str(out), "format": fmt, "files": names,
            "tensors": len(entries), "bytes": sum(nbytes.values()),
            "tokenizer": TOKENIZER_FILE if tokenizer is not None else None,
            "checkpoint_bytes": sum(f.stat().st_size for f in source.step_dir.glob("*.safetensors")),
            "optimizer_state": any(key.startswith(f"{STATE_KEYS[0]}.") for key in files.where)}


def _unwritable(out: Path, exc: OSError) -> ExportError:
    return ExportError(f"cannot write out={out} ({exc.strerror or exc}); nothing was left there: make room, or "
                       "choose another out=")


def _write_shards(directory: Path, shards: list[list[Entry]], files, to_dtype: Optional[torch.dtype],
                  fmt: str) -> list[str]:
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it

    def tensor(e: Entry) -> torch.Tensor:
        t = files.get(e.key)
        return t.to(to_dtype) if to_dtype is not None else t

    for name, shard in zip(names, shards):
        specs = {}
        for e in shard:
            t = files.get(e.key)
            specs[e.name] = (to_dtype or t.dtype, tuple(t.shape))
        stream: Iterator = ((e.name, tensor(e)) for e in shard)
        write_tensors(directory / name, specs, stream, metadata)
    return names


def _step(step_dir: Path) -> Optional[int]:
    try:
        return json.loads((step_dir / META).read_text()).get("step")
    except (OSError, ValueError):
        return None
