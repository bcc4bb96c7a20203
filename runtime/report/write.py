"""`moesys report SOURCE [out=FILE.html]`: a run directory gives the training report, a `moesys infer --json` file
the inference report. Bad input (a missing source, a file that is no inference result, an unwritable out) is one
UserError line."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.errors import UserError
from runtime.report.inference import write_inference_report
from runtime.report.training import write_training_report

DEFAULT_NAME = "report.html"


def default_out(source: Path) -> Path:
    """RUN_DIR/report.html for a run; FILE.html beside an inference FILE.json."""
    return source / DEFAULT_NAME if source.is_dir() else source.with_suffix(".html")


def write_report(source: str | Path, out: str | Path | None = None) -> dict:
    """Write the page of `source` to `out` (default_out when None); the `moesys report --json` summary."""
    source = Path(source)
    if not source.exists():
        raise UserError(f"{source} does not exist; pass a run directory (train.run_dir of a moesys train run) or a "
                        "moesys infer --json file")
    out = Path(out) if out else default_out(source)
    if out.is_dir():
        raise UserError(f"out={out} is a directory; pass a file name, e.g. out={out / DEFAULT_NAME}")
    if not out.parent.is_dir():
        raise UserError(f"out={out}: the directory {out.parent} does not exist")
    try:
        if source.is_dir():
            return write_training_report(source, out)
        try:
            data = json.loads(source.read_text())
        except (ValueError, UnicodeDecodeError):
            raise UserError(f"{source} is neither a run directory nor a JSON file (moesys infer --json)") from None
        return write_inference_report(data, out, str(source))
    except OSError as exc:  # the page is written last, beside out: any other file named is one it read
        written = exc.filename is not None and Path(exc.filename).parent.resolve() == out.parent.resolve() \
            and Path(exc.filename).name.startswith((out.name, f".{out.name}."))
        if written or exc.filename is None:
            raise UserError(f"cannot write out={out}: {exc.strerror or exc}") from None
        raise UserError(f"cannot read {exc.filename}: {exc.strerror or exc}") from None
