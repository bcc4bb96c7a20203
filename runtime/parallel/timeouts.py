"""Name the collective that waited too long for a peer: a timed-out gloo call raises a RuntimeError whose traceback
still holds the torch.distributed function and the moesys function that called it (also inside autograd)."""

from __future__ import annotations

import traceback

from runtime.errors import JobError


def is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()


def collective_of(exc: BaseException) -> str:
    """`all_to_all_single in runtime/parallel/alltoall.py:_exchange` for the innermost collective in the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].filename.endswith("distributed_c10d.py"):
            caller = next((f for f in reversed(frames[:i]) if "/runtime/" in f.filename), None)
            where = f" in runtime/{caller.filename.split('/runtime/', 1)[1]}:{caller.name}" if caller else ""
            return f"{frames[i].name}{where}"
    return "a collective"


def timeout_error(exc: BaseException, step: int, timeout_s: float) -> JobError:
    return JobError(f"step {step}: {collective_of(exc)} waited more than train.collective_timeout_s={timeout_s:g} s "
                    "for a peer rank, which is stuck or died (its log is under RUN_DIR/logs; raise the timeout "
                    "for slow steps)")
