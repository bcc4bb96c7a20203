"""Held-out evaluation: the loss is the mean next-token cross-entropy over the first windows (padding never counts),
the loop records it every train.eval_every steps and at the last in metrics.jsonl, TensorBoard and the report without
changing the training by a bit, and `moesys eval`'s number for the final checkpoint is the loop's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime.config import ConfigError, MoesysConfig, TrainConfig, config_from_dict
from runtime.model.transformer import Transformer
from runtime.parallel.groups import build_groups
from runtime.report.training import write_training_report
from runtime.train.run_setup import prepare_run_dir
from runtime.files.run_dir import read_metrics
from runtime.data.dataset import TokenDataset
from runtime.train.evaluate import evaluate_checkpoint, heldout_sums, summary
from runtime.train.loop import train
from runtime.data.text import CORPUS_DIR
from tests.trained_run import SMALL_MOE

HELDOUT = CORPUS_DIR / "weather.txt"


def config(run_dir: Path, **train_keys) -> MoesysConfig:
    keys = {"max_steps": 5, "micro_batch_size": 2, "seq_len": 16, "warmup_steps": 1, "checkpoint_every": 0,
            "run_dir": str(run_dir), **train_keys}
    cfg = MoesysConfig(model=SMALL_MOE, train=TrainConfig(**keys))
    cfg.topology.nproc_per_node = 1
    return cfg


def records(cfg: MoesysConfig) -> list[dict]:
    path = prepare_run_dir(cfg)
    train(cfg, path, build_groups(1, 0, 1, 1), torch.device("cpu"))
    return [m for m in read_metrics(path) if "loss" in m]


def test_the_loss_is_the_mean_over_every_target_of_the_first_windows_and_padding_never_counts():
    torch.manual_seed(0)
    model = Transformer(SMALL_MOE).eval()
    data = TokenDataset(torch.arange(200) % 256, seq_len=16)
    for count in (1, 5, 6):  # micro batch 4: a partly padded last batch, and one that fits
        loss_sum, tokens = heldout_sums(model, data, count, build_groups(1, 0, 1, 1), 4, torch.device("cpu"))
        windows = data.stack([data.window_at(i) for i in range(count)])
        with torch.no_grad():
            want = F.cross_entropy(model(windows[:, :-1]).logits.flatten(0, 1), windows[:, 1:].flatten(),
                                   reduction="sum")
        assert tokens == count * 16 and loss_sum == pytest.approx(float(want), rel=1e-6)
    result = summary(loss_sum, tokens)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))


def test_the_loop_records_it_at_its_steps_without_changing_the_training(tmp_path):
    plain = records(config(tmp_path / "plain"))
    cfg = config(tmp_path / "eval", eval_data=str(HELDOUT), eval_every=2, eval_windows=6, tensorboard=True)
    evaluated = records(cfg)
    assert [m["loss"] for m in evaluated] == [m["loss"] for m in plain]  # bit for bit: eval draws no randomness
    assert [m["step"] for m in evaluated if "eval_loss" in m] == [2, 4, 5]
    last = evaluated[-1]
    assert last["eval_tokens"] == 6 * 16 and last["eval_perplexity"] == pytest.approx(math.exp(last["eval_loss"]))
    checked = evaluate_checkpoint(tmp_path / "eval", str(HELDOUT), {"eval_windows": 6})
    assert (checked["loss"], checked["tokens"]) == (last["eval_loss"], last["eval_tokens"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "eval" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("eval_loss")] == [2, 4, 5]
    assert events.Scalars("eval_perplexity")[-1].value == pytest.approx(last["eval_perplexity"], rel=1e-6)
    report = write_training_report(tmp_path / "eval")
    assert report["eval"] == {"step": 5, "loss": last["eval_loss"], "perplexity": last["eval_perplexity"],
                              "tokens": 96}
    assert "held-out loss" in Path(report["out"]).read_text()


@pytest.mark.parametrize("train_keys,message", [
    ({"eval_every": -1}, "train.eval_every must be >= 0"),
    ({"eval_windows": -2}, "train.eval_windows must be >= 0"),
    ({"data_text_key": ""}, "train.data_text_key is empty"),
    ({"tokenizer": ""}, "train.tokenizer is empty"),
])
def test_bad_evaluation_and_data_keys_are_one_line(train_keys, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"train": train_keys})


def test_eval_data_with_task_heads_is_refused():
    data = {"train": {"eval_data": str(HELDOUT)}, "tasks": {"a": {"batch_size": 1}, "b": {"batch_size": 1}}}
    with pytest.raises(ConfigError, match="train.eval_data measures a language model"):
        config_from_dict(json.loads(json.dumps(data)))


def test_moesys_eval_gives_a_runs_number_for_its_hf_export_in_the_tokenizer_it_carries(tmp_path):
    from dataclasses import replace

    from runtime.inference.export import export_checkpoint

    mixtral = replace(SMALL_MOE, expert_type="swiglu", norm="rmsnorm", position="rope", bias=False,
                      tie_embeddings=False)
    cfg = config(tmp_path / "run", max_steps=1)
    cfg.model = mixtral
    records(cfg)
    export_checkpoint(tmp_path / "run", tmp_path / "hf", "hf")
    keys = {"seq_len": 16, "eval_windows": 6}  # an hf export keeps no train.seq_len: give the run's
    run, hf = (evaluate_checkpoint(tmp_path / where, str(HELDOUT), keys) for where in ("run", "hf"))
    assert hf["tokens"] == run["tokens"] == 96 and hf["loss"] == pytest.approx(run["loss"], rel=1e-5)
