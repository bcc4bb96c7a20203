"""The run directory's files: the resolved config, metrics.jsonl and the ranks' memory records, the summary, the
lock of the job running there and a worker's fatal verdict (their names: runtime/files/paths.py)."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import yaml

from runtime.config import ConfigError, MoesysConfig, config_from_dict
from runtime.errors import UserError
from runtime.files.paths import (
    CONFIG,
    FATAL,
    LOCK,
    LOGS,
    MEMORY_DIR,
    METRICS,
    MODEL_FILES,
    RUN_MARKS,
    RUN_WRITES,
    SUMMARY,
)
from runtime.host.io import atomic_write_text


def model_files(path: Path) -> list[str]:
    """The names at the top of `path` that only a model directory holds (its config.json or meta.json, its
    safetensors files), sorted; empty for a run directory, or when `path` cannot be listed."""
    try:
        names = sorted(p.name for p in Path(path).iterdir())
    except OSError:
        return []
    return [n for n in names if n in MODEL_FILES or n.endswith(".safetensors")]


def has_run_config(path: str | Path) -> bool:
    """Whether `path` holds the config.yaml `moesys train` writes first into a run directory: a mapping with the
    model and train sections (another tool's config.yaml is not one)."""
    try:
        data = yaml.safe_load((Path(path) / CONFIG).read_text(errors="replace"))
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and isinstance(data.get("model"), dict) and isinstance(data.get("train"), dict)


def is_run_dir(path: str | Path) -> bool:
    """Whether `path` is a moesys run directory: the config.yaml `moesys train` writes, with its logs, checkpoints or
    metrics beside it, and no model files of its own (a moesys export also holds a config.yaml)."""
    path = Path(path)
    return has_run_config(path) and any((path / m).exists() for m in RUN_MARKS) and not model_files(path)


def check_run_dir(path: str | Path) -> None:
    """Refuse, before anything is written, a train.run_dir that exists and is not a run directory but holds a model
    or a config (a moesys export, a Hugging Face model: training there would replace its config.yaml and mix a run
    into the model), or files of the names moesys writes there that moesys did not write (another tool's metrics
    or checkpoints: the run would append to them). A new, empty or unrelated directory, or a run directory (a
    resume, or another node of a multinode job meeting node 0's), is fine."""
    path = Path(path)
    if not path.is_dir() or is_run_dir(path):
        return
    found = model_files(path) + ([CONFIG] if (path / CONFIG).exists() else [])
    if found:
        raise UserError(f"train.run_dir={path} holds a model or a config ({', '.join(sorted(found))}) and is not a "
                        "moesys run directory; training there would overwrite it: choose a new train.run_dir")
    foreign = [name + ("/" if (path / name).is_dir() else "") for name in RUN_WRITES if (path / name).exists()]
    if foreign and not has_run_config(path):
        raise UserError(f"train.run_dir={path} holds {', '.join(foreign)} that moesys did not write (no {CONFIG} of a "
                        "moesys run); training there would write into them: choose a new train.run_dir")


def run_dir_unwritable(run_dir: Path, exc: OSError) -> UserError:
    """A run directory that cannot be made or written, as the one line naming train.run_dir."""
    return UserError(f"cannot write the run directory {run_dir}: {exc.strerror or exc}; set train.run_dir to a "
                     "directory you can write")


def save_config(cfg: MoesysConfig, path: Path) -> None:
    atomic_write_text(path, yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


def load_config(run_dir: str | Path) -> MoesysConfig:
    """The resolved config a run directory holds; a config.yaml that is not a moesys config (another tool's, a
    damaged one) is a UserError naming the file."""
    path = Path(run_dir) / CONFIG
    try:
        data = yaml.safe_load(path.read_text(errors="replace"))
        if not isinstance(data, dict):
            raise ConfigError(f"it holds a {type(data).__name__}, not a moesys config")
        return config_from_dict(data)
    except (ConfigError, yaml.YAMLError) as exc:
        reason = " ".join(str(exc).split())
        raise ConfigError(f"{path} is not a moesys run's config ({reason}); pass the train.run_dir of a moesys "
                          "train run") from None


def create_run_dir(cfg: MoesysConfig, run_dir: Path) -> None:
    """Make `run_dir` and write the resolved config the workers read, then its logs/: the config comes first, so a
    directory holding moesys's files always holds the config that marks it a run (check_run_dir). A directory that
    cannot be made or written is a UserError naming train.run_dir."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / CONFIG)
        (run_dir / LOGS).mkdir(exist_ok=True)
    except OSError as exc:
        raise run_dir_unwritable(run_dir, exc) from None


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every complete record (JSON object) of metrics.jsonl; a line being written, or torn by a kill mid-write,
    is skipped. MetricsWriter reads the file through this on resume."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def last_step_metrics(run_dir: str | Path, tail_bytes: int = 1 << 20) -> dict | None:
    """The newest complete step line of metrics.jsonl, reading only the file's tail (a progress display polls
    this twice a second; re-reading the whole file would grow with the run)."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return None
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, 2) - tail_bytes))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            return record
    return None


def run_summary(run_dir: str | Path) -> dict:
    """The `moesys train --json` summary: losses from metrics, steady-state speed, the newest checkpoint, the last
    held-out loss and perplexity (train.eval_data; None without)."""
    run_dir = Path(run_dir)
    metrics = [m for m in read_metrics(run_dir) if "loss" in m]
    summary_file = run_dir / SUMMARY
    worker = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    steady = sorted(m["tokens_per_s"] for m in metrics[1:]) or [m["tokens_per_s"] for m in metrics]
    evaluated = [m for m in metrics if "eval_loss" in m]
    return {
        "run_dir": str(run_dir),
        "steps": metrics[-1]["step"] if metrics else 0,
        "initial_loss": metrics[0]["loss"] if metrics else None,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "tokens_per_s": steady[len(steady) // 2] if steady else None,
        "checkpoint": worker.get("checkpoint"),
        "stopped_early": worker.get("stopped_early", False),
        "eval_loss": evaluated[-1]["eval_loss"] if evaluated else None,
        "eval_perplexity": evaluated[-1]["eval_perplexity"] if evaluated else None,
    }


class RunLock:
    """An exclusive lock on RUN_DIR/.lock (flock) while a job runs there; the OS drops it when its holder exits or
    is killed, so a stale lock never blocks a resume. The nodes of a multi-node job (one `moesys train` per node,
    possibly on one shared filesystem) each lock their own file."""

    def __init__(self, run_dir: Path, node_rank: int = 0):
        path = Path(run_dir) / (LOCK if node_rank == 0 else f"{LOCK}-node{node_rank}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a+")
        except OSError as exc:
            raise run_dir_unwritable(run_dir, exc) from None
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise UserError(f"run directory {run_dir} is in use by another moesys train ({holder}); wait for it "
                            "to finish or choose another train.run_dir") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        self._file.close()


def _fatal_files(run_dir: Path) -> list[Path]:
    """RUN_DIR/fatal_error.txt, then where a verdict goes when the run directory cannot take it (a full or read-only
    filesystem): a file of this user's in the machine's temporary directory, named after the run directory."""
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return [Path(run_dir) / FATAL, Path(tempfile.gettempdir()) / f"moesys-{os.getuid()}-fatal-{digest}.txt"]


def record_fatal(run_dir: Path, exit_code: int, message: str) -> bool:
    """A worker met an error that a restart would meet again: write it once (the first rank's wins), so restarted
    workers stop at once and the CLI reports it instead of torchrun's retries. Returns whether a verdict is
    recorded (False when neither place could be written)."""
    if read_fatal(run_dir) is not None:
        return True
    for path in _fatal_files(run_dir):
        try:
            atomic_write_text(path, f"{exit_code}\n{message}\n")
            return True
        except OSError:
            continue
    return False


def read_fatal(run_dir: Path) -> tuple[int, str] | None:
    """(exit code, one-line message) recorded by record_fatal, or None."""
    in_run, fallback = _fatal_files(run_dir)
    for path in (in_run, fallback):
        try:
            if path == fallback and path.stat().st_uid != os.getuid():  # a directory everyone writes: ours only
                continue
            code, _, message = path.read_text().partition("\n")
            return int(code), message.strip()
        except (OSError, ValueError):
            continue
    return None


def clear_fatal(run_dir: Path) -> None:
    """A new launch in the directory (the user fixed the cause) starts without the old verdict."""
    for path in _fatal_files(run_dir):
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            pass


def task_samples_per_s(rank_lines: Iterable[dict]) -> dict[str, float]:
    """Each task's samples per second in one step of a multi-task run: the sum over its ranks of the rank's samples
    of the task over the rank's compute time (metrics.jsonl's per-rank lines of that step)."""
    speeds: dict[str, float] = {}
    for line in rank_lines:
        if "task" in line and line.get("compute_s"):
            speeds[line["task"]] = speeds.get(line["task"], 0.0) + line["samples"] / line["compute_s"]
    return speeds


def read_rank_memory(run_dir: Path) -> list[dict]:
    """Every rank's last written memory record (RUN_DIR/memory/rank<R>.json, any order); unreadable files are
    skipped."""
    out = []
    for path in sorted((Path(run_dir) / MEMORY_DIR).glob("rank*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def clear_rank_memory(run_dir: Path) -> None:
    """A new launch starts without the records of an earlier one (a rank that dies early leaves none)."""
    for path in (Path(run_dir) / MEMORY_DIR).glob("rank*.json"):
        path.unlink(missing_ok=True)
