"""Usage errors as a user meets them on the real `moesys` command: a bad option value, an unknown subcommand or
option, a missing argument are each one line on stderr naming the help to read, and exit 2 (never a boxed panel)."""

import pytest

from tests.cli.conftest import run_moesys


@pytest.mark.parametrize("args, says", [
    (["serve", "--port", "abc"], "error: Invalid value for '--port'"),
    (["trian"], "error: No such command 'trian'"),
    (["tokenizer", "trian"], "error: No such command 'trian'. Did you mean 'train'?"),
    (["plan", "--bogus"], "error: No such option: --bogus"),
    (["bench"], "error: Missing argument"),
])
def test_a_usage_error_is_one_line_and_exit_2(args, says):
    done = run_moesys(*args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(says), done.stderr
    assert "--help" in lines[0] and "╭" not in done.stderr and done.stdout == ""


def test_help_and_a_command_without_its_subcommand_still_print_the_help():
    assert run_moesys("plan", "--help").returncode == 0
    bare = run_moesys("tokenizer")
    assert bare.returncode == 2 and "train" in bare.stdout
