"""The one generation worker of `moesys serve`: a thread that owns the model and its offloader, takes requests
from a bounded queue in arrival order and runs them, alone or batched (greedy requests of equal prompt length and
max_tokens on a dropless model, up to serve.max_batch_size; a batched row may differ from a lone run where float
rounding flips a near-tie)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from torch import Tensor

from runtime.inference.decode import DecodeStep
from runtime.inference.generate import generate
from runtime.inference.offload import Offloader
from runtime.model.transformer import Transformer
from runtime.serving.protocol import CompletionRequest, RequestError

log = logging.getLogger("moesys.serve")


class Cancelled(Exception):
    """Every client of a batch has gone: its generation stops between two forwards."""


class Stopped(RequestError):
    """A request the worker will not run because the server is stopping (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down; retry on another instance", status=503, kind="server_error")


class WorkerDied(RequestError):
    """A request the worker cannot run because its thread has ended on an error (HTTP 503)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"the generation worker has died ({why}); restart the server", status=503,
                         kind="server_error")


@dataclass(eq=False)
class Job:
    """One request inside the worker. Both callbacks run on the worker thread and must not block."""

    request: CompletionRequest
    finish: Callable[[Optional[list[int]], Optional[BaseException]], None]
    """Called once: (new token ids, None), or (None, the error)."""
    on_tokens: Optional[Callable[[list[int]], None]] = None
    """Streaming: called with each new token id as it is made."""
    cancelled: bool = False
    """Set by the server when the client has gone; the worker skips or stops the job."""
    finished: bool = False
    """Set once `finish` has been called, so that it is never called twice."""


def batchable(a: CompletionRequest, b: CompletionRequest) -> bool:
    """Rows of one batch must not see each other: greedy (a sampled row's draws depend on the batch's shared
    generator), and of equal length and max_tokens (no padding, one KV cache length)."""
    return (a.temperature == 0 and b.temperature == 0 and len(a.prompt_ids) == len(b.prompt_ids)
            and a.max_tokens == b.max_tokens)


class GenerationWorker:
    """Runs jobs one batch at a time on its own thread; `submit` from any thread. An error outside a batch's
    generation ends the thread: every job it holds fails with WorkerDied, and so does every later submit."""

    def __init__(self, model: Transformer, offloader: Offloader, max_batch_size: int = 1, max_queue: int = 64,
                 stuck_after_s: float = 600.0, step: Optional[DecodeStep] = None):
        """step: the decode step every batch reuses (its static cache, its compiled code); eager when not given."""
        dropless = model.cfg.capacity_factor == 0  # with a capacity, which tokens an expert drops depends on the batch
        self.model, self.offloader = model, offloader
        self.step = step if step is not None else DecodeStep(model)
        self.max_batch_size = max_batch_size if dropless else 1
        self.max_queue = max_queue
        self.completed = self.failed = self.cancelled = 0
        self.batches = 0
        """Generations run so far, each over a batch of one or more requests."""
        self.running = 0
        self.error: Optional[str] = None
        """Why the thread died (None while it runs, and after a stop)."""
        self.stuck_after_s = stuck_after_s
        self._batch_started: Optional[float] = None
        """time.monotonic() when the batch in hand started; None while idle."""
        self._pending: deque[Job] = deque()
        self._batch: list[Job] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="moesys-generation", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> bool:
        """Whether the thread is still running (it may be stopping)."""
        return self._thread.is_alive()

    @property
    def state(self) -> str:
        """'ok', 'stopping' and then 'stopped' (after stop()), 'dead' (the thread ended on an error: `error`), or
        'stuck' (one generation has run longer than stuck_after_s: a hung forward holds every request behind it)."""
        if self.error is not None:
            return "dead"
        if self._stopping:
            return "stopping" if self._thread.is_alive() else "stopped"
        if not self._thread.is_alive():
            return "dead"
        started = self._batch_started
        return "stuck" if started is not None and time.monotonic() - started > self.stuck_after_s else "ok"

    def submit(self, job: Job) -> None:
        """Queue a job; RequestError 503 when the queue is full or the worker is stopping, dead or stuck."""
        with self._cv:
            state = self.state
            if state == "dead":
                raise WorkerDied(self.error or "its thread has ended")
            if state == "stuck":
                raise RequestError(f"the generation worker has run one generation for more than "
                                   f"serve.request_timeout_s={self.stuck_after_s:g} s; retry later or on another "
                                   "instance", status=503, kind="server_error")
            if self._stopping:
                raise Stopped()
            if len(self._pending) >= self.max_queue:
                raise RequestError(f"the server is busy ({self.max_queue} requests queued, serve.max_queue); "
                                   "retry later", status=503, kind="server_error")
            self._pending.append(job)
            self._cv.notify()

    def stop(self, timeout: float) -> bool:
        """Refuse what is queued (503) and end the thread: the batch in hand gets `timeout` seconds to finish, then
        is cancelled between two forwards (`timeout` more seconds). Whether the thread has ended."""
        with self._cv:
            self._stopping = True
            refused, self._pending = list(self._pending), deque()
            self._cv.notify()
        for job in refused:
            _finish(job, None, Stopped())
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cv:
                for job in self._batch:
                    job.cancelled = True
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _take_batch(self) -> list[Job]:
        """The oldest live job, and as many queued jobs that batch with it as fit (oldest first)."""
        while self._pending:
            head = self._pending.popleft()
            if head.cancelled:
                self.cancelled += 1
                _finish(head, None, Cancelled())
                continue
            batch = [head]
            if self.max_batch_size > 1:
                for job in list(self._pending):
                    if len(batch) == self.max_batch_size:
                        break
                    if not job.cancelled and batchable(head.request, job.request):
                        self._pending.remove(job)
                        batch.append(job)
            return batch
        return []

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # whatever ended the thread, no job may wait for it
            log.exception("the generation worker died")
            self._die(exc)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopping:
                    self._cv.wait()
                if self._stopping:  # stop() has refused what was queued
                    return
                self._batch = self._take_batch()
                self.running = len(self._batch)
                self._batch_started = time.monotonic() if self._batch else None
            if self._batch:
                self._run_batch(self._batch)
            with self._cv:
                self._batch, self._batch_started = [], None
                self.running = 0

    def _die(self, exc: BaseException) -> None:
        """Fail every job still held (the batch in hand and the queue) and refuse what comes later."""
        lines = str(exc).strip().splitlines()
        with self._cv:
            self.error = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
            held, self._batch, self._pending = self._batch + list(self._pending), [], deque()
            self.running = 0
        left = [job for job in held if not job.finished]
        self.failed += len(left)
        for job in left:
            _finish(job, None, WorkerDied(self.error))

    def _run_batch(self, jobs: list[Job]) -> None:
        first = jobs[0].request
        streaming = any(job.on_tokens is not None for job in jobs)

        def on_token(members: list[int], ids_B: Tensor) -> None:
            if all(job.cancelled for job in jobs):
                raise Cancelled()
            if streaming:
                ids = ids_B.tolist()
                for row, i in enumerate(members):
                    job = jobs[i]
                    if job.on_tokens is not None and not job.cancelled:
                        try:
                            job.on_tokens([ids[row]])
                        except Exception:  # its event loop has closed: the client is gone
                            job.cancelled = True

        self.batches += 1
        try:
            self.offloader.reset_stats()  # its timeline would otherwise grow with every forward for the server's life
            gen = generate(self.model, [job.request.prompt_ids for job in jobs], first.max_tokens, first.temperature,
                           first.top_k, first.seed, self.offloader, on_token=on_token, step=self.step)
        except Cancelled as exc:
            self.cancelled += len(jobs)
            for job in jobs:
                _finish(job, None, exc)
            return
        except Exception as exc:  # one bad batch must not take the service down
            log.exception("generation failed")
            self.failed += len(jobs)
            for job in jobs:
                _finish(job, None, exc)
            return
        for job, tokens in zip(jobs, gen.tokens):
            if job.cancelled:  # its client left while the rest of the batch went on
                self.cancelled += 1
                _finish(job, None, Cancelled())
            else:
                self.completed += 1
                _finish(job, tokens, None)


def _finish(job: Job, tokens: Optional[list[int]], error: Optional[BaseException]) -> None:
    if job.finished:
        return
    job.finished = True
    try:
        job.finish(tokens, error)
    except Exception:  # the client's event loop has closed: nobody is waiting for this answer
        log.debug("a finished job had no one to tell", exc_info=True)
