"""The CLI starts without torch (1.3 s of import): plan, config, rebalance, --help and every refusal before a
launch answer at once; only the verbs that compute load it."""

import subprocess
import sys


def test_the_cli_and_the_planner_import_without_torch():
    code = ("import sys, moesys_cli.app, runtime.plan.planner, runtime.plan.rebalance, "
            "runtime.train.preflight; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
