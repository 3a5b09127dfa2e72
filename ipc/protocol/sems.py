"""The run's semaphores, named here alone: the key each verb waits on or posts, and the POSIX name and initial
value each is created with (under ipc/shared/shm.py's sem_name, so a leftover run's are found and removed with its
segments).

  w_free<s>, w_full<s>   weight slab s is free to fill (starts at 1) / holds its piece (starts at 0)
  g_free<s>, g_full<s>   gradient slab s likewise
  grads_ready            one post per gradient piece in the grads plane or the resident copy (starts at 0)
"""

from __future__ import annotations

from megatrain.ipc.shared.shm import sem_name

GRADS_READY = "grads_ready"


def w_free(slab: int) -> str:
    return f"w_free{slab}"


def w_full(slab: int) -> str:
    return f"w_full{slab}"


def g_free(slab: int) -> str:
    return f"g_free{slab}"


def g_full(slab: int) -> str:
    return f"g_full{slab}"


def semaphores(run_id: str, weight_slabs: int, grad_slabs: int) -> dict[str, tuple[str, int]]:
    """Every semaphore of a run: key -> (POSIX name, initial value)."""
    out = {GRADS_READY: (sem_name(run_id, "grads-ready"), 0)}
    for free, full, n, kind in ((w_free, w_full, weight_slabs, "w"), (g_free, g_full, grad_slabs, "g")):
        for i in range(n):
            out[free(i)] = (sem_name(run_id, f"{kind}free{i}"), 1)
            out[full(i)] = (sem_name(run_id, f"{kind}full{i}"), 0)
    return out
