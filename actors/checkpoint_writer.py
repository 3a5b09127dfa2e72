"""Checkpoint writer: a process on the store's node that writes the fp32 planes straight from shared
memory to disk (no copy through the driver, Ray's object store, or a second buffer in RAM).

The driver calls it between steps, once Adam's update of the step is complete and before the next step
is launched, so the planes hold exactly the state after that step (see megatrain/checkpoint.py for the
format and how a crash mid-write is made harmless).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from megatrain.actors.base import Role, guarded
from megatrain.ipc.protocol import Store, StoreSpec

from megatrain import checkpoint as ckpt


class CheckpointWriter(Role):
    def __init__(self) -> None:
        super().__init__("checkpoint-writer")

    def attach(self, spec: StoreSpec) -> None:
        self.store = Store.attach(spec, ckpt.PLANES)  # no role slot: it is idle during steps

    @guarded
    def write(self, step: int, root: str, meta: dict) -> dict:
        """Write the planes as checkpoint `step` under `root`; returns its path, bytes and seconds."""
        t0 = time.perf_counter()
        base = Path(root)
        base.mkdir(parents=True, exist_ok=True)
        ckpt.remove_torn(base)
        tmp = base / f"step-{step:07d}.tmp-{os.getpid()}"
        tmp.mkdir()
        files = {f"{part}.bin": ckpt.write_plane(tmp / f"{part}.bin", self.store.plane(part)) for part in ckpt.PLANES}
        spec = self.store.spec
        manifest = {"format": ckpt.FORMAT, "step": step, "layout_hash": spec.layout.digest().hex(),
                    "family": spec.model.family, "hf_config": spec.model.hf_config.to_dict(),
                    "total_elems": spec.layout.total, "files": files,
                    "units": ckpt.unit_table(spec.layout), "written_at": time.time(), **meta}
        final = ckpt.step_dir(base, step)
        ckpt.publish(tmp, final, manifest)
        nbytes = sum(f["bytes"] for f in files.values())
        return {"path": str(final), "bytes": nbytes, "seconds": time.perf_counter() - t0}
