"""runtime/launch/oom.py: torchrun's SIGKILL line is an OOM death only when the OOM-kill count went up; the one line and
the plan's fix for the memory really there. (The OOM killer itself: tests/cli/test_train_oom_e2e.py.)"""

from __future__ import annotations

from runtime.config import MoesysConfig, TopologyConfig
from runtime.launch.oom import OomWatch, oom_kills, oom_message, smallest_fix
from runtime.plan.budget import GB
from runtime.plan.planner import plan_placement

KILLED = ("E1123 21:58:01.000000 123 torch/distributed/elastic/multiprocessing/api.py:1003] failed (exitcode: -9) "
          "local_rank: 1 (pid: 4242) of binary: /usr/bin/python\n")


def test_a_sigkill_without_an_oom_kill_is_no_oom(tmp_path):
    log = tmp_path / "launcher.log"
    log.write_text("earlier launch\n" + KILLED)  # a line from before the watch began is not this launch's
    watch = OomWatch(log)
    assert watch.victim() is None and watch.killed == []
    with log.open("a") as f:
        f.write(KILLED + KILLED.replace("local_rank: 1", "local_rank: 0")[:40])  # the second line still written
    assert oom_kills() == watch.before  # nothing was OOM-killed here meanwhile: a user's kill -9, not memory
    assert watch.victim() is None and watch.killed == [1]


def test_the_line_names_rank_memory_estimate_and_fix():
    line = oom_message(3, "killed by the kernel's OOM killer", int(0.91 * GB), int(0.38 * GB), "try X")
    assert "\n" not in line
    assert line.startswith("rank 3 ran out of memory (killed by the kernel's OOM killer): last measured 0.91 GB, "
                           "plan estimate 0.38 GB per rank (2.39x); try X")


def test_the_fix_is_the_plan_rerun_with_the_memory_really_there():
    cfg = MoesysConfig(topology=TopologyConfig(nproc_per_node=2, expert_parallel=2, cpu_memory_gb=16))
    assert plan_placement(cfg).feasible
    short = smallest_fix(cfg, int(0.9 * GB), gpu=False)
    assert "topology.cpu_memory_gb=0.9" in short and "under-estimated" not in short
    ample = smallest_fix(cfg, 64 * GB, gpu=False)
    assert "under-estimated" in ample
