"""EleutherAI's lm-evaluation-harness scores what `moesys serve` serves: its `local-completions` backend against a
real server process (tokenizing through the server's /tokenizer_info and /tokenize, prompts sent in batches) and
its `hf` backend against `moesys export ... export.format=hf` of the same checkpoint, on small tasks of all three
output types written here (multiple choice, rolling perplexity over more than one window, generation): the metrics
are equal and each sample's log-likelihood agrees within 1e-4 (fp32). `local-chat-completions` runs the generation
task through the chat route and gets `moesys infer`'s answers to the rendered chats."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from runtime.config import ModelConfig, MoesysConfig, TrainConfig
from runtime.data.tokenizer import EOS
from runtime.inference.generate import generate
from runtime.inference.load import load_model
from runtime.parallel.groups import build_groups
from runtime.serving.chat import chat_prompt
from runtime.train.loop import train
from runtime.train.run_setup import prepare_run_dir
from tests.cli.conftest import run_moesys, serving

pytestmark = [pytest.mark.extended, pytest.mark.slow]
lm_eval = pytest.importorskip("lm_eval")

CONTEXT = 128
MIXTRAL = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=260, ffn_hidden_size=64,
                      num_experts=4, top_k=2, expert_type="swiglu", norm="rmsnorm", bias=False, position="rope",
                      tie_embeddings=False, capacity_factor=0.0, max_seq_len=CONTEXT)
MC = [{"question": q, "choices": c, "answer": a} for q, c, a in [
    ("The cat sat on the", ["mat", "sky", "idea"], 0), ("Water is", ["dry", "wet", "loud"], 1),
    ("One, two,", ["three", "blue", "seven"], 0), ("The sun rises in the", ["west", "sea", "east"], 2),
    ("A mixture of", ["experts", "nothing", "rocks"], 0)]]
PPL = [{"text": t} for t in [
    "The quick brown fox jumps over the lazy dog.",
    "Experts outgrow the memory of one device, so they live on the host and on disk, and come to the device "
    "when a token is routed to them; the rest of the model stays resident and computes every token as it comes.",
    "short"]]
GEN = [{"question": q, "answer": a} for q, a in [("The cat sat on the", " mat"), ("Hello, my name is", " Ann"),
                                                 ("Once upon a time", " there"), ("1, 2, 3,", " 4")]]


def _checkpoint(root: Path) -> tuple[Path, Path]:
    """A Mixtral-style moesys run of one training step in this process (a near-random model, whose greedy answers
    differ from prompt to prompt), and its hf export by the real CLI."""
    cfg = MoesysConfig(model=MIXTRAL, train=TrainConfig(
        max_steps=1, micro_batch_size=2, seq_len=64, warmup_steps=1, run_dir=str(root / "run")))
    cfg.topology.nproc_per_node = 1
    run = prepare_run_dir(cfg)
    train(cfg, run, build_groups(1, 0, 1, 1), torch.device("cpu"))
    export = root / "hf"
    done = run_moesys("export", f"checkpoint={run}", f"out={export}", "export.format=hf", "export.dtype=fp32")
    assert done.returncode == 0, done.stderr
    assert json.loads((export / "tokenizer_config.json").read_text())["eos_token"] == EOS  # lm-eval's hf stops there
    return run, export


def _tasks(folder: Path) -> Path:
    """Three lm-eval tasks over JSONL files in `folder` (dataset_path: json)."""
    folder.mkdir()
    for name, rows in (("mc", MC), ("ppl", PPL), ("gen", GEN)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def data(name):
        return (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}.jsonl\n"
                "test_split: test\n")

    (folder / "moesys_mc.yaml").write_text(
        "task: moesys_mc\n" + data("mc") + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (folder / "moesys_ppl.yaml").write_text(
        "task: moesys_ppl\n" + data("ppl") + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n")
    (folder / "moesys_gen.yaml").write_text(
        "task: moesys_gen\n" + data("gen") + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return folder


def _evaluate(model: str, model_args: dict, tasks: list[str], folder: Path, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                                   task_manager=TaskManager(include_path=str(folder)), **kwargs)


def _loglikelihoods(results: dict, task: str) -> list[float]:
    """Each sample's log-likelihood of each of its requests, in document order."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [float(r[0] if isinstance(r, (list, tuple)) else r) for s in samples for r in s["filtered_resps"]]


def test_lm_eval_scores_moesys_serve_as_its_hf_backend_scores_the_export(tmp_path, monkeypatch):
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")  # nothing may be downloaded: the tokenizer comes from the server
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    run, export = _checkpoint(tmp_path)
    folder = _tasks(tmp_path / "tasks")
    tasks = ["moesys_mc", "moesys_ppl", "moesys_gen"]
    # windows of the same length on both sides: the API keeps one position of max_length for the token it asks for
    hf = _evaluate("hf", {"pretrained": str(export), "dtype": "float32", "device": "cpu", "max_length": CONTEXT - 2},
                   tasks, folder)
    with serving([f"checkpoint={run}", "--offload", "none", "serve.max_batch_size=4"], tmp_path / "serve.log") as (
            proc, url):
        api = _evaluate("local-completions", {
            "base_url": f"{url}/v1/completions", "model": run.name, "max_length": CONTEXT, "batch_size": 4,
            "max_retries": 1},  # perplexity windows start with the eos /tokenizer_info names
            tasks, folder)
        chat = _evaluate("local-chat-completions", {"base_url": f"{url}/v1/chat/completions", "model": run.name,
                                                    "max_retries": 1}, ["moesys_gen"], folder,
                         apply_chat_template=True)
    log = (tmp_path / "serve.log").read_text()
    assert "route=/tokenizer_info status=200" in log and "route=/tokenize status=200" in log  # its remote tokenizer
    assert " status=4" not in log and " status=5" not in log, log[-3000:]

    for task, metrics in (("moesys_mc", ["acc,none"]), ("moesys_ppl", ["word_perplexity,none",
                                                                       "byte_perplexity,none", "bits_per_byte,none"]),
                          ("moesys_gen", ["exact_match,none"])):
        for metric in metrics:
            assert math.isclose(api["results"][task][metric], hf["results"][task][metric], rel_tol=1e-5), (
                task, metric, api["results"][task], hf["results"][task])
    for task in ("moesys_mc", "moesys_ppl"):
        ours, theirs = _loglikelihoods(api, task), _loglikelihoods(hf, task)
        assert len(ours) == len(theirs) and max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4, (ours, theirs)
    generated = [s["filtered_resps"] for s in sorted(api["samples"]["moesys_gen"], key=lambda s: s["doc_id"])]
    assert generated == [s["filtered_resps"] for s in sorted(hf["samples"]["moesys_gen"], key=lambda s: s["doc_id"])]
    assert len({g[0] for g in generated}) == len(GEN)  # answers that differ: a mix-up of rows would show

    loaded = load_model(run)
    for sample in chat["samples"]["moesys_gen"]:
        question = GEN[sample["doc_id"]]["question"]
        ids = loaded.tokenizer.encode(chat_prompt(loaded.tokenizer, [{"role": "user", "content": question}]))
        answer = loaded.tokenizer.decode(generate(loaded.model, [ids], 8).tokens[0]).split("\n")[0]
        assert sample["filtered_resps"] == [answer]
