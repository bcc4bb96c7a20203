"""A node of a multinode job that lost the network: its workers end on train.collective_timeout_s, but torchrun's
agent can then block for many minutes in a call to the rendezvous store on the far side of the cut (seen with a
cut link: the call outlives its own timeout), so `moesys train` would hang. Watched from the launching command:
no worker left on this node and the rendezvous endpoint unreachable for `grace_s` means the job is lost here;
before this node's first workers, node 0 may not have been started yet, and the endpoint gets `join_grace_s`.
"""

from __future__ import annotations

import socket
import time

from runtime.launch.process import worker_pids


def reachable(endpoint: str, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to host:port opens within timeout_s."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class LostNodeWatch:
    """Polled by the command that follows torchrun (pid `agent_pid`); says once the job is lost on this node."""

    def __init__(self, agent_pid: int, endpoint: str, grace_s: float, join_grace_s: float | None = None,
                 probe_every_s: float = 2.0):
        self.agent_pid = agent_pid
        self.endpoint, self.grace_s, self.probe_every_s = endpoint, grace_s, probe_every_s
        self.join_grace_s = grace_s if join_grace_s is None else join_grace_s
        """The grace until this node's first workers start: the nodes' commands are started by hand, node 0's
        perhaps last (torchrun then gives up on its own, with a clearer error; this is the backstop)."""
        self.started = False
        """Whether this node's workers have run: the job got past its first rendezvous."""
        self._unreachable_since: float | None = None
        self._last_probe = 0.0
        self.reason: str | None = None
        """Set once lost() found the job lost."""

    def lost(self) -> str | None:
        """None while the job may go on; else why it cannot (the reason, for a one-line error)."""
        if worker_pids(self.agent_pid):  # they end on their own collective timeout
            self.started, self._unreachable_since = True, None
            return None
        now = time.monotonic()
        if now - self._last_probe < self.probe_every_s:
            return None
        self._last_probe = now
        if reachable(self.endpoint):
            self._unreachable_since = None
            return None
        if self._unreachable_since is None:
            self._unreachable_since = now
        waited = now - self._unreachable_since
        if waited < (self.grace_s if self.started else self.join_grace_s):
            return None
        if self.started:
            self.reason = (f"this node's workers have ended and the rendezvous endpoint {self.endpoint} has not "
                           f"answered for {waited:.0f} s (the network to node 0 is down, or node 0's moesys train is "
                           "gone)")
        else:
            self.reason = (f"no worker started on this node and the rendezvous endpoint {self.endpoint} has not "
                           f"answered for {waited:.0f} s (node 0's moesys train is not running, or the network to it "
                           "is down)")
        return self.reason
