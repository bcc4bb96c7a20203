"""The HTTP surface of `moesys serve` (a Starlette ASGI app): POST /v1/completions in OpenAI's shape, plain or
streamed as server-sent events, and GET /health. Requests are checked here and handed to the generation worker;
every refusal is a 4xx/5xx with OpenAI's error object."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.errors import UserError
from runtime.serving.protocol import (RequestError, TextStream, chunk_body, completion_body, error_body,
                                      parse_completion, parse_json, sse)
from runtime.serving.service import Service
from runtime.serving.worker import Job, WorkerDied

log = logging.getLogger("moesys.serve")
MAX_BODY_BYTES = 16 << 20
"""A request body larger than this is refused (413) before it is read: a prompt longer than any context is far
smaller."""
BODY_TIMEOUT_S = 60.0
"""A client that takes longer to send its request body is refused (408)."""
POLL_S = 1.0
"""How often a request waiting for its answer checks that the generation worker is still running."""


def _error(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None) -> Response:
    return JSONResponse(error_body(message, kind, param), status_code=status)


def _refusal(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(status, OpenAI error body) for an error the worker or the request raised."""
    if isinstance(exc, RequestError):
        return exc.status, error_body(str(exc), exc.kind, exc.param)
    if isinstance(exc, UserError):  # the generation refused the input
        return 400, error_body(str(exc).splitlines()[0])
    text = str(exc).strip().splitlines()
    return 500, error_body(f"generation failed: {type(exc).__name__}: {text[0] if text else ''}", "server_error")


def build_app(service: Service) -> Starlette:
    """The ASGI app serving `service`."""
    model = service.config.model

    async def completions(request: Request) -> Response:
        try:
            body = parse_json(await asyncio.wait_for(_read_body(request), BODY_TIMEOUT_S))
            completion = parse_completion(body, service.defaults, service.tokenizer, model.vocab_size,
                                          model.max_seq_len)
        except RequestError as exc:
            return _error(exc.status, str(exc), exc.kind, exc.param)
        except ClientDisconnect:  # left while sending its request
            return _error(499, "the client closed the connection")
        except asyncio.TimeoutError:
            return _error(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s")
        name = body.get("model") or service.name
        request_id = f"cmpl-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        if completion.stream:
            return _stream(service, loop, completion, request_id, name)
        answer: asyncio.Future = loop.create_future()
        job = Job(completion, finish=lambda tokens, error: loop.call_soon_threadsafe(_settle, answer, tokens, error))
        try:
            service.worker.submit(job)
        except RequestError as exc:
            return _error(exc.status, str(exc), exc.kind, exc.param)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await _answer_or_leave(service, answer, gone, service.config.serve.request_timeout_s)
        finally:
            gone.cancel()
            job.cancelled = True  # a no-op once finished; else the client left or the request timed out
            if not answer.done():
                answer.cancel()
        if answer.cancelled():
            return _error(499, "the client closed the connection")  # nobody reads it; uvicorn drops it
        if answer.exception() is not None:
            status, content = _refusal(answer.exception())
            return JSONResponse(content, status_code=status)
        tokens = answer.result()
        tok = service.tokenizer
        text = tok.decode(tokens) if tok is not None else None
        return JSONResponse(completion_body(request_id, name, tokens, text, len(completion.prompt_ids)))

    async def health(request: Request) -> Response:
        """200 while the worker takes requests; 503 once it is stopping or dead, with the same body."""
        state = service.health()
        return JSONResponse(state, status_code=200 if state["status"] == "ok" else 503)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("request failed")
        return _error(500, f"internal error: {type(exc).__name__}", "server_error")

    routes = [Route("/v1/completions", completions, methods=["POST"]), Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})


async def _read_body(request: Request) -> bytes:
    """The body, refused with 413 past MAX_BODY_BYTES (by its Content-Length, or as it arrives when chunked)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(f"the request body of {declared} bytes is larger than {MAX_BODY_BYTES} bytes", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read: what remains is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Waiting:
    """What a request waiting for the worker has to give up on, checked every POLL_S without news: a worker thread
    that ended without answering (seen on two polls in a row: its last answers may still be on their way to the
    event loop), or `timeout_s` since the last news (504; the caller cancels the job)."""

    def __init__(self, service: Service, timeout_s: float):
        self.service, self.timeout_s = service, timeout_s
        self.ended, self.since = False, time.monotonic()

    def news(self) -> None:
        self.since = time.monotonic()

    def left_s(self) -> float:
        return self.timeout_s - (time.monotonic() - self.since)

    def failure(self) -> Optional[RequestError]:
        """Why to stop waiting now, or None (then wait another POLL_S)."""
        if self.ended:
            return WorkerDied(self.service.worker.error or "its thread has ended without answering")
        if self.left_s() <= 0:
            return RequestError(f"no answer within serve.request_timeout_s={self.timeout_s:g} s; the generation was "
                                "cancelled", status=504, kind="server_error")
        self.ended = not self.service.worker.alive
        return None


async def _answer_or_leave(service: Service, answer: asyncio.Future, gone: asyncio.Future, timeout_s: float) -> None:
    """Wait for the answer or the client leaving, or fail the answer when _Waiting says to give up."""
    waiting = _Waiting(service, timeout_s)
    while not (answer.done() or gone.done()):
        await asyncio.wait((answer, gone), timeout=max(0.0, min(POLL_S, waiting.left_s())),
                           return_when=asyncio.FIRST_COMPLETED)
        if not (answer.done() or gone.done()) and (failure := waiting.failure()) is not None:
            answer.set_exception(failure)


def _settle(answer: asyncio.Future, tokens: Optional[list[int]], error: Optional[BaseException]) -> None:
    if answer.done():  # the request was cancelled meanwhile
        return
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(tokens)


def _stream(service: Service, loop: asyncio.AbstractEventLoop, completion, request_id: str, name: str) -> Response:
    """Queue the job first (a full queue is a 503, not a broken stream), then stream one chunk per token."""
    events: asyncio.Queue = asyncio.Queue()
    job = Job(completion,
              finish=lambda tokens, error: loop.call_soon_threadsafe(events.put_nowait, (None, error)),
              on_tokens=lambda ids: loop.call_soon_threadsafe(events.put_nowait, (ids, None)))
    try:
        service.worker.submit(job)
    except RequestError as exc:
        return _error(exc.status, str(exc), exc.kind, exc.param)
    tok = service.tokenizer
    text = TextStream(tok) if tok is not None else None

    async def chunks():
        waiting = _Waiting(service, service.config.serve.request_timeout_s)  # a stream's news: each token
        try:
            while True:
                try:
                    ids, error = await asyncio.wait_for(events.get(), POLL_S)
                    waiting.news()
                except asyncio.TimeoutError:
                    ids, error = None, waiting.failure()
                    if error is None:
                        continue
                if ids is not None:
                    yield sse(chunk_body(request_id, name, ids, text.push(ids) if text else None))
                    continue
                if error is not None:
                    yield sse(_refusal(error)[1])
                else:
                    rest = text.push([], final=True) if text else None
                    yield sse(chunk_body(request_id, name, [], rest, finish_reason="length"))
                yield sse("[DONE]")
                return
        finally:
            job.cancelled = True  # a no-op once finished; stops the generation when the client went away

    return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
