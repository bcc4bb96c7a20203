"""`moesys serve`: one checkpoint behind an OpenAI-compatible HTTP completions endpoint, its experts placed by the
same offload modes as `moesys infer` (the paper's request/response deployment, "Graph Optimization")."""

from __future__ import annotations

import logging
import sys
from typing import Annotated, Any

import typer

from moesys_cli.infer import Offload
from moesys_cli.options import required, split_args
from moesys_cli.render import console, literal
from runtime.config import config_from_dict

ServeArgs = Annotated[
    list[str] | None,
    typer.Argument(help="checkpoint=DIR, then infer.* overrides (a request's defaults and the expert placement, "
                        "e.g. infer.max_new_tokens=64 infer.ring_slots=2) and serve.* overrides (e.g. "
                        "serve.max_batch_size=8)", show_default=False),
]
Host = Annotated[str | None, typer.Option("--host", help="Address to listen on (overrides serve.host).",
                                             show_default=False)]
Port = Annotated[int | None, typer.Option("--port", help="TCP port (overrides serve.port); 0 picks a free one.",
                                             show_default=False)]
USAGE = "moesys serve takes checkpoint=DIR, infer.KEY=VALUE and serve.KEY=VALUE"


def parse_serve_args(args: list[str]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(checkpoint, infer.* overrides, serve.* overrides); values are YAML scalars."""
    values, overrides = split_args(args, USAGE, ("checkpoint",), ("infer", "serve"))
    return required(values, "checkpoint", USAGE), overrides["infer"], overrides["serve"]


def _log_requests() -> None:
    """One line per request on stderr (runtime/serving/metrics.py writes them)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger = logging.getLogger("moesys.serve.requests")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def serve(args: ServeArgs = None, offload: Offload = None, host: Host = None, port: Port = None) -> None:
    """Serve POST /v1/completions (one prompt or a list, as text or token ids; max_tokens, temperature, top_k, top_p,
    presence/frequency_penalty, logit_bias, seed, stream, stream_options, n, best_of, stop, logprobs, echo, user),
    POST /v1/chat/completions, GET /v1/models, /metrics and /health, and vLLM's GET /tokenizer_info, POST /tokenize
    and /detokenize, until SIGTERM or Ctrl-C, which let the requests in flight finish and exit 0. Each request is
    one log line on stderr, with the reason of a refusal."""
    checkpoint, infer_overrides, serve_overrides = parse_serve_args(args or [])
    if host is not None:
        serve_overrides["host"] = host
    if port is not None:
        serve_overrides["port"] = port
    config_from_dict({"infer": infer_overrides, "serve": serve_overrides})  # bad keys refused before loading
    from runtime.serving.server import serve as run_server  # torch: loaded only by verbs that compute
    from runtime.serving.service import open_service

    service = open_service(checkpoint, infer_overrides, serve_overrides, offload)
    _log_requests()
    described = (f"model {literal(service.name)} ({service.loaded.kind}), --offload {service.config.infer.offload} on "
                 f"{service.device}, context {service.config.model.max_seq_len} tokens, "
                 f"max batch {service.worker.max_batch_size}")

    def listening(url: str) -> None:
        console.print(f"[bold]moesys serve[/] listening on {url} ({described}); POST {url}/v1/completions, "
                      f"{url}/v1/chat/completions, {url}/tokenize, {url}/detokenize; GET {url}/v1/models, "
                      f"{url}/tokenizer_info, {url}/metrics, {url}/health",
                      highlight=False, soft_wrap=True)

    run_server(service, on_listen=listening)
    w = service.worker
    console.print(f"[bold]moesys serve[/] stopped: {w.completed} requests completed, {w.cancelled} cancelled, "
                  f"{w.failed} failed", highlight=False)
