"""The data-plane protocol: what lives where in shared memory, who waits on what, in which order.

One package, every verb: plan.py (the StoreSpec: segments, slabs, pieces, and the fetch, forward and
gradient orders as data; the engine takes its checkpoint blocks from it), store.py (a process's view:
waits, posts, versions, abort, the role table), ctl.py (the control segment's layout), executor.py (the
executor's walk and each piece's hand-off; its CUDA stream pipelines run beside it, actors/executor/streams.py),
workers.py (pack, drain, take/free a gradient, wait for a step's gradients), adam.py (the Adam
updater's step: its waits, piece order and versions, around the AdamW arithmetic the actor supplies, one
update for any number of hosts, through a link that is trivial on one),
checkpoints.py (the writer's claim and release of each piece, Adam's wait for it, the versions of a
restored store). Beside it: ipc/messages.py (what the actors' calls send and answer across processes),
ipc/monitor.py (stall detection), ipc/shared/fence.py (memory ordering of the version counters).
The actors call these and touch no version, semaphore or slab themselves (tests/test_protocol_boundary.py).

Segments of a run (all /megatrain-<run_id>-<part>):
  ctl         abort flag + reason, worker pids, the role table (per worker: heartbeat, last progress,
              calls and waits in flight, what it waits on), per-piece version counters (Adam updates
              applied and readable: see below) and per-piece squared gradient norms
  params, exp_avg, exp_avg_sq, grads   fp32 planes, one 4 KiB-aligned tile per unit (grads: the
              fp32 gradient of the step, held until the global norm is known)
  staging     S weight slabs (compute dtype; slabs mode only) then G gradient slabs (fp32), each of
              slab_elems elements; the executor pins (cudaHostRegister) this segment and `resident`.
  resident    resident mode only: a compute-dtype copy of every unit's weights, rewritten by Adam's
              fused pass right after each unit's update; the DMA reads it directly (no packing).

A slab holds ipc.slab_params elements (default: the largest decoder layer), so a larger unit (the
embedding, the LM head, or any unit with smaller slabs) travels as several *pieces*: consecutive element
ranges of its tile, one slab each. Version counters and squared gradient norms are kept per piece. On one
host each version is published right after its piece's update, so the next step may pack and copy a unit's
first piece while Adam still updates its last. Over several hosts each host updates its own pieces (its
slice of every unit), and a unit's versions are published together, per unit, once every host's updated
slice of it is gathered into every host's resident copy: the next forward on any host reads the unit whole.

Weights, per step, follow the plan's fetch_order, piece by piece. Resident mode: the executor waits for
version[piece] >= step and copies the piece of the unit's resident tile. Slabs mode: item j uses weight
slab j % S, and slab s is always filled by packer s % P, so one packer handles a slab's uses in order:
  packer:   wait w_free[s]; wait version[piece] >= step; cast fp32 piece -> slab; post w_full[s]
  executor: wait w_full[s]; copy slab -> its range of the unit's device buffer; (copy done) post w_free[s]
A forward-only pass (evaluation, generation) walks forward_order the same way, from slab 0.
Gradients follow grad_order, piece by piece: item k uses grad slab k % G, drained by
accumulator (k % G) % A:
  executor:    wait g_free[s]; copy grad piece -> slab (GPU: record the slab's IPC event); post g_full[s]
  accumulator: wait g_full[s]; (GPU: synchronize the opened IPC event); norm^2 -> ctl; slab -> grads
               tile range; post g_free[s]; post grads_ready
  adam:        wait grads_ready once per piece; clip scale from the norms; update pieces in forward
               order, bumping version[piece] after each (one host; slabs run on one host only), which
               releases the next step's packers.
The units whose optimizer the executor holds on its device (StoreSpec.on_gpu, engine.gpu_optimizer) have no
slab, no version published per step and no update by Adam: their gradient stays on the device, their pieces'
squared norms land in ctl as any unit's (one grads_ready each), Adam publishes its verdict on the step (the
global norm and clip scale, ctl's flag words) and the executor updates them. Their tiles' pages in the planes
are given back to the system once the executor has them (Store.release); it writes their state back, and
publishes their versions, only before a checkpoint of them is taken (the pages given back again once the writer
has them on disk) or the final weights are read.
Spare slots (StoreSpec.spare_units, ipc.spare_slots): segments spare-planes (the three fp32 state planes'
slots) and spare-resident (their compute-dtype copies, pinned by the executor as `resident`). ctl's bank word
of such a unit says which copy holds its state; Adam writes a speculative update into the other copy and, when
the step keeps it, turns the bank before it publishes the unit's versions; every reader resolves the bank at
each access (Store.tile, Store.resident_tile, Store.state_bytes), after its version wait.
Without clipping there is no grads plane and no accumulator: the Adam updater itself waits
g_full[s] (and the slab's IPC event), updates the piece straight from the slab, bumps its version and
posts g_free[s], all while the executor is still running the backward.
Every wait is timed (ipc.wait_timeout_s) and polls the abort flag, so a dead peer never hangs a run;
the store owner's monitor names a stalled peer long before that (ipc.stall_timeout_s). A unit out of the
plan's order raises ProtocolError (never an assert: `python -O` must not write into the wrong tile).

Memory ordering: slabs, squared norms and the grads plane change hands through POSIX semaphores, which
synchronize memory (XBD 4.12); version counters are published and read with explicit fences
(ipc/shared/fence.py).
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use: plan.py and store.py import torch and numba, which `megatrain-launch status` (it
# reads ipc/status.py and protocol/ctl.py alone) and the config tree must not wait for.
_FROM = {"Store": "store"} | {
    name: "plan"
    for name in (
        "PLANES",
        "STAGING",
        "Item",
        "StoreSpec",
        "blocks",
        "checkpoint_host_bytes",
        "fetch_order",
        "forward_order",
        "grad_order",
        "plan_store",
        "resolve_stall",
    )
}


def __getattr__(name: str) -> Any:
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)


__all__ = sorted(_FROM)
