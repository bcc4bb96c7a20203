"""runtime/train/metrics.py: on resume, metrics.jsonl keeps the lines up to the checkpoint and loses a torn one."""

from __future__ import annotations

import json

from runtime.files.run_dir import read_metrics
from runtime.train.metrics import MetricsWriter


def test_resume_drops_a_torn_last_line_and_the_steps_past_the_checkpoint(tmp_path):
    lines = [json.dumps({"step": s, "loss": 5.0 - s}) for s in (1, 2, 3)] + [json.dumps({"task": "a", "rank": 0})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "loss": 1.2')  # SIGKILL mid-write
    writer = MetricsWriter(tmp_path, resume_step=2)
    writer.write({"step": 3, "loss": 2.5})
    writer.file.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert [json.loads(line) for line in text.splitlines()] == [
        {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0}, {"task": "a", "rank": 0}, {"step": 3, "loss": 2.5}]


def test_read_metrics_skips_torn_and_non_object_lines(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n7\n\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1}]
