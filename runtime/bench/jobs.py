"""Where a training benchmark's jobs run: each is a real training job launched through the job API
(runtime/launch/job.py), so it is planned once and its run directory holds config.yaml and plan.json."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def job_root(prefix: str, workdir: Path | None = None) -> Iterator[Path]:
    """The directory a benchmark's run directories go in: `workdir`, kept for a look afterwards, or a temporary
    directory named `prefix`..., removed at the end."""
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        yield Path(workdir)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)
