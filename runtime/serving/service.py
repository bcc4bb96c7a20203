"""One served model: a checkpoint opened and placed exactly as `moesys infer` does (same loader, same offload
modes), its resolved config, and the generation worker that owns it."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from runtime.config import MoesysConfig
from runtime.inference.decode import compile_default
from runtime.inference.generate import infer_sampling
from runtime.inference.load import LoadedModel, resolve_infer_config
from runtime.inference.offload import Offloader
from runtime.inference.offloaders import Opened, open_for_inference
from runtime.serving.metrics import ServeMetrics
from runtime.serving.protocol import Defaults
from runtime.serving.worker import GenerationWorker

log = logging.getLogger("moesys.serve")
T = TypeVar("T")


def resolve_serve_config(config_data: dict[str, Any], infer_overrides: dict[str, Any],
                         serve_overrides: dict[str, Any]) -> MoesysConfig:
    """The checkpoint's config with `serve.*` then `infer.*` overrides applied and validated."""
    data = json.loads(json.dumps(config_data))
    data.setdefault("serve", {}).update(serve_overrides)
    return resolve_infer_config(data, infer_overrides)


@dataclass
class Service:
    """What the HTTP layer serves: model name, config, tokenizer (None: token-id prompts only) and the worker."""

    name: str
    config: MoesysConfig
    loaded: LoadedModel
    offloader: Offloader
    worker: GenerationWorker
    device: torch.device
    metrics: ServeMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServeMetrics(lambda: self.worker.queued, lambda: self.worker.running)

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def defaults(self) -> Defaults:
        inf = self.config.infer
        return Defaults(inf.max_new_tokens, infer_sampling(inf), inf.seed, self.config.serve.max_sequences_per_request)

    def health(self) -> dict[str, Any]:
        """status: the worker's state ('ok' while it takes requests; 'dead' with an `error`), the model and counters."""
        w = self.worker
        return {"status": w.state, "error": w.error, "model": self.name, "kind": self.loaded.kind,
                "device": str(self.device),
                "offload": self.config.infer.offload, "context": self.config.model.max_seq_len,
                "max_batch_size": w.max_batch_size, "queued": w.queued, "running": w.running,
                "completed": w.completed, "failed": w.failed, "cancelled": w.cancelled, "batches": w.batches}

    def close(self) -> None:
        """Stop the worker (what is still queued is refused; the batch in hand gets serve.drain_timeout_s to finish,
        then is cancelled) and release the offloader, unless the worker thread still uses it."""
        if self.worker.stop(self.config.serve.drain_timeout_s):
            self.offloader.close()
        else:
            log.warning("the generation thread did not stop within 2 x serve.drain_timeout_s=%gs; its offloader "
                        "is left open", self.config.serve.drain_timeout_s)


def on_passing_thread(fn: Callable[[], T]) -> T:
    """fn() on a thread that ends when fn returns; its result, or its exception raised here. The thread that runs
    torch's parallel regions keeps a team of OpenMP workers until it ends: a team kept by this thread beside the
    generation worker's would make more OpenMP threads than cores, and libgomp then puts its workers to sleep
    between parallel regions, a wake-up for each of a decode step's hundreds of operators."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="moesys-open", daemon=True)  # Ctrl-C while opening ends the process
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def open_service(checkpoint: str | Path, infer_overrides: dict[str, Any] | None = None,
                 serve_overrides: dict[str, Any] | None = None, offload: str | None = None,
                 device: str | torch.device | None = None, cache_dir: Path | None = None) -> Service:
    """Open and place a checkpoint as `run_inference` does (offload overrides infer.offload), and start its worker.
    Requests default to the checkpoint's infer.max_new_tokens, sampling settings and seed. The opening runs on a
    thread of its own (`on_passing_thread`): from then on the worker's thread is the only one that computes."""
    def open_and_place() -> tuple[Opened, Offloader]:
        opened = open_for_inference(
            checkpoint, lambda data, overrides: resolve_serve_config(data, overrides, dict(serve_overrides or {})),
            infer_overrides, offload, device)
        return opened, opened.place(cache_dir)

    opened, offloader = on_passing_thread(open_and_place)
    loaded, cfg, device = opened.loaded, opened.cfg, opened.device
    compile = compile_default(device) if cfg.infer.compile is None else cfg.infer.compile
    worker = GenerationWorker(loaded.model, offloader, cfg.serve.max_batch_size, cfg.serve.max_queue,
                              stuck_after_s=cfg.serve.request_timeout_s, compile=compile)
    return Service(loaded.path.resolve().name, cfg, loaded, offloader, worker, device)
