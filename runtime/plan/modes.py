"""The names a plan decides with: where expert states live (OffloadMode, what storage.offload asks for) and the tiers
of Eq. 1 (TierName). Everything outside the plan reads these, never the config's strings."""

from __future__ import annotations

from enum import Enum

AUTO = "auto"
"""storage.offload=auto: the plan takes the first mode that fits, in MODES' order."""


class TierName(str, Enum):
    """A storage tier of Eq. 1: the device (a GPU, or without one a pool in host RAM), host RAM, SSD."""

    GPU = "gpu"
    CPU = "cpu"
    SSD = "ssd"

    def __str__(self) -> str:
        return self.value


class OffloadMode(str, Enum):
    """Where a run's expert states live: on the device (none), in host memory (cpu, the paper's CPU tier), or on
    SSD behind the LFU cache of Algorithm 2 (ssd)."""

    NONE = "none"
    CPU = "cpu"
    SSD = "ssd"

    def __str__(self) -> str:
        return self.value

    @property
    def offloaded(self) -> bool:
        """Expert states live off the device: the offload engine moves them."""
        return self is not OffloadMode.NONE

    @property
    def home(self) -> TierName:
        """The tier of Eq. 1 that holds the expert states between uses."""
        return {OffloadMode.NONE: TierName.GPU, OffloadMode.CPU: TierName.CPU, OffloadMode.SSD: TierName.SSD}[self]


MODES = (OffloadMode.NONE, OffloadMode.CPU, OffloadMode.SSD)
"""Every mode, in the order auto tries them: the first that fits keeps the most on the device."""


def requested_modes(offload: str) -> tuple[OffloadMode, ...]:
    """The modes a storage.offload value allows: every one for auto, else the one it names."""
    return MODES if offload == AUTO else (OffloadMode(offload),)
