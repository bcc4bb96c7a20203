"""The exact torchrun command lines and sbatch script `moesys train` builds, and its dry run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moesys_cli.resolve import resolve_config
from runtime.launch.command import SAFE_RUN, WORKER_MODULE, build_launch, torchrun_prefix
from tests.cli.conftest import FAST_TINY, losses, run_moesys


def test_local_launch_is_one_standalone_node(tmp_path):
    cfg = resolve_config(["recipe=tiny", "train.max_restarts=5"])
    spec = build_launch(cfg, tmp_path)
    assert spec.argv == [*torchrun_prefix(), "--standalone", "--nnodes=1", "--nproc_per_node=2", "--max_restarts=5",
                         f"--log_dir={tmp_path / 'logs'}", "--redirects=3", "--no-python", sys.executable, "-u", "-c",
                         SAFE_RUN, WORKER_MODULE, str(tmp_path)]


def test_multinode_launch_uses_c10d_rendezvous(tmp_path):
    cfg = resolve_config(["recipe=tiny", "launcher=multinode", "topology.nodes=3", "launcher.node_rank=2",
                          "launcher.rdzv_endpoint=head:29400", "topology.expert_parallel=2"])
    argv = build_launch(cfg, tmp_path).argv
    # c10d orders the nodes itself (torchrun ignores --node_rank); node 0 hosts the rendezvous store.
    assert argv[len(torchrun_prefix()):][:5] == ["--nnodes=3", "--rdzv_backend=c10d", "--rdzv_endpoint=head:29400",
                                                 "--rdzv_id=moesys",
                                                 "--rdzv_conf=is_host=false,join_timeout=300,read_timeout=300"]
    assert f"--log_dir={tmp_path / 'logs' / 'node2'}" in argv  # the nodes share the run directory
    assert argv[-7:] == ["--no-python", sys.executable, "-u", "-c", SAFE_RUN, WORKER_MODULE, str(tmp_path)]


def test_slurm_script_runs_srun_torchrun_on_every_node(tmp_path):
    cfg = resolve_config(["recipe=gpt-moe-26b", "launcher=slurm", "launcher.partition=a100"])
    spec = build_launch(cfg, tmp_path)
    assert spec.argv == ["sbatch", str(tmp_path / "job.sbatch")]
    assert "#SBATCH --nodes=2" in spec.script and "#SBATCH --gpus-per-node=8" in spec.script
    assert "#SBATCH --partition=a100" in spec.script
    srun = [line for line in spec.script.splitlines() if line.startswith("srun ")][0]
    assert "--nproc_per_node=8" in srun and "--rdzv_backend=c10d" in srun and f"-c '{SAFE_RUN}' {WORKER_MODULE}" in srun
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in spec.script  # a fresh store every round


def shadowing_package(directory: Path) -> Path:
    """A runtime/ package in `directory` that fails when imported, as any other project's runtime/ would."""
    for package in (directory / "runtime", directory / "runtime" / "train"):
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("raise SystemExit('imported the working directory\\'s runtime/')\n")
    return directory


def test_the_worker_program_ignores_a_runtime_folder_in_the_working_directory_and_keeps_pythonpath(tmp_path):
    cwd = shadowing_package(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))  # this checkout's moesys
    plain = subprocess.run([sys.executable, "-m", "runtime.errors"], cwd=cwd, env=env, capture_output=True, text=True)
    assert "imported the working directory's runtime/" in plain.stderr  # what -m does
    safe = subprocess.run([sys.executable, "-c", SAFE_RUN, "runtime.launch.command"], cwd=cwd, env=env,
                          capture_output=True, text=True)
    assert safe.returncode == 0, safe.stderr


def test_dry_run_prints_config_and_command_and_runs_nothing(tmp_path):
    out = run_moesys("train", "recipe=tiny", f"train.run_dir={tmp_path / 'run'}", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "model:" in out.stdout and "--nproc_per_node=2" in out.stdout and WORKER_MODULE in out.stdout
    assert not (tmp_path / "run").exists()
    slurm = run_moesys("train", "recipe=gpt-moe-13b", "launcher=slurm", "--dry-run")
    assert "#!/bin/bash" in slurm.stdout and "srun " in slurm.stdout


def test_train_on_user_text_and_bad_data_path(tmp_path):
    text = tmp_path / "mine.txt"
    text.write_text("moesys trains on the text files you give it. " * 200)
    run_dir = tmp_path / "run"
    cwd = shadowing_package(tmp_path / "project")  # the workers import the installed moesys wherever it starts
    out = run_moesys("train", *FAST_TINY, f"train.data={text}", "train.max_steps=3", f"train.run_dir={run_dir}",
                     cwd=cwd)
    assert out.returncode == 0, out.stderr
    assert len(losses(run_dir)) == 3
    bad = run_moesys("train", "recipe=tiny", f"train.data={tmp_path / 'missing.txt'}")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "missing.txt" in bad.stderr and "Traceback" not in bad.stderr
    assert Path(run_dir / "config.yaml").exists()


def test_a_topology_with_more_gpus_than_this_machine_is_refused_before_launch(tmp_path):
    import pytest
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() >= 8:
        pytest.skip("this machine has the 8 GPUs the recipe declares")
    out = run_moesys("train", "recipe=gpt-moe-13b", f"train.run_dir={tmp_path / 'run'}")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "topology.gpus_per_node=8" in out.stderr and not (tmp_path / "run").exists()


def test_an_unwritable_run_dir_is_one_line_exit_2(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    out = run_moesys("train", "recipe=tiny", f"train.run_dir={tmp_path / 'file' / 'run'}")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot write the run directory {tmp_path / 'file' / 'run'}" in out.stderr
    assert "train.run_dir" in out.stderr


def _stand_in_sbatch(bin_dir: Path, output: str = "Submitted batch job 1", code: int = 0) -> Path:
    """An `sbatch` that records its arguments and answers like SLURM's."""
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/sh\necho "$@" > "{bin_dir}/args"\necho "{output}"\nexit {code}\n')
    sbatch.chmod(0o755)
    return bin_dir


def test_slurm_submits_and_says_how_to_follow_the_job(tmp_path, monkeypatch):
    import json
    import os
    bin_dir = _stand_in_sbatch(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    out = run_moesys("train", "recipe=tiny", "launcher=slurm", f"train.run_dir={run_dir}")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert (bin_dir / "args").read_text().split() == [str(run_dir / "job.sbatch")]
    assert "srun " in (run_dir / "job.sbatch").read_text() and (run_dir / "config.yaml").is_file()
    assert "submitted SLURM job 1" in out.stdout and "squeue -j 1" in out.stdout
    assert str(run_dir / "logs" / "slurm-1.out") in out.stdout
    data = json.loads(run_moesys("train", "recipe=tiny", "launcher=slurm", f"train.run_dir={run_dir}",
                                 "--json").stdout)
    assert data == {"run_dir": str(run_dir), "job_id": "1", "script": str(run_dir / "job.sbatch"),
                    "log": str(run_dir / "logs" / "slurm-1.out")}


def test_slurm_without_sbatch_or_with_a_failing_one_is_one_line_exit_2(tmp_path, monkeypatch):
    import os
    import sys
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", f"{empty}{os.pathsep}{Path(sys.executable).parent}")
    out = run_moesys("train", "recipe=tiny", "launcher=slurm", f"train.run_dir={tmp_path / 'run'}")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "sbatch" in out.stderr and "--dry-run" in out.stderr and not (tmp_path / "run").exists()
    bin_dir = _stand_in_sbatch(tmp_path / "bin", "sbatch: error: invalid partition specified: gpu", code=1)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = run_moesys("train", "recipe=tiny", "launcher=slurm", f"train.run_dir={tmp_path / 'run'}")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1 and "invalid partition specified" in out.stderr

