"""The HTTP surface of `moesys serve` (a Starlette ASGI app): POST /v1/completions and /v1/chat/completions in
OpenAI's shapes, plain or streamed as server-sent events, GET /v1/models, /metrics (Prometheus) and /health, and
vLLM's tokenizer routes (GET /tokenizer_info, POST /tokenize, /detokenize). Requests are checked here and handed to
the generation worker; every refusal is a 4xx/5xx with OpenAI's error object; every request ends in one log line,
which names the reason of a refusal."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.errors import UserError
from runtime.serving.batch import TokenOut
from runtime.serving.chat import chat_body, chat_chunk, chat_logprobs, parse_chat
from runtime.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from runtime.serving.protocol import RequestError, parse_completion, parse_json
from runtime.serving.responses import chunk_body, completion_body, error_body, logprobs_object, sse, usage_chunk
from runtime.serving.service import Service
from runtime.serving.tokenizer_routes import TOKENIZER_ROUTES
from runtime.serving.worker import Choice, ServeJob, WorkerDied

log = logging.getLogger("moesys.serve")
MAX_BODY_BYTES = 16 << 20
"""A request body larger than this is refused (413) before it is read: a prompt longer than any context is far
smaller."""
BODY_TIMEOUT_S = 60.0
"""A client that takes longer to send its request body is refused (408)."""
POLL_S = 1.0
"""How often a request waiting for its answer checks that the generation worker is still running."""


def _refused(trace: _Trace, status: int, message: str, kind: str = "invalid_request_error",
             param: str | None = None) -> Response:
    """OpenAI's error object with this status; the request's log line names the reason."""
    trace.end(status, message)
    return JSONResponse(error_body(message, kind, param), status_code=status)


def _refused_by(trace: _Trace, exc: RequestError) -> Response:
    return _refused(trace, exc.status, str(exc), exc.kind, exc.param)


def _refusal(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(status, OpenAI error body) for an error the worker or the request raised."""
    if isinstance(exc, RequestError):
        return exc.status, error_body(str(exc), exc.kind, exc.param)
    if isinstance(exc, UserError):  # the generation refused the input
        return 400, error_body(str(exc).splitlines()[0])
    text = str(exc).strip().splitlines()
    return 500, error_body(f"generation failed: {type(exc).__name__}: {text[0] if text else ''}", "server_error")


class _Trace:
    """One request's log line and metrics, recorded once when it ends."""

    def __init__(self, service: Service, route: str):
        self.service, self.route = service, route
        prefix = "chatcmpl" if "chat" in route else "cmpl" if "completions" in route else "req"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.began = time.monotonic()
        self.prompt_tokens = self.completion_tokens = 0
        self.job: ServeJob | None = None
        self.user: str | None = None
        self.done = False

    def end(self, status: int, reason: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        first = self.job.first_token_at if self.job is not None else None
        self.service.metrics.record(self.id, self.route, status, self.prompt_tokens, self.completion_tokens,
                                    None if first is None else first - self.began, time.monotonic() - self.began,
                                    error=reason, user=self.user)


def build_app(service: Service) -> Starlette:
    """The ASGI app serving `service`."""
    model = service.config.model

    def handler(route: str, parse, render, chunks):
        async def endpoint(request: Request) -> Response:
            trace = _Trace(service, route)
            try:
                body = parse_json(await asyncio.wait_for(_read_body(request), BODY_TIMEOUT_S))
                completion = parse(body, service.defaults, service.tokenizer, model.vocab_size, model.max_seq_len)
            except RequestError as exc:
                return _refused_by(trace, exc)
            except ClientDisconnect:  # left while sending its request
                return _refused(trace, 499, "the client closed the connection")
            except asyncio.TimeoutError:
                return _refused(trace, 408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s")
            trace.prompt_tokens, trace.user = completion.prompt_tokens, completion.user
            if completion.stream:
                return _stream(service, completion, trace, chunks)
            return await _whole(service, request, completion, trace, render)
        return endpoint

    def _render_completion(trace, completion, choices):
        return completion_body(trace.id, service.name, choices, completion, service.tokenizer)

    def _render_chat(trace, completion, choices):
        return chat_body(trace.id, service.name, choices, completion, service.tokenizer)

    async def models(request: Request) -> Response:
        """The one served model, in OpenAI's list shape."""
        created = int(service.loaded.path.stat().st_mtime)
        return _traced(_Trace(service, "/v1/models"), JSONResponse({"object": "list", "data": [
            {"id": service.name, "object": "model", "created": created, "owned_by": "moesys",
             "context_length": model.max_seq_len}]}))

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    async def health(request: Request) -> Response:
        """200 while the worker takes requests; 503 once it is stopping or dead, with the same body."""
        state = service.health()
        return JSONResponse(state, status_code=200 if state["status"] == "ok" else 503)

    async def http_error(request: Request, exc: Exception) -> Response:
        """No such route (404) or method (405): logged under the route `unrouted` (a label per path would grow
        the metrics without bound)."""
        assert isinstance(exc, HTTPException)
        return _refused(_Trace(service, "unrouted"), exc.status_code,
                        f"{request.method} {request.url.path[:200]}: {exc.detail}")

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("request failed")
        return _refused(_Trace(service, request.url.path if request.url.path in known else "unrouted"), 500,
                        f"internal error: {type(exc).__name__}", "server_error")

    def tokenizer_route(path: str, answer):
        async def endpoint(request: Request) -> Response:
            trace = _Trace(service, path)
            try:
                body = {} if request.method == "GET" else parse_json(
                    await asyncio.wait_for(_read_body(request), BODY_TIMEOUT_S))
                return _traced(trace, JSONResponse(answer(service, body)))
            except RequestError as exc:
                return _refused_by(trace, exc)
            except ClientDisconnect:
                return _refused(trace, 499, "the client closed the connection")
            except asyncio.TimeoutError:
                return _refused(trace, 408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s")
        return endpoint

    routes = [Route("/v1/completions", handler("/v1/completions", parse_completion, _render_completion,
                                               _completion_chunks), methods=["POST"]),
              Route("/v1/chat/completions", handler("/v1/chat/completions", parse_chat, _render_chat, _chat_chunks),
                    methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    routes += [Route(path, tokenizer_route(path, answer), methods=[method])
               for path, method, answer in TOKENIZER_ROUTES]
    known = {route.path for route in routes}
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})


def _traced(trace: _Trace, response: Response) -> Response:
    trace.end(response.status_code)
    return response


async def _whole(service: Service, request: Request, completion, trace: _Trace, render) -> Response:
    """Queue the job, wait for its choices (or the client leaving, or a timeout), and answer them whole."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future = loop.create_future()
    job = ServeJob(completion, tokenizer=service.tokenizer, stop_ids=service.loaded.stop_ids,
                   finish=lambda choices, error: loop.call_soon_threadsafe(_settle, answer, choices, error))
    trace.job = job
    try:
        service.worker.submit(job)
    except RequestError as exc:
        return _refused_by(trace, exc)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await _answer_or_leave(service, answer, gone, service.config.serve.request_timeout_s)
    finally:
        gone.cancel()
        job.cancelled = True  # a no-op once finished; else the client left or the request timed out
        if not answer.done():
            answer.cancel()
    if answer.cancelled():
        return _refused(trace, 499, "the client closed the connection")  # nobody reads it
    error = answer.exception()
    if error is not None:
        status, content = _refusal(error)
        trace.end(status, content["error"]["message"])
        return JSONResponse(content, status_code=status)
    choices = answer.result()
    trace.completion_tokens = sum(len(c.tokens) for c in choices)
    return _traced(trace, JSONResponse(render(trace, completion, choices)))


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

    def failure(self) -> RequestError | None:
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


def _settle(answer: asyncio.Future, choices: list[Choice] | None, error: BaseException | None) -> None:
    if answer.done():  # the request was cancelled meanwhile
        return
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(choices)


def _completion_chunks(trace: _Trace, service: Service, index: int, out: TokenOut | None, piece: str | None,
                       finish: str | None) -> dict[str, Any]:
    """A completions chunk: choice `index`'s new token and text, or (out None) its end."""
    tok = service.tokenizer
    text = piece if tok is not None else None
    if out is None:
        return chunk_body(trace.id, service.name, [], text, finish_reason=finish, index=index)
    lp = logprobs_object([(out.token, out.logprob, out.top)], tok) if out.logprob is not None else None
    return chunk_body(trace.id, service.name, [out.token], text, index=index, logprobs=lp)


def _chat_chunks(trace: _Trace, service: Service, index: int, out: TokenOut | None, piece: str | None,
                 finish: str | None) -> dict[str, Any]:
    if out is None:
        return chat_chunk(trace.id, service.name, index, {"content": piece} if piece else {}, finish)
    lp = chat_logprobs([out], service.tokenizer) if out.logprob is not None else None
    return chat_chunk(trace.id, service.name, index, {"content": piece}, logprobs=lp)


def _stream(service: Service, completion, trace: _Trace, render) -> Response:
    """Queue the job first (a full queue is a 503, not a broken stream), then stream one chunk per token per
    choice, each choice's end (its finish reason) and, with stream_options.include_usage, a last chunk of usage
    (every other chunk then has `"usage": null`, as OpenAI's)."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = ServeJob(completion, tokenizer=service.tokenizer, stop_ids=service.loaded.stop_ids,
                   finish=lambda choices, error: loop.call_soon_threadsafe(events.put_nowait, (choices, error)),
                   on_token=lambda i, out, piece: loop.call_soon_threadsafe(events.put_nowait, (i, out, piece)))
    trace.job = job
    try:
        service.worker.submit(job)
    except RequestError as exc:
        return _refused_by(trace, exc)
    chat = render is _chat_chunks

    def event(chunk: dict[str, Any]) -> bytes:
        if completion.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    async def chunks():
        waiting = _Waiting(service, service.config.serve.request_timeout_s)  # a stream's news: each token
        status, reason, told = 200, None, set()
        try:
            while True:
                try:
                    news = await asyncio.wait_for(events.get(), POLL_S)
                    waiting.news()
                except asyncio.TimeoutError:
                    news = (None, waiting.failure())
                    if news[1] is None:
                        continue
                if len(news) == 3:
                    index, out, piece = news
                    if chat and index not in told:  # a chat stream opens each choice with its role
                        told.add(index)
                        yield event(chat_chunk(trace.id, service.name, index, {"role": "assistant", "content": ""}))
                    trace.completion_tokens += 1
                    yield event(render(trace, service, index, out, piece, None))
                    continue
                choices, error = news
                if error is not None:
                    status, content = _refusal(error)
                    reason = content["error"]["message"]
                    yield sse(content)
                else:
                    for c in choices:
                        yield event(render(trace, service, c.index, None, "", c.finish_reason))
                    if completion.include_usage:
                        yield sse(usage_chunk(trace.id, service.name, "chat.completion.chunk" if chat else
                                              "text_completion", trace.prompt_tokens, trace.completion_tokens))
                yield sse("[DONE]")
                return
        finally:
            job.cancelled = True  # a no-op once finished; stops the generation when the client went away
            if job.finished or reason is not None:
                trace.end(status, reason)
            else:
                trace.end(499, "the client closed the connection")

    return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
