"""The data plane's settings (the config tree's `ipc` section). Free of torch, so the config tree and its
checks load without it; plan.py, which lays out the store with them, imports them from here."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config.base import opt

STALL_FLOOR_S = 15.0  # a step in flight makes data-plane progress within a fraction of a second


@dataclass
class IpcConfig:
    weight_slabs: int = opt(4, "S: weight staging slabs (compute dtype, ipc.slab_params elements each).")
    grad_slabs: int = opt(
        4,
        "G: gradient staging slabs (fp32); back-pressure when all are in flight. With clipping "
        "and a resident copy there are none: gradients go straight into the resident copy, "
        "and G bounds the gradients queued on the GPU.",
    )
    slab_params: int = opt(
        0,
        "Elements per staging slab; a larger unit streams in slab-sized pieces (weights "
        "and gradients alike). 0 = the largest decoder layer, so only the embedding "
        "and LM head are split. Smaller slabs take less pinned memory and more copies.",
    )
    wait_timeout_s: float = opt(
        600.0,
        "Longest any data-plane wait may block before the run fails (the last "
        "resort: a stalled actor is found by ipc.stall_timeout_s first).",
    )
    stall_timeout_s: float | str = opt(
        "auto",
        "Fail the run when no actor has made data-plane progress for this long while "
        "a step is in flight, naming the actor that stopped (no heartbeat, or working "
        "without progress) rather than the ones waiting on it; 0 = off. auto: 15 s, "
        "or 4x a layer's compute at 100 TFLOPS where that is longer (long context: "
        "one layer of a 7B at 512K tokens computes for minutes). Raise it if one layer "
        "legitimately computes longer still (a large model on the CPU device).",
    )
    poll_s: float = opt(0.05, "How often a blocked wait re-checks the abort flag.")
    staging: str = opt(
        "auto",
        "How weights reach the DMA: 'resident' (a pinned compute-dtype copy of the whole "
        "model, rewritten by Adam; no packing on the critical path), 'slabs' (S slabs "
        "filled just in time by the packers; O(layer) pinned memory), or 'auto' "
        "(resident on cuda when it fits in memory, else slabs).",
    )
    shm_dir: str = opt("/dev/shm", "Where POSIX shared memory lives (checked for free space before creating).")
    spare_slots: int | str = opt(
        "auto",
        "With clipping: units (the LM head, then the layers from the last) whose Adam update the host runs "
        "speculatively during the backward, as each one's gradient lands, into a spare slot (a second copy of "
        "its fp32 state and resident weights); once the global norm is known the slot becomes the state if the "
        "step did not clip (its clip factor exactly 1), else it is dropped and the unit is updated as without "
        "one: the result is the same bit for bit either way. 0 = none. auto: as many as the host memory left "
        "beside the run holds (none without clipping or the resident copy); "
        "megatrain-launch plan shows the choice.",
    )

    def __post_init__(self) -> None:
        if self.weight_slabs < 1 or self.grad_slabs < 1:
            raise ValueError("ipc.weight_slabs and ipc.grad_slabs must be >= 1")
        if self.slab_params < 0:
            raise ValueError("ipc.slab_params must be >= 0 (0 = the largest decoder layer)")
        if self.staging not in ("auto", "resident", "slabs"):
            raise ValueError(f"ipc.staging must be auto, resident or slabs, not '{self.staging}'")
        if self.wait_timeout_s <= 0 or self.poll_s <= 0:
            raise ValueError("ipc.wait_timeout_s and ipc.poll_s must be > 0")
        if self.stall_timeout_s != "auto" and (isinstance(self.stall_timeout_s, str) or self.stall_timeout_s < 0):
            raise ValueError(f"ipc.stall_timeout_s must be auto or >= 0 (0 = off), not {self.stall_timeout_s!r}")
        spare = self.spare_slots
        if spare != "auto" and (isinstance(spare, (str, bool)) or spare < 0):
            raise ValueError(f"ipc.spare_slots must be 'auto' or an integer >= 0 (0 = none), not {spare!r}")

    def stall_seconds(self) -> float:
        """The stall timeout in seconds (an unresolved auto: the floor)."""
        return STALL_FLOOR_S if self.stall_timeout_s == "auto" else float(self.stall_timeout_s)
