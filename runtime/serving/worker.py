"""The one generation worker of `moesys serve`: a thread that owns the model and its offloader, takes requests
from a bounded queue in arrival order and runs their sequences (per prompt, one per choice: `n`, or `best_of`
candidates of which the `n` most likely are answered) by continuous batching: a sequence joins the decode batch as
soon as a row is free and leaves it after its last token, so requests of any prompt count and length, max_tokens
and sampling settings share decode steps. Each sequence's tokens are its lone run's."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.inference.decode import BatchDecodeStep
from runtime.inference.offload import Offloader
from runtime.model.transformer import Transformer
from runtime.serving.batch import ContinuousBatch, Sequence, TokenOut
from runtime.serving.protocol import CompletionRequest, RequestError
from runtime.serving.stops import StopText

log = logging.getLogger("moesys.serve")


class Cancelled(Exception):
    """The client of a request has gone: its sequences leave the batch between two steps."""


class Stopped(RequestError):
    """A request the worker will not run because the server is stopping (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down; retry on another instance", status=503, kind="server_error")


class WorkerDied(RequestError):
    """A request the worker cannot run because its thread has ended on an error (HTTP 503)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"the generation worker has died ({why}); restart the server", status=503,
                         kind="server_error")


@dataclass
class Choice:
    """One finished choice: its new token ids, text (None without a tokenizer), why it ended and, when asked,
    a TokenOut per token (and, with echo, per prompt token after the first)."""

    index: int
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str = "length"
    logprobs: list[TokenOut] = field(default_factory=list)
    prompt: int = 0
    """Which of the request's prompts it answers."""
    prompt_logprobs: list[TokenOut] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    """The sum of its tokens' log-probabilities (computed for best_of)."""


@dataclass(eq=False)
class ServeJob:
    """One request inside the worker. Callbacks run on the worker thread and must not block."""

    request: CompletionRequest
    finish: Callable[[list[Choice] | None, BaseException | None], object]
    """Called once: (the choices in index order, None), or (None, the error)."""
    on_token: Callable[[int, TokenOut, str], object] | None = None
    """Streaming: (choice index, the new token, its new piece of text) as each token is made."""
    tokenizer: Any = None
    stop_ids: tuple[int, ...] = ()
    """Ids that end a choice (finish_reason stop): the model's eos and end of turn. The id is given out, its text
    is not."""
    cancelled: bool = False
    """Set by the server when the client has gone; the worker drops the job's sequences."""
    finished: bool = False
    """Set once `finish` has been called, so that it is never called twice."""
    first_token_at: float | None = None
    """time.monotonic() of the job's first token."""
    choices: list[Choice] = field(default_factory=list)
    running: int = 0
    """Sequences of this job not yet finished."""


@dataclass(eq=False, kw_only=True)
class _Seq(Sequence):
    job: ServeJob
    choice: Choice
    text: StopText | None = None


def _sequences(job: ServeJob) -> list[_Seq]:
    """Per prompt, one sequence per candidate (n, or best_of); candidate i samples with seed + i, so candidate 0 is
    the lone run of the prompt. Candidate i of prompt p is choice p * candidates + i until best_of picks."""
    r = job.request
    k = r.candidates
    job.choices = [Choice(p * k + i, prompt=p) for p in range(len(r.prompts)) for i in range(k)]
    job.running = len(job.choices)
    return [_Seq(r.prompts[c.prompt], r.max_tokens, r.sampling, r.seed + c.index % k, r.logprobs,
                 scored=r.best_of > r.n, echo=r.echo, job=job, choice=c,
                 text=StopText(job.tokenizer, r.stop) if job.tokenizer is not None else None)
            for c in job.choices]


def best_choices(job: ServeJob) -> list[Choice]:
    """The answer's choices in index order: per prompt the n of highest cumulative log-probability of its best_of
    candidates (the earlier on a tie), numbered p * n + i; all of them, as they are, without best_of."""
    r = job.request
    if r.best_of <= r.n:
        return job.choices
    k, picked = r.candidates, []
    for p in range(len(r.prompts)):
        candidates = job.choices[p * k:(p + 1) * k]
        best = sorted(candidates, key=lambda c: (-c.cumulative_logprob, c.index))[:r.n]
        for i, c in enumerate(best):
            c.index = p * r.n + i
            picked.append(c)
    return picked


class GenerationWorker:
    """Runs sequences by continuous batching on its own thread; `submit` from any thread. An error outside the
    model's forwards ends the thread: every job it holds fails with WorkerDied, and so does every later submit."""

    def __init__(self, model: Transformer, offloader: Offloader, max_batch_size: int = 1, max_queue: int = 64,
                 stuck_after_s: float = 600.0, compile: bool = False):
        """A model with an expert capacity decodes one sequence at a time (which tokens an expert drops would
        depend on the batch). compile: decode the batch with a compiled step per batch-size bucket (infer.compile;
        CUDA graphs on CUDA) instead of row by row lone steps' arithmetic."""
        dropless = model.cfg.capacity_factor == 0
        self.model, self.offloader = model, offloader
        self.max_batch_size = max_batch_size if dropless else 1
        self.max_queue = max_queue
        step = BatchDecodeStep(model, self.max_batch_size, compile=True) if compile else None
        self.batch = ContinuousBatch[_Seq](model, self.max_batch_size, offloader, step)
        self.completed = self.failed = self.cancelled = 0
        self.error: str | None = None
        """Why the thread died (None while it runs, and after a stop)."""
        self.stuck_after_s = stuck_after_s
        self._step_started: float | None = None
        self._joining = 0
        self._pending: deque[_Seq] = deque()
        self._jobs: set[ServeJob] = set()
        """Jobs queued or running."""
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="moesys-generation", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Requests waiting for their first row (a snapshot: /metrics reads it from another thread)."""
        return sum(1 for s in list(self._pending) if s.choice.index == 0)

    @property
    def running(self) -> int:
        """Sequences in the decode batch or joining it."""
        return len(self.batch.rows) + self._joining

    @property
    def batches(self) -> int:
        """Decode steps run so far, each shared by every sequence in the batch."""
        return self.batch.steps

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def state(self) -> str:
        """'ok', 'stopping' then 'stopped' (after stop()), 'dead' (the thread ended on an error: `error`), or
        'stuck' (one step has run longer than stuck_after_s: a hung forward holds every request)."""
        if self.error is not None:
            return "dead"
        if self._stopping:
            return "stopping" if self._thread.is_alive() else "stopped"
        if not self._thread.is_alive():
            return "dead"
        started = self._step_started
        return "stuck" if started is not None and time.monotonic() - started > self.stuck_after_s else "ok"

    def submit(self, job: ServeJob) -> None:
        """Queue a job; RequestError 503 when the queue is full or the worker is stopping, dead or stuck."""
        with self._cv:
            state = self.state
            if state == "dead":
                raise WorkerDied(self.error or "its thread has ended")
            if state == "stuck":
                raise RequestError(f"the generation worker has run one step for more than serve.request_timeout_s="
                                   f"{self.stuck_after_s:g} s; retry later or on another instance", status=503,
                                   kind="server_error")
            if self._stopping:
                raise Stopped()
            if self.queued >= self.max_queue:
                raise RequestError(f"the server is busy ({self.max_queue} requests queued, serve.max_queue); "
                                   "retry later", status=503, kind="server_error")
            self._pending.extend(_sequences(job))
            self._jobs.add(job)
            self._cv.notify()

    def stop(self, timeout: float) -> bool:
        """Refuse what is queued (503) and end the thread: the sequences in the batch get `timeout` seconds to
        finish, then are cancelled between two steps (`timeout` more seconds). Whether the thread has ended."""
        with self._cv:
            self._stopping = True
            refused = {s.job for s in self._pending if s.job is not None}
            self._pending = deque()
            self._cv.notify()
        for job in refused:
            self._end(job, None, Stopped())
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cv:
                for job in list(self._jobs):
                    job.cancelled = True
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # whatever ended the thread, no job may wait for it
            log.exception("the generation worker died")
            self._die(exc)

    def _admit(self) -> list[_Seq]:
        """Queued sequences that take the free rows, oldest first; cancelled ones are dropped."""
        joining: list[_Seq] = []
        with self._cv:
            while not self._pending and not self.batch.rows and not self._stopping:
                self._cv.wait()
            while self._pending and len(joining) < self.batch.free:
                seq = self._pending.popleft()
                if seq.job.cancelled or seq.job.finished:
                    self._end(seq.job, None, Cancelled())
                    continue
                joining.append(seq)
        return joining

    def _loop(self) -> None:
        while True:
            joining = self._admit()
            if self._stopping and not self.batch.rows and not joining:
                return
            self._step_started = time.monotonic()
            self._joining = len(joining)
            for seq in joining:
                try:
                    out = self.batch.join(seq)
                except Exception as exc:  # one bad prompt must not take the service down
                    log.exception("prefill failed")
                    self._end(seq.job, None, exc)
                    continue
                finally:
                    self._joining -= 1
                seq.choice.prompt_logprobs = seq.prompt_outs
                if out is None:  # scored its prompt, generates nothing
                    self._done(seq, stopped=False)
                else:
                    self._emit(seq, out)
            if self.batch.rows:
                self._decode()
            self._step_started = None

    def _decode(self) -> None:
        """One shared step; a failing step fails the jobs in the batch and empties it."""
        live = [s for s in self.batch.rows if not s.job.finished]
        try:
            outs = self.batch.step()
        except Exception as exc:
            log.exception("decode step failed")
            for seq in live:
                self._end(seq.job, None, exc)
            self.batch.clear()
            return
        for seq, out in zip(live, outs, strict=True):
            self._emit(seq, out)

    def _emit(self, seq: _Seq, out: TokenOut) -> None:
        """Hand the token on; leave the batch when the sequence is done (length, stop token or string, client
        gone)."""
        job, choice = seq.job, seq.choice
        if job.first_token_at is None:
            job.first_token_at = time.monotonic()
        choice.tokens.append(out.token)
        if seq.logprobs is not None:
            choice.logprobs.append(out)
        if out.logprob is not None:
            choice.cumulative_logprob += out.logprob
        stop_token = out.token in job.stop_ids
        piece, stopped = seq.text.push([] if stop_token else [out.token], final=seq.full or stop_token) \
            if seq.text is not None else ("", False)
        stopped = stopped or stop_token
        if job.on_token is not None and not job.cancelled:
            try:
                job.on_token(choice.index, out, piece)
            except Exception:  # its event loop has closed: the client is gone
                job.cancelled = True
        if seq.full or stopped or job.cancelled or job.finished:
            self._done(seq, stopped)

    def _done(self, seq: _Seq, stopped: bool) -> None:
        """The sequence leaves the batch; its job ends with its last sequence (or at once when cancelled)."""
        job, choice = seq.job, seq.choice
        if seq in self.batch.rows:
            self.batch.leave(seq)
        if job.finished:
            return
        if job.cancelled:
            self._end(job, None, Cancelled())
            return
        choice.text = seq.text.text if seq.text is not None else None
        choice.finish_reason = "stop" if stopped else "length"
        job.running -= 1
        if job.running == 0:
            self._end(job, best_choices(job), None)

    def _end(self, job: ServeJob, choices: list[Choice] | None, error: BaseException | None) -> None:
        """Finish a job once; its sequences still in the batch leave it."""
        if job.finished:
            return
        job.finished = True
        if threading.current_thread() is self._thread:  # else its rows leave at their next token (_emit)
            for seq in [s for s in self.batch.rows if s.job is job]:
                self.batch.leave(seq)
        self._jobs.discard(job)
        if error is None:
            self.completed += 1
        elif isinstance(error, Cancelled):
            self.cancelled += 1
        elif not isinstance(error, Stopped):
            self.failed += 1
        try:
            job.finish(choices, error)
        except Exception:  # the client's event loop has closed: nobody is waiting for this answer
            log.debug("a finished job had no one to tell", exc_info=True)

    def _die(self, exc: BaseException) -> None:
        """Fail every job still held and refuse what comes later."""
        lines = str(exc).strip().splitlines()
        with self._cv:
            self.error = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
            held, self._pending = list(self._jobs), deque()
        self.batch.clear()
        for job in held:
            self._end(job, None, WorkerDied(self.error))
