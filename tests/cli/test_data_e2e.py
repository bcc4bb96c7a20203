"""Training on one's own text as a user runs it, with the installed command and real torchrun workers: a tokenizer
trained on their text, their corpus pre-tokenized, a run on the token file with held-out evaluation and the newest
checkpoints kept, a resume point that is gone refused, `moesys eval` of the run giving the run's number, and the hf
export carrying the tokenizer (AutoTokenizer's ids are moesys's; infer takes text). Bad input to each new key and
verb is one line, exit 2, nothing written. Resuming from a chosen step, bit for bit in every data format, is
tests/unit/train/test_resume.py and test_data_formats.py; the moesys export's tokenizer test_tokenizer_carried.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.data.text import CORPUS_DIR
from runtime.data.tokenizer import load_tokenizer
from tests.cli.conftest import FAST_TINY, refused, run_moesys

PROMPT = "The weather over the hills"


def ok(*args: str) -> dict | None:
    done = run_moesys(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout) if "--json" in args else None


def steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.extended
def test_a_users_tokenizer_and_token_file_train_evaluate_and_export(tmp_path):
    tok = tmp_path / "tok.json"
    trained = ok("tokenizer", "train", f"data={CORPUS_DIR}", "vocab_size=400", f"out={tok}", "--json")
    assert trained["vocab_size"] == 400
    corpus = ok("tokenize", f"data={CORPUS_DIR}", f"out={tmp_path / 'corpus.bin'}", f"train.tokenizer={tok}", "--json")
    assert corpus["dtype"] == "uint16" and corpus["tokens"] < 0.6 * corpus["text_bytes"]
    heldout = tmp_path / "heldout.jsonl"  # the held-out text as records under another key
    heldout.write_text("".join(json.dumps({"body": p}) + "\n" for p in
                               (CORPUS_DIR / "weather.txt").read_text().split("\n\n")))

    run_dir = tmp_path / "run"
    args = [*FAST_TINY, f"train.tokenizer={tok}", "model.vocab_size=400",
            f"train.data={tmp_path / 'corpus.bin'}", f"train.eval_data={heldout}", "train.data_text_key=body",
            "train.eval_every=2", "train.eval_windows=8", "train.max_steps=4", "train.checkpoint_every=1",
            "train.keep_checkpoints=2", f"train.run_dir={run_dir}"]
    summary = ok("train", *args, "--json")
    first = steps(run_dir)
    assert [s["step"] for s in first if "eval_loss" in s] == [2, 4]
    assert summary["eval_loss"] == first[-1]["eval_loss"] and first[-1]["eval_tokens"] == 8 * 64
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert kept == ["step_00000003", "step_00000004"]  # train.keep_checkpoints=2
    assert (run_dir / "checkpoints" / kept[-1] / "tokenizer.json").read_text() == load_tokenizer(tok).to_str()

    line = refused("train", *args, "train.resume_from=step_1")  # removed by keep_checkpoints
    assert "has no complete checkpoint of step 1 (it has: step_3, step_4)" in line

    evaluated = ok("eval", f"checkpoint={run_dir}", f"data={heldout}", "train.data_text_key=body",
                   "train.eval_windows=8", "--json")
    assert evaluated["tokens"] == first[-1]["eval_tokens"]  # one process against the run's two: the same windows
    assert evaluated["loss"] == pytest.approx(first[-1]["eval_loss"], rel=1e-4)
    assert evaluated["perplexity"] == pytest.approx(first[-1]["eval_perplexity"], rel=1e-3)

    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    out = tmp_path / "export-hf"
    exported = ok("export", f"checkpoint={run_dir}", f"out={out}", "export.format=hf", "--json")
    assert exported["tokenizer"] and exported["eos_token"] == "<|endoftext|>"
    ids = load_tokenizer(tok).encode(PROMPT)
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    assert auto(PROMPT)["input_ids"] == ids and (auto.eos_token_id, auto.pad_token_id) == (0, 0)  # its first ids
    answer = ok("infer", f"checkpoint={out}", f"prompt={PROMPT}", "infer.max_new_tokens=6", "--json")
    assert answer["prompt_tokens"] == [ids] and answer["text"] == [load_tokenizer(tok).decode(answer["tokens"][0])]


def test_bad_input_to_each_new_key_and_verb_is_one_line_and_writes_nothing(tmp_path):
    tok = tmp_path / "tok.json"
    ok("tokenizer", "train", f"data={CORPUS_DIR / 'weather.txt'}", "vocab_size=300", f"out={tok}")
    (tmp_path / "notes.jsonl").write_text('{"body": "a record without the text key"}\n')
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    run_dir = tmp_path / "run"
    train = ["train", *FAST_TINY, f"train.run_dir={run_dir}"]
    cases = [
        (train + [f"train.tokenizer={tmp_path / 'missing.json'}"], "train.tokenizer="),
        (train + [f"train.tokenizer={tok}", "model.vocab_size=256"], "has 300 tokens, more than model.vocab_size=256"),
        (train + [f"train.data={tmp_path / 'notes.jsonl'}"], "line 1 has no 'text' string (its keys: body)"),
        (train + [f"train.data={tmp_path / 'odd.bin'}"], "not a whole number of uint16 ids"),
        (train + ["train.keep_checkpoints=0"], "train.keep_checkpoints must be >= 1"),
        (train + ["train.resume_from=step_5"], "has no complete checkpoint of step 5 (it has: none)"),
        (["tokenizer", "train", f"data={CORPUS_DIR}", "vocab_size=100", f"out={tmp_path / 't.json'}"],
         "vocab_size=100 must be between 259"),
        (["tokenize", f"data={CORPUS_DIR}", f"out={tmp_path / 'c.txt'}"], "must end in .bin or .npy"),
        (["eval", f"checkpoint={tmp_path / 'norun'}", f"data={CORPUS_DIR}"], "no such directory"),
    ]
    for args, message in cases:
        assert message in refused(*args), args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.jsonl", "odd.bin", "tok.json"]
