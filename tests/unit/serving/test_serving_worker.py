"""The generation worker: batches only what keeps each request's tokens, stops a batch whose clients have gone, a
bounded queue, a stop that refuses what is left; the protocol's field checks and streamed text pieces."""

import threading

import pytest
import torch

from runtime.config import ModelConfig
from runtime.inference.generate import generate
from runtime.inference.modes import make_offloader
from runtime.model.transformer import Transformer
from runtime.serving.protocol import CompletionRequest, Defaults, RequestError, TextStream, parse_completion
from runtime.serving.worker import Cancelled, GenerationWorker, Job, Stopped
from runtime.train.tokenizer import ByteTokenizer

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
        self.tokens, self.error, self.streamed = None, None, []
        if not hold:
            self.release.set()

    def finish(self, tokens, error):
        self.tokens, self.error = tokens, error
        self.done.set()
        self.release.wait(30)

    def wait(self):
        assert self.done.wait(30)
        return self


def _request(ids, max_tokens=5, temperature=0.0, seed=0):
    return CompletionRequest(ids, max_tokens, temperature, 0, seed, False)


def test_batches_only_greedy_requests_of_equal_length_and_each_gets_its_own_tokens():
    worker = _worker(max_batch_size=4)
    first = Answer(hold=True)
    worker.submit(Job(_request([1, 2, 3]), first.finish))
    first.done.wait(30)  # the worker is held: everything below queues behind it
    requests = [_request([4, 5, 6]), _request([7, 8, 9], temperature=1.0, seed=3), _request([10, 11, 12]),
                _request([13, 14]), _request([15, 16, 17]), _request([18, 19, 20], max_tokens=4)]
    answers = [Answer() for _ in requests]
    for request, answer in zip(requests, answers):
        worker.submit(Job(request, answer.finish))
    assert worker.queued == len(requests)
    first.release.set()
    for request, answer in zip(requests, answers):
        alone = generate(worker.model, [request.prompt_ids], request.max_tokens, request.temperature, 0,
                         request.seed).tokens[0]
        assert answer.wait().tokens == alone
    worker.stop()
    # [1,2,3]; then [4,5,6] with [10,11,12] and [15,16,17]; the sampled one, the shorter one, the 4-token one alone
    assert worker.batches == 5 and worker.completed == 7


def test_a_model_with_expert_capacity_never_batches():
    assert _worker(capacity_factor=1.0, max_batch_size=8).max_batch_size == 1


def test_a_batch_whose_clients_have_gone_stops_between_forwards_and_the_worker_goes_on():
    worker = _worker()
    gone = Answer()
    job = Job(_request([1, 2, 3], max_tokens=20), gone.finish)

    def on_tokens(ids):
        gone.streamed += ids
        if len(gone.streamed) == 2:
            job.cancelled = True  # what the server does when the stream's client disconnects

    job.on_tokens = on_tokens
    worker.submit(job)
    assert isinstance(gone.wait().error, Cancelled) and len(gone.streamed) == 2
    after = Answer()
    worker.submit(Job(_request([1, 2, 3]), after.finish))
    assert after.wait().tokens == generate(worker.model, [[1, 2, 3]], 5).tokens[0]
    worker.stop()
    assert worker.cancelled == 1 and worker.completed == 1


def test_a_full_queue_is_refused_and_stop_refuses_what_is_left():
    worker = _worker(max_queue=2)
    held = Answer(hold=True)
    worker.submit(Job(_request([1]), held.finish))
    held.done.wait(30)
    waiting = [Answer(), Answer()]
    for answer in waiting:
        worker.submit(Job(_request([2]), answer.finish))
    with pytest.raises(RequestError, match="busy") as exc:
        worker.submit(Job(_request([3]), Answer().finish))
    assert exc.value.status == 503
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    held.release.set()
    stopper.join(30)
    assert all(isinstance(a.wait().error, Stopped) for a in waiting)
    with pytest.raises(Stopped):
        worker.submit(Job(_request([4]), Answer().finish))


DEFAULTS = Defaults(max_tokens=8, temperature=0.0, top_k=0, seed=0)


def test_request_fields_default_to_infer_settings_and_max_tokens_fits_the_context():
    tok = ByteTokenizer()
    got = parse_completion({"prompt": "hi"}, DEFAULTS, tok, 256, 48)
    assert got == CompletionRequest([104, 105], 8, 0.0, 0, 0, False)
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


def test_streamed_text_pieces_hold_back_a_split_character_and_add_up_to_the_text():
    ids = list("a€b".encode())  # € is three bytes
    stream = TextStream(ByteTokenizer())
    pieces = [stream.push([i]) for i in ids] + [stream.push([], final=True)]
    assert pieces == ["a", "", "", "€", "b", ""]
    cut = TextStream(ByteTokenizer())
    assert cut.push(ids[:2]) == "a" and cut.push([], final=True) == "\ufffd"
