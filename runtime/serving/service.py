"""One served model: a checkpoint opened and placed exactly as `moesys infer` does (same loader, same offload
modes), its resolved config, and the generation worker that owns it."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from runtime.config import MoesysConfig
from runtime.inference.load import LoadedModel, resolve_infer_config
from runtime.inference.offloaders import open_for_inference
from runtime.inference.offload import Offloader
from runtime.serving.metrics import ServeMetrics
from runtime.serving.protocol import Defaults
from runtime.serving.worker import GenerationWorker

log = logging.getLogger("moesys.serve")


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
    metrics: Optional[ServeMetrics] = None

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = ServeMetrics(lambda: self.worker.queued, lambda: self.worker.running)

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def defaults(self) -> Defaults:
        inf = self.config.infer
        return Defaults(inf.max_new_tokens, inf.temperature, inf.top_k, inf.seed)

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


def open_service(checkpoint: str | Path, infer_overrides: Optional[dict[str, Any]] = None,
                 serve_overrides: Optional[dict[str, Any]] = None, offload: Optional[str] = None,
                 device: Optional[str | torch.device] = None, cache_dir: Optional[Path] = None) -> Service:
    """Open and place a checkpoint as `run_inference` does (offload overrides infer.offload), and start its worker.
    Requests default to the checkpoint's infer.max_new_tokens, temperature, top_k and seed."""
    opened = open_for_inference(
        checkpoint, lambda data, overrides: resolve_serve_config(data, overrides, dict(serve_overrides or {})),
        infer_overrides, offload, device)
    loaded, cfg, device = opened.loaded, opened.cfg, opened.device
    offloader = opened.place(cache_dir)
    worker = GenerationWorker(loaded.model, offloader, cfg.serve.max_batch_size, cfg.serve.max_queue,
                              stuck_after_s=cfg.serve.request_timeout_s)
    return Service(loaded.path.resolve().name, cfg, loaded, offloader, worker, device)
