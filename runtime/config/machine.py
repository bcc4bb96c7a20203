"""The rates of a machine that bound a training step (issue: the offloaded step at its bound): copies between host
and device, the host's AdamW, the disk and the device's dense GEMM. `topology.*` keys; 0 leaves a rate to the
machine profile `moesys plan --measure` caches for this machine, else to its documented default
(runtime/plan/step_time.py DEFAULT_RATES)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MachineRates:
    """Fields of TopologyConfig: what one node of the topology moves and computes per second."""

    pcie_h2d_gbps: float = 0.0
    """Pinned host-to-device copy bandwidth of one GPU, GB/s; 0: this machine's profile, else 25."""
    pcie_d2h_gbps: float = 0.0
    """Pinned device-to-host copy bandwidth of one GPU, GB/s; 0: this machine's profile, else 25."""
    adamw_gparams_per_core: float = 0.0
    """Host AdamW rate of one CPU core (torch's fused kernel), billions of parameters a second; 0: this machine's
    profile, else 0.25."""
    cpu_cores_per_node: int = 0
    """CPU cores of one node that run the host optimizer and, without GPUs, the model; 0: this machine's usable
    cores with launcher=local, else 16."""
    disk_read_gbps: float = 0.0
    """Sequential read bandwidth of the disk the SSD store lives on, GB/s; 0: this machine's profile, else 2."""
    disk_write_gbps: float = 0.0
    """Sequential write bandwidth of that disk, GB/s; 0: this machine's profile, else 1."""
    gemm_tflops: float = 0.0
    """Dense GEMM TFLOP/s of one device at train.precision (a GPU; without GPUs, a node's CPU cores together); 0:
    this machine's profile, else 400 with GPUs, 0.1 without."""
    resident_mfu: float = 0.0
    """Share of gemm_tflops the resident training step reaches as its job runs it, collectives included (its MFU
    against that rate); 0: what `moesys plan --measure` measured for this model shape and node layout on this
    machine, else 0.4 with GPUs, 0.3 without."""

    RATE_BOUNDS = ((">= 0", "pcie_h2d_gbps pcie_d2h_gbps adamw_gparams_per_core cpu_cores_per_node disk_read_gbps "
                            "disk_write_gbps gemm_tflops"), ("between 0 and 1", "resident_mfu"))
