"""Generation: sampling, batching and the KV cache against a cache-free reference; `run_inference` on a moesys
run directory trained in-process (every offload mode matches none); bad input as one-line errors."""

import json

import pytest
import torch

from runtime.config import ModelConfig
from runtime.errors import UserError
from runtime.inference.generate import STOP_CHECK_EVERY, generate, run_inference
from runtime.inference.sampling import sample_next
from runtime.inference.errors import InferError
from runtime.inference.load import load_model
from runtime.model.transformer import Transformer
from tests.trained_run import train_run_dir

TINY = ModelConfig(hidden_size=32, num_layers=3, num_heads=2, vocab_size=256, ffn_hidden_size=64, num_experts=4,
                   top_k=2, max_seq_len=48)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real moesys run directory: 2 training steps of a 3-layer MoE, single process."""
    return train_run_dir(tmp_path_factory.mktemp("run"), TINY, steps=2, seq_len=32)


def _reference_greedy(model, prompt, n):
    """Recompute the whole sequence for every new token (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_kv_cache_and_batching_match_a_cache_free_reference():
    torch.manual_seed(0)
    model = Transformer(TINY).eval()
    prompts = [[5, 6, 7], [70, 80, 90, 100], [1, 2, 3], [200]]
    gen = generate(model, prompts, 5)
    with torch.no_grad():
        assert gen.tokens == [_reference_greedy(model, p, 5) for p in prompts]
    assert gen.prefill_tokens == sum(map(len, prompts)) and gen.decode_tokens == 4 * len(prompts)
    assert gen.prefill_tokens_per_s > 0 and gen.decode_tokens_per_s > 0


def test_each_prompt_ends_at_its_first_stop_token_and_a_stopped_batch_ends_early():
    torch.manual_seed(0)
    model = Transformer(TINY).eval()
    prompts = [[5, 6, 7], [70, 80, 90], [1, 2, 3, 4]]
    full = generate(model, prompts, 20, keep_logits=True)
    stop = full.tokens[0][2]
    expected = []
    for tokens in full.tokens:  # each row through its first stop id, as transformers' generate gives it
        cut = next((n + 1 for n, t in enumerate(tokens) if t == stop), len(tokens))
        expected.append(tokens[:cut])
    got = generate(model, prompts, 20, keep_logits=True, stop_ids=[stop, 9999])
    assert got.tokens == expected and [len(rows) for rows in got.logits] == list(map(len, expected))
    assert all(torch.equal(a, b[:len(a)]) for a, b in zip(got.logits, full.logits))
    alone = generate(model, prompts[:1], 20, stop_ids=[stop])  # stopped at its third token: looked at after 8
    assert alone.tokens == expected[:1] and alone.decode_tokens == STOP_CHECK_EVERY - 1


def test_sampling_greedy_top_k_and_seed():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]])
    assert sample_next(logits, 0.0, 0, None).tolist() == [1, 0]
    assert sample_next(logits, 1.0, 1, torch.Generator().manual_seed(0)).tolist() == [1, 0]
    draws = torch.stack([sample_next(logits, 5.0, 2, torch.Generator().manual_seed(s)) for s in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 3}  # only the top 2, both of them at a high temperature
    again = torch.stack([sample_next(logits, 5.0, 2, torch.Generator().manual_seed(s)) for s in range(200)])
    assert torch.equal(draws, again)


def test_bad_prompts_are_one_line_errors():
    model = Transformer(TINY).eval()
    cases = [([], "no prompt"), ([[]], "empty"), ([[1, 999]], "outside the vocabulary"),
             ([[1] * 40], "exceeds model.max_seq_len=48")]
    for prompts, message in cases:
        with pytest.raises(InferError, match=message) as exc:
            generate(model, prompts, 10)
        assert "\n" not in str(exc.value)


PROMPTS = ["the weather", "a machine"]


@pytest.fixture(scope="module")
def resident(run_dir):
    return run_inference(run_dir, {"max_new_tokens": 6}, prompts=PROMPTS, offload="none")


@pytest.mark.parametrize("offload,slots", [("ondemand", 1), ("ring", 1), ("ring", 3), ("auto", 1), ("auto", 2),
                                           ("auto", 3)])
def test_moesys_checkpoint_offload_modes_match_none(run_dir, resident, offload, slots):
    ref = resident
    got = run_inference(run_dir, {"max_new_tokens": 6, "ring_slots": slots}, prompts=PROMPTS, offload=offload)
    assert got["tokens"] == ref["tokens"] and got["text"] == ref["text"]
    assert got["prompt_tokens"][0] == list(b"the weather")
    all_experts = ref["peak_bytes"]["device"]["experts"]
    assert got["peak_bytes"]["device"]["experts"] * 3 == all_experts * slots  # K of the 3 layers' worth
    # host: the layers not resident on the device (auto on CUDA keeps K-1 resident: its K-th slot is a cache of
    # fetched experts); ring and ondemand: the whole store
    cuda = got["device"].startswith("cuda")
    resident = (slots - 1 if cuda and slots < 3 else slots) if offload == "auto" else 0
    assert got["peak_bytes"]["host"]["experts"] * 3 == all_experts * (3 - resident)
    if offload == "auto":
        streamed = "hybrid" if cuda else "inplace"
        assert got["placement"] == ["resident"] * resident + [streamed] * (3 - resident)
        assert (got["store_bytes_per_token"] > 0) == (slots < 3) and got["copied_bytes"] == 0
    assert json.loads(json.dumps(got)) == got  # JSON-ready


def test_auto_prefetch_of_predicted_experts_keeps_the_tokens_and_counts_its_guesses(run_dir, resident):
    got = run_inference(run_dir, {"max_new_tokens": 6, "ring_slots": 1, "prefetch": True}, prompts=PROMPTS)
    assert got["tokens"] == resident["tokens"]
    guesses = got["prefetch"]
    assert guesses["routed"] > 0 and guesses["predicted_right"] + guesses["predicted_wrong"] > 0


def test_moesys_checkpoint_logits_match(run_dir):
    from runtime.inference.offloaders import make_offloader
    ref_model = load_model(run_dir).model
    ring_model = load_model(run_dir).model
    off = make_offloader(ring_model, "ring", torch.device("cpu"), 2)
    prompts = [list(b"history of"), list(b"weather")]
    ref = generate(ref_model, prompts, 4, keep_logits=True)
    got = generate(ring_model, prompts, 4, offloader=off, keep_logits=True)
    off.close()
    assert got.tokens == ref.tokens
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bad_checkpoints_and_inputs(run_dir, tmp_path):
    cases = [
        (tmp_path / "nowhere", {}, "no such directory"),
        (run_dir, {"ring_slots": 4, "offload": "ring"},
         "infer.ring_slots=4 must be between 1 and the model's 3 MoE layers"),
        (run_dir, {"ring_slots": 0}, "infer.ring_slots must be >= 1"),
        (run_dir, {"max_new_tokens": 40}, "exceeds model.max_seq_len=48"),
        (run_dir, {"max_new_tokens": 4, "prompt": None}, "no prompt"),
        (run_dir, {"ring_sots": 2}, "did you mean ring_slots"),
        (run_dir, {"compile": "maybe"}, "infer.compile='maybe' is not a bool"),
    ]
    for path, overrides, message in cases:
        prompts = None if "prompt" in overrides else ["hello world"]
        with pytest.raises(UserError, match=message) as exc:
            run_inference(path, overrides, prompts=prompts)
        assert "\n" not in str(exc.value)
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    with pytest.raises(InferError, match="no complete checkpoint"):
        run_inference(empty, prompts=["x"])


def test_corrupt_checkpoint(run_dir, tmp_path):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    step = next((broken / "checkpoints").glob("step_*"))
    experts = step / "experts-ep0.safetensors"
    experts.write_bytes(experts.read_bytes()[:100])
    with pytest.raises(UserError, match="experts-ep0.safetensors.*damaged") as exc:
        run_inference(broken, prompts=["x"])
    assert "\n" not in str(exc.value)
