"""Checkpoints and the version counters: the writer's fence-read-write-publish of each piece, Adam's wait for
it, and the versions of a store restored from a checkpoint.

The checkpoint of step N is the state after Adam's N-th update, which exists piece by piece, never all at
once (actors/checkpoint_writer.py tells the whole story):
  writer: claim(piece)    wait until its version reaches N (acquire), and check it is exactly N;
          (write its params, exp_avg and exp_avg_sq to disk)
          written(piece)  check it is still N (read after the data, between fences), publish saved = N;
  adam:   wait_taken      before its update of step N+1 writes the piece, wait for saved >= N.
So the writer never sees a piece half-updated or one update too far, and Adam follows right behind it.

A store is restored (restore) from a checkpoint written on any host count: on the count it was written on,
each host reads its own part's files whole; on another (1 <-> H included), each host reads, per unit, the
elements of its new slice from whichever parts hold them, checking every checksummed segment it touches.
Every host also reads the whole fp32 weights of every unit, from every part, for its resident copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatrain.errors import ConfigError, ProtocolError
from megatrain.formats import checkpoint as ckpt
from megatrain.ipc.protocol.plan import Item
from megatrain.ipc.protocol.store import Store
from megatrain.model.layout import StoreLayout


def claim(store: Store, item: Item, step: int) -> float:
    """Writer: wait until the piece holds Adam's update of `step` (and no later one); the seconds waited."""
    t0 = time.perf_counter()
    store.wait_version(item.unit, step, f"Adam's update of unit {item.unit} (step {step}) to checkpoint it", item.piece)
    waited = time.perf_counter() - t0
    _check_version(store, item, step)
    return waited


def written(store: Store, item: Item, step: int) -> None:
    """Writer: the piece's bytes of `step` are read out; Adam may update it again."""
    _check_version(store, item, step)  # Adam must not have touched it while it was being written
    store.publish_saved(item.piece, step)


def wait_taken(store: Store, item: Item, step: int) -> None:
    """Adam, while the checkpoint of the state after `step` is written: before updating the piece again, wait
    for the writer to have it."""
    store.wait_saved(
        item.piece, step, f"the checkpoint writer to take unit {item.unit} (piece {item.piece}) after step {step}"
    )


def restore_versions(store: Store, step: int) -> None:
    """Owner: the planes were read back from the checkpoint of `step`, so every piece holds Adam's `step`
    updates; published after those writes (release), as Adam publishes its own."""
    store.publish_versions(step)


def _check_version(store: Store, item: Item, step: int) -> None:
    have = store.version(item.piece)
    if have != step:
        raise ProtocolError(
            f"checkpoint of step {step}: unit {item.unit} (piece {item.piece}) is at version "
            f"{have}; Adam must hold its next update until the writer has it"
        )


@dataclass(frozen=True, kw_only=True)
class Part:
    """One host's part of a checkpoint (one host's checkpoint is one part): its plane files and what the
    manifest says of each, per unit the slice [lo, hi) its files hold and the element where that slice starts
    in them, and what lies at a byte offset of its files (for messages)."""

    host: int
    files: dict[str, Path]
    expect: dict[str, dict]
    slices: tuple[tuple[int, int, int], ...]
    where: Callable[[int], str]


def parts_of(directory: Path, manifest: dict, layout: StoreLayout) -> list[Part]:
    """The parts of the checkpoint in `directory` (its manifest given), host by host; a ConfigError naming
    train.resume where they do not hold every element of every unit exactly once. A checkpoint of the earlier
    one-host format is its one part (megatrain/formats/checkpoint.py part_files)."""
    found = ckpt.part_files(manifest)
    hosts = len(found)
    parts = [
        Part(
            host=h,
            files={plane: directory / name for plane, name in names.items()},
            expect={plane: manifest["files"][name] for plane, name in names.items()},
            slices=tuple(slices),
            where=ckpt.part_where(manifest, h),
        )
        for h, (names, slices) in enumerate(found)
    ]
    for part in parts:
        for plane, path in part.files.items():
            ckpt.check_size(path, part.expect[plane])
    for u in range(len(layout.units)):
        spans = sorted((p.slices[u][0], p.slices[u][1]) for p in parts if p.slices[u][1] > p.slices[u][0])
        ends = [0] + [hi for _, hi in spans]
        if [lo for lo, _ in spans] != ends[:-1] or ends[-1] != layout.structure_of(u).numel:
            raise ConfigError(
                f"train.resume: {directory}: its {hosts} hosts' slices of unit {u} ({spans}) do not hold its "
                f"{layout.structure_of(u).numel} elements exactly once"
            )
    return parts


def read_elems(parts: list[Part], plane: str, unit: int, lo: int, hi: int, out: np.ndarray) -> int:
    """Elements [lo, hi) of the unit in `plane` into `out` (fp32, hi - lo) from whichever of `parts` hold
    them, every segment read checked (megatrain/formats/checkpoint.py read_range); the bytes read."""
    nbytes = 0
    for part in parts:
        first, last, at = part.slices[unit]
        a, b = max(lo, first), min(hi, last)
        if a < b:
            span = 4 * (at + a - first), 4 * (at + b - first)
            dest = out[a - lo : b - lo].view(np.uint8)
            nbytes += ckpt.read_range(part.files[plane], part.expect[plane], *span, dest, part.where)
    return nbytes


def restore(store: Store, directory: Path, manifest: dict, going: Callable[[], None]) -> int:
    """Owner: the store holds the state after the checkpoint's step (manifest: the checkpoint's), its versions
    at that step; the bytes read. `going()` raises once the run is shut down (it is called per plane or unit).
    One host from a one-host checkpoint: each plane read whole, the resident copy cast from it."""
    spec = store.spec
    parts = parts_of(directory, manifest, spec.layout)
    store.reset_banks()  # the state is read into every unit's own tile
    own = len(parts) == spec.hosts and all(
        parts[spec.host].slices[u] == (*spec.owned(u), spec.slice_offsets[u]) for u in range(spec.num_units)
    )
    nbytes = 0
    if own:  # written on this host count: this host's part is its planes as they lay in its store
        for plane in ckpt.PLANES:
            going()
            part = parts[spec.host]
            ckpt.read_plane(part.files[plane], store.plane(plane), part.expect[plane], part.where)
            nbytes += int(part.expect[plane]["bytes"])
    if own and spec.hosts == 1:
        for u in range(spec.num_units if spec.resident else 0):
            store.refresh_resident(u)
    else:
        with ThreadPoolExecutor(ckpt.READERS, thread_name_prefix="restore") as pool:
            nbytes += sum(pool.map(lambda u: _unit(store, parts, u, own, going), range(spec.num_units)))
    restore_versions(store, int(manifest["step"]))  # after every write it covers
    return nbytes


def _unit(store: Store, parts: list[Part], unit: int, own: bool, going: Callable[[], None]) -> int:
    """A unit of a store over several hosts or of a checkpoint of another host count: its whole fp32 weights
    from every part (`own`: this host's slice of them, and of every plane, is already in the store) into the
    resident copy, and where not `own`, this host's slice of every plane from the parts that hold it."""
    going()
    spec = store.spec
    lo, hi = spec.owned(unit)
    whole = np.empty(spec.layout.structure_of(unit).numel, np.float32)
    if own:
        whole[lo:hi] = store.tile("params", unit)
        nbytes = read_elems([p for p in parts if p.host != spec.host], "params", unit, 0, whole.size, whole)
    else:
        nbytes = read_elems(parts, "params", unit, 0, whole.size, whole)
        store.tile("params", unit)[:] = whole[lo:hi]
        nbytes += sum(read_elems(parts, p, unit, lo, hi, store.tile(p, unit)) for p in ckpt.PLANES[1:])
    if spec.resident:
        store.resident_tile(unit).copy_(torch.from_numpy(whole))  # torch's cast, as refresh_resident's
    return nbytes
