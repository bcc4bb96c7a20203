"""Name the collective that waited too long for a peer: a timed-out gloo call raises a RuntimeError whose traceback
still holds the torch.distributed function and the moesys function that called it (also inside autograd)."""

from __future__ import annotations

import traceback


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than train.collective_timeout_s; a restart may help (a peer was stuck)."""


def is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()


def collective_of(exc: BaseException) -> str:
    """`all_to_all_single in runtime/parallel/alltoall.py:_exchange` for the innermost collective in the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [i for i, f in enumerate(frames) if "/runtime/" in f.filename]
    if not ours:
        return "a collective"
    caller = frames[ours[-1]]
    where = f"runtime/{caller.filename.split('/runtime/', 1)[1]}:{caller.name}"
    call = next((f.name for f in frames[ours[-1] + 1:] if f.filename.endswith("distributed_c10d.py")), None)
    # An asynchronous collective (Work.wait) leaves no torch.distributed frame: name where it was awaited.
    return f"{call} in {where}" if call else f"a collective (awaited in {where})"


def timeout_error(exc: BaseException, step: int, timeout_s: float) -> CollectiveTimeout:
    return CollectiveTimeout(f"step {step}: {collective_of(exc)} waited more than "
                             f"train.collective_timeout_s={timeout_s:g} s "
                             "for a peer rank, which is stuck or died (its log is under RUN_DIR/logs; raise the "
                             "timeout for slow steps)")
