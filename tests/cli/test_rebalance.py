"""`moesys rebalance` through the real command: Table 3, --write round trip, --from-run, bad input."""

from __future__ import annotations

import json

from tests.cli.conftest import run_moesys


def test_table_3_comes_out_and_the_written_recipe_trains(tmp_path):
    out = run_moesys("rebalance", "recipe=ufo-multitask", "--json", "--write", str(tmp_path / "bal.yaml"))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["allocation"] == {"task1": 4, "task2": 2, "task3": 1, "task4": 1}
    assert data["max_load_per_gpu"] == {"before": 256.0, "after": 128.0}
    dry = run_moesys("train", f"recipe={tmp_path / 'bal.yaml'}", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "recipe: ufo-multitask-rebalanced" in dry.stdout and "gpus: 4" in dry.stdout


def test_four_equal_gpus_is_the_paper_before_case():
    out = run_moesys("rebalance", "recipe=ufo-multitask", "topology.nproc_per_node=4",
                     "topology.expert_parallel=4", "topology.cpu_memory_gb=0.05", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["allocation"] == {"task1": 1, "task2": 1, "task3": 1, "task4": 1}
    assert data["max_load_per_gpu"]["after"] == 512


def test_from_run_uses_measured_speed(tmp_path):
    lines = [{"step": 1, "rank": r, "task": t, "samples_per_s": s}
             for r, (t, s) in enumerate([("task1", 10.0), ("task2", 10.0), ("task3", 5.0), ("task4", 10.0)])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = run_moesys("rebalance", "recipe=ufo-multitask", "--from-run", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["workload"]["task3"]["cost_per_sample"] == 2.0


def test_bad_input_is_one_line_exit_2(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"task": "task9", "samples_per_s": 3.0}) + "\n")
    cases = [
        ["recipe=ufo-multitask", "tasks.task2.batch_size=0"],
        ["recipe=ufo-multitask", "topology.nproc_per_node=2", "topology.expert_parallel=2",
         "topology.cpu_memory_gb=0.01"],
        ["recipe=ufo-multitask", "--from-run", str(tmp_path)],
        ["recipe=tiny"],
    ]
    for args in cases:
        out = run_moesys("rebalance", *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr


def test_an_unwritable_write_path_is_one_line_exit_2(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    for target in (tmp_path / "file" / "bal.yaml", tmp_path):
        out = run_moesys("rebalance", "recipe=ufo-multitask", "--write", str(target))
        assert out.returncode == 2, (out.stdout, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
        assert f"cannot write --write {target}" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no temporary file left behind


def test_gpus_without_memory_rebalance_without_a_traceback():
    out = run_moesys("rebalance", "recipe=ufo-multitask", "topology.nodes=1", "topology.gpus_per_node=8", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["allocation"] == {"task1": 4, "task2": 2, "task3": 1, "task4": 1}


def test_auto_expert_parallel_is_written_resolved(tmp_path):
    out = run_moesys("rebalance", "recipe=ufo-multitask", "topology.nproc_per_node=4", "topology.expert_parallel=auto",
                     "topology.cpu_memory_gb=0.05", "--json", "--write", str(tmp_path / "bal.yaml"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["gpus"] == 4 and "expert_parallel: 4\n" in (tmp_path / "bal.yaml").read_text()


def test_gpus_declared_without_memory_say_why_no_two_tasks_share_one():
    """topology.gpus_per_node on the recipe's CPU topology leaves topology.gpu_memory_gb at 0: no GPU has room for a
    second task, and the refusal says so (with a GPU's memory the tiny model's tasks pack two to a GPU)."""
    args = ["rebalance", "recipe=ufo-multitask", "topology.nodes=1", "topology.gpus_per_node=2",
            "topology.nproc_per_node=2", "topology.expert_parallel=auto",
            *(f"tasks.task{i}.batch_size=64" for i in range(1, 5))]
    out = run_moesys(*args)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("error: 4 tasks do not fit on 2 GPUs with at most 1 task(s) per GPU: "
                                 "topology.gpus_per_node=2 with topology.gpu_memory_gb=0 gives the GPUs no memory")
    packed = run_moesys(*args, "topology.gpu_memory_gb=80", "--json")
    assert packed.returncode == 0, packed.stderr
    assert json.loads(packed.stdout)["max_tasks_per_gpu"] >= 2
