"""Small rendering helpers shared by the verbs: byte sizes, JSON output, one-line errors.

User text (paths, prompts, quoted logs) is data, never rich markup: `[/x]` in a path must print as itself.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text
from typer import Exit

console = Console()
err_console = Console(stderr=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def human_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))


def print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def error(message: str) -> None:
    """One line on stderr; the message is printed literally (it quotes paths and worker logs)."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True)


def notice(message: str) -> None:
    """One line on stderr that is not an error (a stop the user asked for), printed literally."""
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """One line on stderr that does not stop the command; printed literally."""
    err_console.print(Text.assemble(("warning:", "bold yellow"), " ", message), highlight=False, soft_wrap=True)


def literal(value: object) -> str:
    """User or quoted text to embed in a markup string, escaped so that rich prints it as written."""
    return escape(str(value))


class ByteProgress:
    """A bar per source of the bytes read so far (tokenizing a corpus), as `progress(key, done, total)`; a source
    under `smallest` bytes shows none (it is done before a bar would be read). A context manager."""

    def __init__(self, quiet: bool = False, smallest: int = 0):
        self.quiet, self.smallest = quiet, smallest
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                             TimeRemainingColumn(), console=console, transient=False)
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, key: str, done: int, total: int) -> None:
        if self.quiet or total < self.smallest:
            return
        if key not in self.tasks:
            if not self.tasks:
                self.bars.start()
            self.tasks[key] = self.bars.add_task(f"tokenizing {escape(key)}", total=total)
        self.bars.update(self.tasks[key], completed=done)

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, *exc) -> None:
        if self.tasks:
            self.bars.stop()


@contextmanager
def interrupted_writes_nothing() -> Iterator[None]:
    """Around a verb whose every write is atomic (tokenize, tokenizer train, export): Ctrl-C says that nothing was
    written, in one line, and exits 130 as a shell expects of SIGINT."""
    try:
        yield
    except KeyboardInterrupt:
        notice("interrupted: nothing written")
        raise Exit(130) from None
