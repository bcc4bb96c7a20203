"""OpenAI's sampling settings against plain references of their definitions: logit_bias added to the logits,
presence and frequency penalties over the generated tokens (OpenAI's formula), nucleus (top_p) sampling, together
with temperature and top_k; the static decode step still reads nothing on the host with all of them on, and a
seed still fixes what a generation draws."""

import math

import pytest
import torch

from runtime.inference.decode import DecodeStep
from runtime.inference.errors import InferError
from runtime.inference.generate import generate
from runtime.inference.offloaders import make_offloader
from runtime.inference.sampling import Sampler, Sampling, sample_next, warped_logits
from runtime.inference.step_counts import count_decode
from tests.unit.inference.test_decode import MIXTRAL, PROMPT, _model

V = 12


def reference_probabilities(logits: list[float], s: Sampling, generated: list[int]) -> list[float]:
    """The distribution of the next token, each setting as OpenAI documents it: mu[j] + bias[j] - c[j] *
    frequency_penalty - (c[j] > 0) * presence_penalty, c[j] the times token j was generated; then / temperature,
    the k largest; the nucleus: the most likely tokens, in order, while those before hold less than top_p."""
    bias = dict(s.logit_bias)
    mu = [logits[j] + bias.get(j, 0.0) - generated.count(j) * s.frequency_penalty
          - (generated.count(j) > 0) * s.presence_penalty for j in range(len(logits))]
    if s.temperature == 0:
        best = max(range(len(mu)), key=lambda j: mu[j])
        return [1.0 if j == best else 0.0 for j in range(len(mu))]
    scaled = [m / s.temperature for m in mu]
    allowed = set(range(len(mu)))
    if 0 < s.top_k < len(mu):
        kth = sorted(scaled, reverse=True)[s.top_k - 1]
        allowed = {j for j in allowed if scaled[j] >= kth}
    total = sum(math.exp(scaled[j]) for j in allowed)
    probs = {j: math.exp(scaled[j]) / total for j in allowed}
    kept, before = set(), 0.0
    for j in sorted(probs, key=lambda j: -probs[j]):
        if before >= s.top_p:
            break
        kept.add(j)
        before += probs[j]
    mass = sum(probs[j] for j in kept)
    return [probs[j] / mass if j in kept else 0.0 for j in range(len(mu))]


def distribution(sampler: Sampler, logits_1V: torch.Tensor) -> torch.Tensor:
    """What the sampler draws from next: its adjusted, warped logits' softmax (or the one-hot greedy pick)."""
    s = sampler.sampling
    adjusted = sampler.adjusted(logits_1V)
    if s.greedy:
        return torch.nn.functional.one_hot(adjusted.argmax(-1), V).double()[0]
    return warped_logits(adjusted, s.temperature, s.top_k, s.top_p).softmax(-1).double()[0]


SETTINGS = [
    Sampling.of(logit_bias={3: 5.0, 7: -100.0}),
    Sampling.of(0.8, logit_bias={"0": 2.5}),
    Sampling.of(1.0, presence_penalty=1.5),
    Sampling.of(1.0, frequency_penalty=0.7),
    Sampling.of(0.0, presence_penalty=2.0, frequency_penalty=-0.5),
    Sampling.of(1.0, top_p=0.5),
    Sampling.of(1.3, top_p=0.9),
    Sampling.of(0.7, top_k=5, top_p=0.6, presence_penalty=0.4, frequency_penalty=0.9, logit_bias={1: 3.0}),
]


@pytest.mark.parametrize("s", SETTINGS, ids=str)
def test_each_setting_gives_its_definitions_distribution_step_after_step(s):
    gen = torch.Generator().manual_seed(1)
    sampler = Sampler(s, V, torch.device("cpu"), seed=5)
    sampler.begin(1)
    generated: list[int] = []
    for _ in range(8):
        logits = torch.randn(1, V, generator=gen) * 2
        want = reference_probabilities(logits[0].tolist(), s, generated)
        got = distribution(sampler, logits)
        assert torch.allclose(got, torch.tensor(want, dtype=torch.double), atol=1e-6), (got, want)
        token = int(sampler(logits)[0])
        assert want[token] > 0  # drawn from the support of the reference distribution
        generated.append(token)


def test_penalties_count_each_rows_own_tokens():
    s = Sampling.of(0.0, presence_penalty=0.5, frequency_penalty=1.0)
    sampler = Sampler(s, V, torch.device("cpu"))
    sampler.begin(2)
    logits = torch.zeros(2, V)
    logits[0, 4], logits[1, 7] = 2.9, 1.2
    generated: list[list[int]] = [[], []]
    for _ in range(5):
        want = [max(range(V), key=lambda j: reference_probabilities(logits[b].tolist(), s, generated[b])[j])
                for b in range(2)]
        got = sampler(logits).tolist()
        assert got == want
        for b in range(2):
            generated[b].append(got[b])
    assert generated == [[4, 4, 4, 0, 1], [7, 0, 1, 2, 3]]


def test_a_seed_fixes_the_draws_and_a_bias_outside_the_vocabulary_is_refused():
    s = Sampling.of(1.0, top_p=0.8, frequency_penalty=0.5)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))

    def draws(seed):
        sampler = Sampler(s, V, torch.device("cpu"), seed)
        sampler.begin(3)
        return [sampler(logits).tolist() for _ in range(6)]

    assert draws(3) == draws(3) and draws(3) != draws(4)
    with pytest.raises(InferError, match="logit_bias token id 12 is outside the vocabulary 0..11"):
        Sampler(Sampling.of(logit_bias={12: 1.0}), V, torch.device("cpu"))


def test_top_p_of_one_and_no_adjustment_leave_sample_next_as_it_was():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(Sampling.of(0.7, 3), 50, torch.device("cpu"), seed=9)
    sampler.begin(4)
    assert torch.equal(sampler(logits), sample_next(logits, 0.7, 3, torch.Generator().manual_seed(9)))


def test_every_setting_on_keeps_the_decode_step_free_of_host_syncs():
    model = _model(dtype=torch.bfloat16)
    offloader = make_offloader(model, "none", torch.device("cpu"))
    step = DecodeStep(model)
    s = Sampling.of(0.8, 5, 0.9, 0.5, 0.3, {3: 2.0})
    counts = count_decode(lambda n: generate(model, PROMPT, n, seed=2, offloader=offloader, step=step, sampling=s),
                          MIXTRAL.num_layers)
    assert counts.host_syncs_per_token == 0


def test_the_infer_keys_are_checked_and_give_moesys_infer_its_sampling():
    from runtime.config import config_from_dict
    from runtime.config.checks import ConfigError
    from runtime.inference.generate import infer_sampling

    inf = config_from_dict({"infer": {"temperature": 0.5, "top_p": 0.9, "presence_penalty": -1,
                                      "frequency_penalty": 2, "logit_bias": {104: 5, "7": -100}}}).infer
    assert infer_sampling(inf) == Sampling(0.5, 0, 0.9, -1.0, 2.0, ((7, -100.0), (104, 5.0)))
    for bad, message in (({"top_p": 0}, "infer.top_p must be in (0, 1] (got 0"),
                         ({"presence_penalty": 2.5}, "infer.presence_penalty must be between -2 and 2"),
                         ({"frequency_penalty": -3}, "infer.frequency_penalty must be between -2 and 2"),
                         ({"logit_bias": {"a": 1}}, "infer.logit_bias: key 'a' is not a token id"),
                         ({"logit_bias": {3: 101}}, "infer.logit_bias[3] must be between -100 and 100")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            config_from_dict({"infer": bad})
