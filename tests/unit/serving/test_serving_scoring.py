"""The worker's answers to what evaluation clients ask: several prompts in one request through the continuous
batcher (each prompt's choices its lone run's), a prompt scored (echo: each token's log-probability under the model's
own forward, max_tokens=0 even when it fills the context), best_of's n most likely of its candidates, and every
sampling setting seeded as `generate` (what `moesys infer` runs) seeds it."""

import torch

from runtime.inference.generate import generate
from runtime.inference.sampling import Sampling
from runtime.serving.protocol import CompletionRequest
from runtime.serving.worker import ServeJob
from tests.unit.serving.test_serving_worker import TINY, Answer, _held, _worker


def reference_scores(model, ids: list[int], top: int):
    """Token s's log-probability given tokens 0..s-1 and the `top` most likely there, from one plain forward."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [(float(logp[s - 1, ids[s]]), logp[s - 1].topk(top).indices.tolist()) for s in range(1, len(ids))]


def test_several_prompts_share_the_batch_and_each_choice_is_its_prompts_lone_run():
    worker = _worker(max_batch_size=4)
    first = _held(worker)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14, 15], [20]]
    sampling = Sampling.of(0.9, 8, 0.8, 0.5, 0.25, {7: 3.0})
    answer = Answer()
    worker.submit(ServeJob(CompletionRequest(prompts, 6, sampling, 4, n=2), answer.finish))
    first.release.set()
    choices = answer.wait().choices
    assert answer.error is None and [c.index for c in choices] == list(range(8))
    for c in choices:
        p, i = divmod(c.index, 2)
        assert c.prompt == p
        lone = generate(worker.model, [prompts[p]], 6, seed=4 + i, sampling=sampling).tokens[0]
        assert c.tokens == lone
    assert worker.batches < 8 * 5  # 8 sequences of 6 tokens shared decode steps
    assert worker.stop(30)


def test_echo_scores_the_prompt_as_the_models_forward_does_even_when_it_fills_the_context():
    worker = _worker(max_batch_size=2)
    full = list(range(3, 3 + TINY.max_seq_len))  # the whole context: only max_tokens=0 fits
    short = [40, 41, 42, 43]
    answer = Answer()
    worker.submit(ServeJob(CompletionRequest([full, short], 0, Sampling(), 0, logprobs=2, echo=True),
                           answer.finish))
    choices = answer.wait().choices
    assert answer.error is None and [len(c.tokens) for c in choices] == [0, 0]
    for c, ids in zip(choices, (full, short)):
        want = reference_scores(worker.model, ids, 2)
        assert len(c.prompt_logprobs) == len(ids) - 1
        for out, token, (logprob, top) in zip(c.prompt_logprobs, ids[1:], want):
            assert out.token == token and abs(out.logprob - logprob) < 1e-5
            assert [t for t, _ in out.top] == top
    scored_then_generated = Answer()
    worker.submit(ServeJob(CompletionRequest([short], 3, Sampling(), 0, logprobs=0, echo=True),
                           scored_then_generated.finish))
    c = scored_then_generated.wait().choices[0]
    assert c.tokens == generate(worker.model, [short], 3).tokens[0] and len(c.logprobs) == 3
    assert [o.logprob for o in c.prompt_logprobs] == [o.logprob for o in choices[1].prompt_logprobs]
    assert worker.stop(30)


def test_best_of_answers_the_n_candidates_of_highest_cumulative_logprob():
    worker = _worker(max_batch_size=4)
    prompts, sampling = [[1, 2, 3], [50, 60]], Sampling(1.5)
    answer = Answer()
    worker.submit(ServeJob(CompletionRequest(prompts, 5, sampling, 7, n=2, best_of=4), answer.finish))
    choices = answer.wait().choices
    assert [c.index for c in choices] == [0, 1, 2, 3]
    for p, ids in enumerate(prompts):
        candidates = []
        for i in range(4):  # candidate i samples with seed + i; its cumulative log-probability from a forward
            tokens = generate(worker.model, [ids], 5, seed=7 + i, sampling=sampling).tokens[0]
            score = sum(lp for lp, _ in reference_scores(worker.model, ids + tokens, 1)[len(ids) - 1:])
            candidates.append((-score, i, tokens))
        best = sorted(candidates)[:2]
        got = [c for c in choices if c.prompt == p]
        assert [c.tokens for c in got] == [tokens for _, _, tokens in best]
        assert all(abs(c.cumulative_logprob + score) < 1e-4 for c, (score, _, _) in zip(got, best))
    assert worker.stop(30)
