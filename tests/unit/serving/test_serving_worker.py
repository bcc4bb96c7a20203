"""The generation worker: continuous batching of mixed requests, each its lone run's tokens; stop strings;
drops sequences whose clients have gone; a bounded queue, a bounded stop that refuses what is left, a death that
fails every job held; the protocol's field checks and streamed text pieces."""

import threading

import pytest
import torch

from runtime.config import ModelConfig
from runtime.inference.generate import generate
from runtime.inference.offloaders import make_offloader
from runtime.model.transformer import Transformer
from runtime.inference.sampling import Sampling
from runtime.serving.protocol import CompletionRequest, Defaults, RequestError, parse_completion, parse_json
from runtime.serving.stops import StopText
from runtime.serving.worker import Cancelled, GenerationWorker, ServeJob, Stopped, WorkerDied
from runtime.data.tokenizer import ByteTokenizer
from tests.waiting import wait_until

TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, vocab_size=256, ffn_hidden_size=64, num_experts=4,
                   top_k=2, max_seq_len=48)


def _worker(capacity_factor: float = 0.0, **kwargs) -> GenerationWorker:
    torch.manual_seed(0)
    cfg = ModelConfig(**{**vars(TINY), "capacity_factor": capacity_factor})
    model = Transformer(cfg).eval()
    return GenerationWorker(model, make_offloader(model, "none", torch.device("cpu")), **kwargs)


class Answer:
    """A job's outcome, waited for by the test; `hold` keeps the worker inside finish() until released."""

    def __init__(self, hold: bool = False):
        self.done, self.release = threading.Event(), threading.Event()
        self.tokens, self.choices, self.error, self.streamed = None, None, None, []
        if not hold:
            self.release.set()

    def finish(self, choices, error):
        self.choices, self.error = choices, error
        self.tokens = choices[0].tokens if choices else None
        self.done.set()
        self.release.wait(30)

    def wait(self):
        assert self.done.wait(30)
        return self


def _request(ids, max_tokens=5, temperature=0.0, seed=0):
    return CompletionRequest([ids], max_tokens, Sampling(temperature), seed)


def _held(worker: GenerationWorker) -> Answer:
    """A first job that keeps the worker inside its finish() until `release` is set: what is submitted meanwhile
    queues behind it."""
    first = Answer(hold=True)
    worker.submit(ServeJob(_request([1, 2, 3]), first.finish))
    assert first.done.wait(30)
    return first


def test_requests_of_mixed_shapes_and_sampling_share_steps_and_each_gets_its_lone_tokens():
    worker = _worker(max_batch_size=4)
    first = _held(worker)
    requests = [_request([4, 5, 6, 7, 8, 9, 10], max_tokens=9), _request([7, 8], temperature=1.0, seed=3),
                _request([10, 11, 12], max_tokens=2), _request([13, 14, 15, 16], temperature=0.7, seed=5),
                _request([15], max_tokens=12), _request([18, 19, 20, 21, 22], max_tokens=4, temperature=2.0, seed=9),
                CompletionRequest([[30, 31]], 6, Sampling(0.9, 7), 11, n=3)]
    answers = [Answer() for _ in requests]
    for request, answer in zip(requests, answers):
        worker.submit(ServeJob(request, answer.finish))
    first.release.set()
    for request, answer in zip(requests, answers):
        answer.wait()
        assert answer.error is None and len(answer.choices) == request.n
        for choice in answer.choices:  # choice i samples with seed + i: choice 0 is the request's lone run
            lone = generate(worker.model, request.prompts, request.max_tokens, request.sampling.temperature,
                            request.sampling.top_k, request.seed + choice.index).tokens[0]
            assert choice.tokens == lone
    assert len({tuple(c.tokens) for c in answers[-1].choices}) == 3  # the choices differ: a mix-up would show
    steps = worker.batches
    assert worker.stop(30) and worker.completed == 8
    assert steps < sum(r.max_tokens * r.n for r in requests)  # sequences shared decode steps


def test_stop_strings_cut_the_text_and_end_the_choice():
    worker = _worker(max_batch_size=2)
    lone = generate(worker.model, [[1, 2, 3]], 12).tokens[0]
    text = ByteTokenizer().decode(lone)
    stop = text[3:5]
    answer = Answer()
    worker.submit(ServeJob(CompletionRequest([[1, 2, 3]], 12, Sampling(), 0, stop=(stop,), logprobs=2),
                           answer.finish, tokenizer=ByteTokenizer()))
    choice = answer.wait().choices[0]
    cut = text.find(stop)
    assert choice.finish_reason == "stop" and choice.text == text[:cut] and choice.tokens == lone[:len(
        ByteTokenizer().encode(text[:cut + len(stop)]))]
    assert len(choice.logprobs) == len(choice.tokens) and all(len(o.top) == 2 for o in choice.logprobs)
    assert choice.logprobs[0].top[0][0] == lone[0]  # greedy: the first choice is the most likely token
    assert worker.stop(30)


def test_a_stop_token_ends_its_choice_and_is_given_out_without_text():
    worker = _worker(max_batch_size=2)
    lone = generate(worker.model, [[1, 2, 3]], 12).tokens[0]
    k = lone.index(lone[4])  # the first place the stop token comes
    stopped, going = Answer(), Answer()
    worker.submit(ServeJob(_request([1, 2, 3], max_tokens=12), stopped.finish,
                           on_token=lambda i, out, piece: stopped.streamed.append(piece), tokenizer=ByteTokenizer(),
                           stop_ids=(lone[4],)))
    worker.submit(ServeJob(_request([1, 2, 3], max_tokens=12), going.finish,
                           tokenizer=ByteTokenizer()))  # beside it in the batch, without stop tokens
    choice = stopped.wait().choices[0]
    assert choice.finish_reason == "stop" and choice.tokens == lone[:k + 1]
    assert choice.text == ByteTokenizer().decode(lone[:k]) == "".join(stopped.streamed)
    other = going.wait().choices[0]
    assert other.tokens == lone and other.finish_reason == "length"
    assert worker.stop(30)


def test_a_model_with_expert_capacity_never_batches():
    assert _worker(capacity_factor=1.0, max_batch_size=8).max_batch_size == 1


def test_a_batch_whose_clients_have_gone_stops_between_forwards_and_the_worker_goes_on():
    worker = _worker()
    gone = Answer()
    job = ServeJob(_request([1, 2, 3], max_tokens=20), gone.finish)

    def on_token(index, out, piece):
        gone.streamed.append(out.token)
        if len(gone.streamed) == 2:
            job.cancelled = True  # what the server does when the stream's client disconnects

    job.on_token = on_token
    worker.submit(job)
    assert isinstance(gone.wait().error, Cancelled) and len(gone.streamed) == 2
    after = Answer()
    worker.submit(ServeJob(_request([1, 2, 3]), after.finish))
    assert after.wait().tokens == generate(worker.model, [[1, 2, 3]], 5).tokens[0]
    assert worker.stop(30)
    assert worker.cancelled == 1 and worker.completed == 1


def test_a_client_leaving_a_batch_that_goes_on_counts_as_cancelled():
    worker = _worker(max_batch_size=2)
    first = _held(worker)
    left, stayed = Answer(), Answer()
    job = ServeJob(_request([4, 5, 6]), left.finish)
    job.on_token = lambda index, out, piece: setattr(job, "cancelled", True)
    worker.submit(job)
    worker.submit(ServeJob(_request([7, 8, 9]), stayed.finish))
    first.release.set()
    assert isinstance(left.wait().error, Cancelled) and stayed.wait().tokens is not None
    assert worker.stop(30)
    assert (worker.completed, worker.cancelled) == (2, 1)


def test_stop_cancels_a_batch_that_outlasts_its_timeout():
    worker = _worker()
    slow, under_way = Answer(), threading.Event()
    job = ServeJob(_request([1, 2, 3], max_tokens=45), slow.finish)

    def outlasting(index, out, piece):  # the first token does not leave the step until the stop cancels the job
        under_way.set()
        wait_until(lambda: job.cancelled, what="the stop to cancel the batch")

    job.on_token = outlasting
    worker.submit(job)
    assert under_way.wait(30)
    assert worker.stop(1.0)
    assert isinstance(slow.wait().error, Cancelled) and worker.cancelled == 1


def test_an_error_outside_generation_fails_every_held_job_and_later_submits(monkeypatch):
    worker = _worker()
    broken = Answer()
    worker.submit(ServeJob(_request([1, 2, 3]), broken.finish))
    assert broken.wait().tokens is not None and worker.state == "ok"

    def fail():
        raise RuntimeError("a bug in the loop\nsecond line")

    monkeypatch.setattr(worker, "_admit", fail)
    lost = Answer()
    worker.submit(ServeJob(_request([1, 2, 3]), lost.finish))
    assert isinstance(lost.wait().error, WorkerDied) and lost.error.status == 503
    assert worker.state == "dead" and worker.error == "RuntimeError: a bug in the loop" and worker.failed == 1
    with pytest.raises(WorkerDied, match="has died"):
        worker.submit(ServeJob(_request([1]), Answer().finish))
    assert worker.stop(30)


def test_an_offloader_failing_before_a_prefill_fails_that_request_only(monkeypatch):
    worker = _worker()
    calls = []

    def reset():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("stats broke")

    monkeypatch.setattr(worker.offloader, "reset", reset)
    first, second = Answer(), Answer()
    worker.submit(ServeJob(_request([1, 2, 3]), first.finish))
    assert isinstance(first.wait().error, RuntimeError)
    worker.submit(ServeJob(_request([1, 2, 3]), second.finish))
    assert second.wait().tokens == generate(worker.model, [[1, 2, 3]], 5).tokens[0]
    assert worker.state == "ok" and (worker.failed, worker.completed) == (1, 1)
    assert worker.stop(30)


def test_a_full_queue_is_refused_and_stop_refuses_what_is_left():
    worker = _worker(max_queue=2)
    held = _held(worker)
    waiting = [Answer(), Answer()]
    for answer in waiting:
        worker.submit(ServeJob(_request([2]), answer.finish))
    with pytest.raises(RequestError, match="busy") as exc:
        worker.submit(ServeJob(_request([3]), Answer().finish))
    assert exc.value.status == 503
    stopped = []
    stopper = threading.Thread(target=lambda: stopped.append(worker.stop(30)))
    stopper.start()
    assert all(isinstance(a.wait().error, Stopped) for a in waiting)  # refused at once, the batch still in hand
    held.release.set()
    stopper.join(30)
    assert stopped == [True] and worker.state == "stopped"
    with pytest.raises(Stopped):
        worker.submit(ServeJob(_request([4]), Answer().finish))


DEFAULTS = Defaults(max_tokens=8, sampling=Sampling(), seed=0)


def test_request_fields_default_to_infer_settings_and_max_tokens_fits_the_context():
    tok = ByteTokenizer()
    got = parse_completion({"prompt": "hi"}, DEFAULTS, tok, 256, 48)
    assert got == CompletionRequest([[104, 105]], 8, Sampling(), 0)
    full = parse_completion({"prompt": "hi", "n": 2, "stop": ["x", "yz"], "logprobs": 3}, DEFAULTS, tok, 256, 48)
    assert (full.n, full.stop, full.logprobs) == (2, ("x", "yz"), 3)
    for body, param in (({"n": 0}, "n"), ({"n": 99}, "n"), ({"stop": [""]}, "stop"), ({"stop": 3}, "stop"),
                        ({"stop": ["a"] * 5}, "stop"), ({"logprobs": 21}, "logprobs"),
                        ({"logprobs": True}, "logprobs")):
        with pytest.raises(RequestError) as exc:
            parse_completion({"prompt": "hi", **body}, DEFAULTS, tok, 256, 48)
        assert exc.value.param == param and exc.value.status == 400
    near_end = parse_completion({"prompt": [1] * 44}, DEFAULTS, tok, 256, 48)
    assert near_end.max_tokens == 4  # the default shrinks to the room left; an explicit value must fit
    with pytest.raises(RequestError, match="at most 4") as exc:
        parse_completion({"prompt": [1] * 44, "max_tokens": 5}, DEFAULTS, tok, 256, 48)
    assert exc.value.param == "max_tokens"
    with pytest.raises(RequestError, match="no tokenizer"):
        parse_completion({"prompt": "hi"}, DEFAULTS, None, 256, 48)
    for bad in (True, 1.5, "3", None):
        with pytest.raises(RequestError, match="max_tokens must be an integer"):
            parse_completion({"prompt": "hi", "max_tokens": bad}, DEFAULTS, tok, 256, 48)


@pytest.mark.parametrize("raw,message,param", [
    (b'{"prompt": "hi", "temperature": ' + b"9" * 400 + b"}", "temperature must be a number >= 0", "temperature"),
    (b'{"prompt": "hi", "temperature": 1e999}', "temperature must be a number >= 0", "temperature"),
    (b'{"prompt": "a\\ud800"}', "prompt is not valid Unicode text: a lone surrogate at character 1", "prompt"),
    (b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", "not valid JSON", None),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON", None),
    (b'{"prompt": "hi", "seed": ' + b"9" * 400 + b"}", "9999... is out of range 0..", "seed"),
], ids=["huge-int-temperature", "infinite-temperature", "lone-surrogate", "past-digit-limit", "too-deep",
        "huge-seed"])
def test_a_field_python_cannot_hold_is_a_one_line_request_error(raw, message, param):
    with pytest.raises(RequestError) as exc:
        parse_completion(parse_json(raw), DEFAULTS, ByteTokenizer(), 256, 48)
    assert message in str(exc.value) and "\n" not in str(exc.value) and len(str(exc.value)) < 300
    assert (exc.value.param, exc.value.status) == (param, 400)


def test_streamed_text_pieces_hold_back_a_split_character_and_add_up_to_the_text():
    """Without stop strings StopText only holds back what may be an incomplete UTF-8 character."""
    ids = list("a€b".encode())  # € is three bytes
    stream = StopText(ByteTokenizer())
    pieces = [stream.push([i]) for i in ids] + [stream.push([], final=True)]
    assert pieces == [("a", False), ("", False), ("", False), ("€", False), ("b", False), ("", False)]
    cut = StopText(ByteTokenizer())
    assert cut.push(ids[:2]) == ("a", False) and cut.push([], final=True) == ("\ufffd", False)
    genuine = StopText(ByteTokenizer())  # a real U+FFFD waits only for the next piece or the end
    assert genuine.push(list("a\ufffd".encode())) == ("a", False) and genuine.push([], final=True) == ("\ufffd", False)


class _Cleanup:
    """A tokenizer that, like cleanup of tokenization spaces, drops a space before a comma: "hi " then "hi,"."""

    def decode(self, ids):
        return "".join(map(chr, ids)).replace(" ,", ",")


def test_a_prefix_decoded_differently_waits_and_the_end_gives_the_rest():
    stream = StopText(_Cleanup())
    pieces = [stream.push([ord(c)])[0] for c in "hi ,ok"] + [stream.push([], final=True)[0]]
    assert pieces == ["h", "i", " ", "", "", "", ",ok"]  # nothing past the differing point is lost
    assert stream.text == "hi,ok"


def test_the_service_opens_on_a_thread_that_ends_and_gives_back_its_result_or_error():
    """open_service opens the model on a passing thread (its OpenMP team goes with it): the result comes back,
    an error is raised on the caller's thread, and the thread has ended either way."""
    from runtime.serving.service import on_passing_thread

    ran_on = []

    def work():
        ran_on.append(threading.current_thread())
        return torch.ones(3).sum().item()

    assert on_passing_thread(work) == 3.0
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()

    def fail():
        raise FileNotFoundError("no checkpoint here")

    with pytest.raises(FileNotFoundError, match="no checkpoint here"):
        on_passing_thread(fail)
