"""The machine a memory plan is made for: its RAM, its /dev/shm, and the share of its RAM Ray's memory
monitor leaves a run. Read here (this host now), or given (`--host-gib`, or the node the store will live on)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

GIB = 2**30
RAY_THRESHOLD_ENV = "RAY_memory_usage_threshold"
RAY_DEFAULT_THRESHOLD = 0.95  # Ray's own default
PRIVATE_THRESHOLD = 0.98  # a private instance's (launch/control/cluster.py starts it so)


def shm_free_bytes(shm_dir: str = "/dev/shm") -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def mem_available_bytes() -> int:
    """The kernel's MemAvailable: RAM that can be had without swapping (page cache and the like included)."""
    return int(psutil.virtual_memory().available)


def mem_total_bytes() -> int:
    return int(psutil.virtual_memory().total)


def monitor_room(avail: int, threshold: float | None, total: int | None = None) -> int | None:
    """RAM a run may still take before Ray's memory monitor fires: what is available less the share of the
    node's RAM the monitor keeps free (shared memory counts as used: it is not reclaimable)."""
    if threshold is None:
        return None
    return avail - int((1 - threshold) * (mem_total_bytes() if total is None else total))


@dataclass(frozen=True, kw_only=True)
class Machine:
    """A node's memory as a plan sees it: RAM available and in all, free in the store's shm_dir, and Ray's
    memory-monitor threshold there (a fraction of RAM in use; None: no Ray, nothing is killed for it)."""

    ram: int  # MemAvailable
    total: int  # MemTotal
    shm: int  # free in ipc.shm_dir
    threshold: float | None
    note: str = ""  # how the figures were had, where not measured on this host now

    @property
    def limit(self) -> int:
        """What a run may take: what is available, less what Ray's memory monitor keeps free."""
        room = monitor_room(self.ram, self.threshold, self.total)
        return self.ram if room is None else min(self.ram, room)


def run_threshold(inprocess: bool, joins_cluster: bool) -> float | None:
    """The memory-monitor threshold a run's Ray has: the user's RAY_memory_usage_threshold, else a private
    instance's, else (joining a cluster) Ray's default; none with the in-process runner (no Ray)."""
    if inprocess:
        return None
    if RAY_THRESHOLD_ENV in os.environ:
        return float(os.environ[RAY_THRESHOLD_ENV])
    return RAY_DEFAULT_THRESHOLD if joins_cluster else PRIVATE_THRESHOLD


def gpu_driver_present() -> bool:
    """Whether this process may see a CUDA GPU, told without importing torch (seconds of a plan on a small
    machine): False only where it surely sees none (CUDA_VISIBLE_DEVICES hides every device, or neither the
    NVIDIA driver's device list nor a device node exists); otherwise torch answers (local_gpus)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    listed = os.path.isdir("/proc/driver/nvidia/gpus") and bool(os.listdir("/proc/driver/nvidia/gpus"))
    nodes = any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev"))
    return listed or nodes


def local_gpus() -> int:
    """The CUDA GPUs this process sees; torch is imported only where a GPU may be there."""
    if not gpu_driver_present():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def this_machine(shm_dir: str, threshold: float | None) -> Machine:
    """This host now."""
    return Machine(ram=mem_available_bytes(), total=mem_total_bytes(), shm=shm_free_bytes(shm_dir), threshold=threshold)


def machine_of(host_gib: float, threshold: float | None) -> Machine:
    """A host of `host_gib` GiB of RAM, all of it free, with /dev/shm as large (planning for another host)."""
    size = int(host_gib * GIB)
    return Machine(
        ram=size, total=size, shm=size, threshold=threshold, note=" (--host-gib: all of it free, /dev/shm as large)"
    )
