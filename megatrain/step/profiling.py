"""One executor step under torch.profiler: a Chrome trace, and the check that the layer loop never blocks
the host on the GPU.

The compute thread must issue kernels back to back: no .item(), .cpu(), synchronize or blocking copy
between the first layer and the last. The loop runs inside a `record_function` range; afterwards
the trace's CUDA runtime calls that block the calling host thread (or, like cudaFree, the whole
device) are counted per thread: on the compute thread inside the loop they are violations; on the
loader and drain threads they are the expected slab hand-offs (a slab is freed once its copy is done).
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

LOOP = "megatrain.layer_loop"
# Runtime and driver calls that wait for the GPU: explicit syncs, synchronous copies and sets (not their
# Async forms), and frees (device-wide). Exact names.
BLOCKING = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cudaMemcpy2D",
        "cudaMemset",
        "cudaFree",
        "cudaFreeHost",
        "cudaHostUnregister",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
        "cuMemFree_v2",
    }
)


class StepProfile:
    def __init__(self, path: str | Path, cuda: bool):
        self.path, self.cuda = Path(path), cuda
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.prof = profile(activities=acts)

    def __enter__(self) -> StepProfile:
        self.prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prof.__exit__(*exc)

    @staticmethod
    def loop() -> AbstractContextManager:
        """Wrap the layer loop (not the final loss read, which is the step's one intended sync)."""
        return record_function(LOOP)

    def result(self) -> dict:
        """After exit: write the trace; the blocking calls inside the loop, by thread."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.path))
        return {"profile_trace": str(self.path), **blocking_calls(json.loads(self.path.read_text()))}


def blocking_calls(trace: dict) -> dict:
    """Count BLOCKING runtime calls that start inside the LOOP range: on its thread, and on the others."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    # The CPU-side range (kineto also emits a GPU-side copy, "gpu_user_annotation", on a stream's row).
    loops = [e for e in events if e.get("name") == LOOP and e.get("cat") == "user_annotation"]
    if not loops:
        raise ValueError(f"the trace has no '{LOOP}' range")
    loop = loops[0]
    t0, t1 = loop["ts"], loop["ts"] + loop["dur"]
    inside = [
        e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") in BLOCKING and t0 <= e["ts"] <= t1
    ]
    same = [e["name"] for e in inside if e.get("tid") == loop.get("tid")]
    # Kernel launches seen on the loop's thread: proof that runtime calls are attributed to it, so
    # that zero blocking calls is a finding and not a thread-id mismatch.
    launches = sum(
        1 for e in events if e.get("cat") == "cuda_runtime" and e.get("tid") == loop.get("tid") and t0 <= e["ts"] <= t1
    )
    return {
        "loop_blocking_calls": len(same),
        "loop_blocking_names": sorted(set(same)),
        "helper_thread_blocking_calls": len(inside) - len(same),
        "loop_runtime_calls": launches,
    }


class NvtxPhases:
    """NVTX ranges for consecutive phases of one thread, named as the executor's phase marks: each mark
    closes the open range and opens its own ('end' only closes). Under `nsys profile -t cuda,nvtx` the
    compute thread's ranges (fwd:U, head, recompute:U, bwd:U, embed-bwd), with the loader's h2d:U and the
    drain's d2h:U, read like the timeline picture. A range push costs about a microsecond without a tool
    attached, so they are always on with CUDA."""

    def __init__(self) -> None:
        self.open = False

    def __call__(self, name: str) -> None:
        self.close()
        if name != "end":
            torch.cuda.nvtx.range_push(name)
            self.open = True

    def close(self) -> None:
        """Close the open range (a step that raised leaves none behind for the next)."""
        if self.open:
            torch.cuda.nvtx.range_pop()
            self.open = False
