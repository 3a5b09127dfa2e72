"""The block plan: which decoder layers form which recompute block.

The data-plane plan (ipc/protocol/plan.py) serves weights in the order these blocks imply, the engine
recomputes exactly them, and the sizing (megatrain/memory/autosize.py) counts their checkpoints; each reads them
from here, so none of them imports the compute engine for it."""

from __future__ import annotations


def blocks(num_layers: int, k: int, last: int = 0) -> list[list[int]]:
    """Unit indices of each checkpoint block (layers are units 1..N).

    The last block holds `last` layers (0: k); it is never recomputed (it runs with grad in the
    forward). The rest are blocks of k counted from the top, so a short block, if any, is the first."""
    last = min(last or k, num_layers)
    rest = num_layers - last
    first = rest % k
    head = [list(range(1, first + 1))] if first else []
    return (
        head + [list(range(s, s + k)) for s in range(first + 1, rest + 1, k)] + [list(range(rest + 1, num_layers + 1))]
    )
