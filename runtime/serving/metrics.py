"""What `moesys serve` measures: one log line per request (id, route, status, prompt and completion tokens, time to
first token, total time; the reason of a refusal and the request's `user` when there are) and Prometheus metrics
for GET /metrics (prometheus-client, one registry per service): requests by route and status, tokens in and out,
queue depth, running sequences, latency and time-to-first-token histograms."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger("moesys.serve.requests")
BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
MAX_LOGGED_CHARS = 300
"""A logged `user` or refusal reason is cut to this many characters (JSON-quoted: the line stays one line)."""


class ServeMetrics:
    """The service's counters; `record` ends each request (its log line and its metrics)."""

    def __init__(self, queued: Callable[[], int], running: Callable[[], int]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moesys_requests", "Requests answered, by route and HTTP status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("moesys_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.completion_tokens = Counter("moesys_completion_tokens", "Tokens generated", registry=r)
        self.latency = Histogram("moesys_request_latency_seconds", "Time from request to its last byte",
                                 ["route"], buckets=BUCKETS_S, registry=r)
        self.ttft = Histogram("moesys_time_to_first_token_seconds", "Time from request to its first token",
                              ["route"], buckets=BUCKETS_S, registry=r)
        Gauge("moesys_queue_depth", "Requests waiting for a row in the decode batch",
              registry=r).set_function(queued)
        Gauge("moesys_running_sequences", "Sequences in the decode batch", registry=r).set_function(running)

    def record(self, request_id: str, route: str, status: int, prompt_tokens: int, completion_tokens: int,
               ttft_s: float | None, total_s: float, error: str | None = None,
               user: str | None = None) -> None:
        self.requests.labels(route, str(status)).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.latency.labels(route).observe(total_s)
        if ttft_s is not None:
            self.ttft.labels(route).observe(ttft_s)
        ttft = f"{1e3 * ttft_s:.1f}" if ttft_s is not None else "-"
        extra = "".join(f" {key}={json.dumps(value[:MAX_LOGGED_CHARS])}" for key, value in
                        (("user", user), ("error", error)) if value is not None)
        log.info("request id=%s route=%s status=%d prompt_tokens=%d completion_tokens=%d ttft_ms=%s total_ms=%.1f%s",
                 request_id, route, status, prompt_tokens, completion_tokens, ttft, 1e3 * total_s, extra)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
