"""`moesys plan` through the real command: tables, --json contract, exit codes 0 / 1 / 2, one-line errors."""

from __future__ import annotations

import json

import pytest

from tests.cli.conftest import run_moesys


def test_plan_13b_table_and_json(tmp_path):
    table = run_moesys("plan", "recipe=gpt-moe-13b", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "13.9B parameters" in table.stdout and "16D + 4aS/L <= M_GPU*N" in table.stdout
    out = run_moesys("plan", "recipe=gpt-moe-13b", "--json", cwd=tmp_path)
    data = json.loads(out.stdout)
    for key in ("total", "dense", "sparse", "active", "embedding"):
        assert isinstance(data["params"][key], int)
    assert {"alpha", "layers", "nodes"} <= set(data["budget"])
    for tier in ("gpu", "cpu", "ssd"):
        assert {"required_bytes", "capacity_bytes", "ok"} <= set(data["budget"]["tiers"][tier])
    assert data["feasible"] is True and "placement" in data and "per_rank" in data


def test_plan_that_does_not_fit_exits_1_and_says_why(tmp_path):
    out = run_moesys("plan", "recipe=gpt-moe-207b", "topology.nodes=1", "topology.expert_parallel=8",
                     "storage.offload=auto", "train.precision=bf16", "topology.cpu_memory_gb=256", "--json",
                     cwd=tmp_path)  # bf16: offload does not support fp16
    assert out.returncode == 1
    data = json.loads(out.stdout)
    assert data["feasible"] is False and data["problems"] and data["suggestions"]


def test_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path):
    for args in (["recipe=nope"], ["model.num_expert=3"], ["model.top_k=99"], ["model.hidden_size=abc"]):
        out = run_moesys("plan", *args, cwd=tmp_path)
        assert out.returncode == 2, args
        assert out.stdout == "" and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert out.stderr.startswith("error: ")


def test_version_and_module_entry(tmp_path):
    import subprocess
    import sys
    assert run_moesys("--version").stdout.startswith("moesys ")
    out = subprocess.run([sys.executable, "-m", "moesys_cli", "plan", "--json"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0 and json.loads(out.stdout)["recipe"] == "tiny"


def test_a_tier_with_no_capacity_is_named_not_a_traceback(tmp_path):
    args = ["plan", "recipe=ufo-multitask", "topology.nodes=1", "topology.gpus_per_node=8", "topology.ssd_gb=0"]
    out = run_moesys(*args, cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "GPU tier holds at no node count" in " ".join(out.stdout.split())
    data = json.loads(run_moesys(*args, "--json", cwd=tmp_path).stdout)
    assert data["budget"]["min_nodes"] is None and set(data["budget"]["unsatisfiable"]) == {"gpu", "ssd"}


def test_a_huge_model_gets_its_answer_quickly(tmp_path):
    out = run_moesys("plan", "recipe=tiny", "model.hidden_size=10000000", "--json", cwd=tmp_path, timeout=60)
    assert out.returncode == 1 and json.loads(out.stdout)["suggestions"]


def test_the_mixtral_serving_recipe_is_judged_as_serving(tmp_path):
    out = run_moesys("plan", "recipe=mixtral-8x7b", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stdout
    data = json.loads(out.stdout)
    assert data["purpose"] == "serve" and data["inference"]["ok"] and data["training"]["feasible"] is False
    train = run_moesys("plan", "recipe=mixtral-8x7b", "purpose=train", "--json", cwd=tmp_path)
    assert train.returncode == 1
    suggestions = json.loads(train.stdout)["suggestions"]
    assert suggestions and not any("micro_batch_size" in s or "micro-batch," in s for s in suggestions)
    bad = run_moesys("plan", "purpose=deploy", cwd=tmp_path)
    assert bad.returncode == 2 and "purpose='deploy' is not one of train, serve" in bad.stderr


def test_every_verb_sees_auto_expert_parallel_resolved(tmp_path):
    out = run_moesys("plan", "recipe=gpt-moe-207b", "topology.nodes=1", "topology.gpus_per_node=8", "--json",
                     cwd=tmp_path)
    assert out.returncode in (0, 1), out.stderr
    assert any("topology.expert_parallel=8 ranks" in a for a in json.loads(out.stdout)["assumptions"])
    dry = run_moesys("train", "recipe=tiny", "topology.expert_parallel=auto", "topology.nproc_per_node=4",
                     "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0 and "expert_parallel: 4\n" in dry.stdout


def test_a_run_launched_here_is_planned_against_this_machines_ram(tmp_path):
    """topology.cpu_memory_gb can declare more RAM than this machine has: moesys train refuses such a launch, so the
    plan says so too, unless the job is launched elsewhere (SLURM)."""
    big = ["recipe=tiny", "topology.cpu_memory_gb=100000", "topology.ssd_gb=100000", "model.num_experts=64",
           "model.ffn_hidden_size=16384", "model.hidden_size=4096", "model.num_heads=32"]
    out = run_moesys("plan", *big, "--json", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    data = json.loads(out.stdout)
    assert data["training"]["feasible"] and not data["feasible"]
    (problem,) = data["problems"]
    assert problem.startswith("launched here (launcher=local) topology.nproc_per_node=2 CPU processes need")
    assert "topology.cpu_memory_gb=100000 is more than this machine has; moesys train would refuse it" in problem
    assert run_moesys("plan", *big, "launcher=slurm", cwd=tmp_path).returncode == 0


def test_a_recipes_lr_on_a_much_wider_model_is_warned_about(tmp_path):
    wide = ["recipe=tiny", "model.hidden_size=2048", "model.num_heads=16"]
    out = run_moesys("plan", *wide, "--json", cwd=tmp_path)
    (warning,) = json.loads(out.stdout)["warnings"]
    assert out.stderr == f"warning: {warning}\n" and "train.lr=0.003 is recipe tiny's" in warning
    dry = run_moesys("train", *wide, "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0 and dry.stderr == f"warning: {warning}\n"
    for quiet in (["recipe=tiny"], [*wide, "train.lr=1e-4"]):
        out = run_moesys("plan", *quiet, "--json", cwd=tmp_path)
        assert json.loads(out.stdout)["warnings"] == [] and out.stderr == ""


def test_the_plan_shows_what_a_run_writes_to_disk_and_judges_it(tmp_path):
    """A Mixtral-shaped model of 4 layers on one GPU with 60 GB of disk: its checkpoints alone are 73 GB each."""
    run = ["model=mixtral-8x7b", "model.num_layers=4", "storage=cpu", "train.micro_batch_size=2",
           "train.seq_len=2048", "train.precision=bf16", "train.lr=1e-4", "topology.gpus_per_node=1",
           "topology.gpu_memory_gb=80", "topology.nproc_per_node=1", "topology.expert_parallel=1",
           "topology.cpu_memory_gb=128", "topology.ssd_gb=60"]
    out = run_moesys("plan", *run, cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    text = " ".join(out.stdout.split())
    assert "disk written: 3 checkpoints of 72.81 GB at once = 218.42 GB" in text
    assert "does not fit: disk per node 218.42 GB (3 checkpoints of 72.81 GB) > topology.ssd_gb=60 GB" in text
    assert "try: train.checkpoint_every=0 train.final_checkpoint=false fits" in text
    data = json.loads(run_moesys("plan", *run, "--json", cwd=tmp_path).stdout)
    assert data["disk"]["expert_store_bytes"] == 0 and data["disk"]["checkpoints_on_disk"] == 3
    fixed = run_moesys("plan", *run, "train.checkpoint_every=0", "train.final_checkpoint=false", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stdout


def test_the_papers_fp16_recipe_offloads_when_the_model_outgrows_the_gpu():
    """gpt-moe-13b trains in fp16 as the paper does: offloading it is advised, and it fits, without a precision
    change (fp16 works with every offload mode: the loss scale's overflow check covers the CPU optimizer)."""
    from moesys_cli.resolve import resolve_config
    from runtime.plan.planner import plan_placement

    args = ["recipe=gpt-moe-13b", "topology.gpus_per_node=1", "topology.gpu_memory_gb=40"]
    plan = plan_placement(resolve_config(args))
    assert not plan.feasible and "storage.offload=cpu fits" in plan.suggestions
    cfg = resolve_config([*args, "storage.offload=cpu"])
    assert cfg.train.precision == "fp16" and plan_placement(cfg).feasible


@pytest.mark.extended
def test_the_plan_says_how_many_moe_layers_the_gpu_could_keep(tmp_path):
    """Offloaded training on a GPU with memory to spare: the plan names the most layers storage.resident_layers
    could keep there (their update then leaves the CPU optimizer); the plan with that many still fits, with one
    more it does not, or no layer would be left offloaded."""
    shape = ["recipe=tiny", "topology=local", "model=mixtral-8x7b", "model.num_layers=8", "model.hidden_size=2048",
             "model.num_heads=16", "model.num_kv_heads=4", "model.ffn_hidden_size=5632", "train.precision=bf16",
             "train.micro_batch_size=4", "train.seq_len=2048", "train.lr=1e-4", "topology.detect=false",
             "topology.gpus_per_node=1", "topology.cpu_memory_gb=128", "topology.gpu_memory_gb=40", "storage=cpu"]

    def plan(*extra):
        out = run_moesys("plan", *shape, *extra, "--json", cwd=tmp_path)
        return json.loads(out.stdout)

    fit = plan()["placement"]["resident_layers_fit"]
    assert 0 < fit < 7
    assert plan(f"storage.resident_layers={fit}")["feasible"]
    assert not plan(f"storage.resident_layers={fit + 1}")["feasible"]
    table = run_moesys("plan", *shape, cwd=tmp_path)
    assert f"storage.resident_layers={fit} takes their update off the CPU optimizer" in " ".join(table.stdout.split())
    assert plan("topology.gpus_per_node=0")["placement"]["resident_layers_fit"] == 0  # no GPU: nothing leaves the CPU


def test_compare_with_a_foreign_config_names_the_file(tmp_path):
    for name, text in (("keys", "x: 1\nmodel: {}\n"), ("list", "- a\n- b\n"), ("torn", "model: [\n")):
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(text)
        (run / "metrics.jsonl").write_text("")
        out = run_moesys("plan", "--compare", str(run))
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{run / 'config.yaml'} is not a moesys run's config" in lines[0], out.stderr
