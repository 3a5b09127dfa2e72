"""Checkpoint writer: a process on the store's node that writes the fp32 planes straight from shared
memory to disk (no copy through the driver, Ray's object store, or a second buffer in RAM).

It joins the data plane, so training goes on while it writes. The checkpoint of step N is the state
after Adam's N-th update, and that state exists piece by piece, never all at once:
  1. the driver calls write(N) alongside step N+1 (or, after the last step, alone) and tells Adam's
     step-N+1 call that this checkpoint is being written;
  2. the writer takes the pieces in the order Adam updates them (ipc.protocol.plan update_items); for
     each it waits until Adam's version counter says the N-th update is in (version N), writes the
     piece's params, exp_avg and exp_avg_sq, checks the version is still N, and publishes saved=N
     (ipc/protocol/checkpoints.py: claim, written);
  3. Adam's step-N+1 update of a piece waits for saved >= N (checkpoints.wait_taken) and only then writes it.
So the writer never sees a piece half-updated or one update too far, and Adam follows right behind it:
step N+1's forward and backward run meanwhile, and only its updates wait, each for one piece.
  4. the files written and fsync'ed, the driver waits until step N's metrics row is on disk too, then
     calls publish(N): manifest, rename, `latest`. So a checkpoint never runs ahead of metrics.jsonl.
Each host's writer writes its slices, the part of the checkpoint that is its host's (megatrain/formats/checkpoint.py;
one host: every unit whole, in one part); publish(N) on every host's writer makes each part whole, and then
publish_hosts(N) on any one of them makes the step's directory the checkpoint.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from megatrain.actors.base import Role, guarded
from megatrain.errors import DiskFull, disk_full, free_bytes, human_bytes, is_disk_full
from megatrain.formats import checkpoint as ckpt
from megatrain.ipc.messages import WriteRequest, Written
from megatrain.ipc.protocol import Store, StoreSpec
from megatrain.ipc.protocol.checkpoints import claim, written
from megatrain.ipc.protocol.plan import Item
from megatrain.memory.host import SPARE_PLANES
from megatrain.roster import WRITER

AHEAD = 2  # pieces in flight beyond the oldest: keeps every thread busy across piece boundaries


class CheckpointWriter(Role):
    def __init__(self, threads: int = 4):
        super().__init__(WRITER)
        self.threads = max(threads, 1)
        self.staged: dict[int, tuple[Path, Path, dict]] = {}  # step -> (temporary dir, final dir, manifest)
        self.roots: dict[int, Path] = {}  # step -> its root, until publish_hosts

    def attach(self, spec: StoreSpec) -> None:
        self.apply_threads(spec)
        self.store = Store.attach(spec, ckpt.PLANES + spec.spare_parts(SPARE_PLANES), role=self.name)

    @guarded
    def write(self, request: WriteRequest) -> Written:
        """Write the state after the request's step into a temporary directory under its root, every file
        fsync'ed; it is not a checkpoint until publish(step) and publish_hosts(step). Its bytes and seconds,
        and how long it waited for Adam's update of the step."""
        step, root, meta = request.step, request.root, request.meta
        t0 = time.perf_counter()
        base = Path(root)
        base.mkdir(parents=True, exist_ok=True)
        tmp, final = self._where_to(base, step)
        spec = self.store.spec
        nbytes = spec.plane_elems * 4
        need, what = self._need(base, step, nbytes * len(ckpt.PLANES))
        try:
            if free_bytes(base) < need:  # refused before a byte is written
                raise OSError(errno.ENOSPC, "not enough free space for the checkpoint")
            tmp.mkdir()
            segments, waited, direct = self._write_files(step, tmp, nbytes)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint only takes space (the disk may be full)
            if is_disk_full(exc):
                raise self._no_room(base, step, what, None) from None
            raise
        manifest = {
            "format": ckpt.FORMAT,
            "step": step,
            "layout_hash": spec.layout.digest().hex(),
            "family": spec.model.family,
            "total_elems": spec.layout.total,
            "files": {f"{p}.bin": {"bytes": nbytes, "segments": sorted(segments[p])} for p in ckpt.PLANES},
            "units": self._slices(),
            "hosts": spec.hosts,
            "host": spec.host,
            "plane_elems": spec.plane_elems,
            "written_at": time.time(),
            **meta,
        }
        self.roots[step] = base
        self.staged[step] = (tmp, final, manifest)
        return Written(
            path=str(ckpt.step_dir(base, step)),
            bytes=nbytes * len(ckpt.PLANES),
            seconds=time.perf_counter() - t0,
            waited_for_adam_s=waited,
            direct_io=direct,
        )

    def _need(self, base: Path, step: int, part: int) -> tuple[int, str]:
        """The bytes this write needs free in `base` (`part`: this host's), and the refusal's words for them. Every
        host's part of the step lands in this one directory, on a filesystem every node sees (docs/hosts.md), at
        once: each writer counts them all, less what the other hosts' parts already hold on the disk. Were each
        to count its own alone, every one would find room for it and the parts together would fill the disk
        part-way through."""
        hosts = self.store.spec.hosts
        written = _held(ckpt.hosts_tmp(base, step), skip=ckpt.part_name(self.store.spec.host))
        need = hosts * part - written
        if hosts == 1:  # the words only: one part is the whole checkpoint
            return need, f"the checkpoint of step {step} needs {human_bytes(need)};"
        held = f", {human_bytes(written)} of the others' already on the disk" if written else ""
        return need, (
            f"the checkpoint of step {step} needs {human_bytes(need)} (its {hosts} hosts' parts of "
            f"{human_bytes(part)} each, all written into this directory{held});"
        )

    def _where_to(self, base: Path, step: int) -> tuple[Path, Path]:
        """The temporary and the final directory of this writer's files of `step` (the host's part, inside the
        directory every host's writer writes its part into at once), what an interrupted save left removed:
        only this host's leftovers inside that directory are this writer's to remove."""
        spec = self.store.spec
        shared = ckpt.hosts_tmp(base, step)
        ckpt.remove_torn(base, keep=shared)  # one checkpoint is written at a time: any other is torn
        shared.mkdir(exist_ok=True)
        part = ckpt.part_name(spec.host)
        ckpt.remove_torn(shared, pattern=f"{part}.tmp-*")
        return shared / f"{part}.tmp-{os.getpid()}", shared / part

    def _slices(self) -> list[dict]:
        """The manifest's units with, per unit, this host's slice [lo, hi) of it and where it starts in the files."""
        spec = self.store.spec
        return [
            {**u, "slice": list(spec.owned(i)), "slice_offset": spec.slice_offsets[i]}
            for i, u in enumerate(ckpt.unit_table(spec.layout))
        ]

    def _write_files(self, step: int, tmp: Path, nbytes: int) -> tuple[dict[str, list], float, bool]:
        """The planes' files in `tmp`, fsync'ed: their segments, the wait for Adam, whether all were direct I/O.
        Every file is closed on every path (after a failure, without the fsync)."""
        files: dict[str, ckpt.PlaneFile] = {}
        written = False
        try:
            for part in ckpt.PLANES:
                files[part] = ckpt.PlaneFile(tmp / f"{part}.bin", nbytes)
            segments, waited = self._write_pieces(step, files)
            written = True
        finally:
            failed: list[OSError] = []
            for f in files.values():
                try:
                    f.close(sync=written)
                except OSError as exc:  # fsync reports what a buffered write could not put on the disk
                    failed.append(exc)
        if failed:
            raise failed[0]
        return segments, waited, all(f.direct for f in files.values())

    @staticmethod
    def _no_room(base: Path, step: int, what: str, need: int | None) -> DiskFull:
        newest = ckpt.latest(base)
        kept = f"the newest complete checkpoint, {newest.name}, is intact" if newest else "no earlier checkpoint"
        return disk_full(
            base,
            what,
            need,
            after=f"nothing of step {step} was left behind; {kept}; free space, or keep fewer with train.keep_last",
        )

    @guarded
    def publish(self, step: int) -> str:
        """Make the written state of `step` a checkpoint: its manifest, the rename, then `latest`. The
        driver calls it once the metrics of every step up to `step` are on disk, so that a run resumed
        from it never lacks a step's metrics. This host's part of it (its manifest, the rename): the
        checkpoint is made by publish_hosts once every host's part is."""
        tmp, final, manifest = self.staged.pop(step)
        try:
            ckpt.seal(tmp, final, manifest)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)  # gone once renamed: then only `latest` was not rewritten
            if is_disk_full(exc):
                raise self._no_room(final.parent, step, f"the manifest of step {step}'s checkpoint", None) from None
            raise
        return str(final)

    @guarded
    def publish_hosts(self, step: int) -> str:
        """Make the checkpoint of `step` from every host's part, once each host's writer has published its own
        (publish). Called on one writer; any host's will do."""
        base = self.roots.pop(step)
        try:
            final = ckpt.publish_hosts(base, step, self.store.spec.hosts)
        except BaseException as exc:
            if is_disk_full(exc):
                raise self._no_room(base, step, f"the manifest of step {step}'s checkpoint", None) from None
            raise
        return str(final)

    def _write_pieces(self, step: int, files: dict[str, ckpt.PlaneFile]) -> tuple[dict[str, list], float]:
        store = self.store
        segments: dict[str, list] = {p: [] for p in ckpt.PLANES}
        flight: deque[tuple[Item, list[tuple[str, Future]]]] = deque()
        waited = 0.0
        with ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-write") as pool:
            try:
                for item in store.spec.update_items:
                    waited += claim(store, item, step)
                    flight.append((item, self._submit(pool, item, files)))
                    while len(flight) > AHEAD or (flight and all(f.done() for _, f in flight[0][1])):
                        self._retire(flight.popleft(), step, segments)
                while flight:
                    self._retire(flight.popleft(), step, segments)
            finally:  # on an error, no write may still read shared memory once this returns
                for _, futures in flight:
                    for _, f in futures:
                        f.cancel()
        return segments, waited

    def _submit(self, pool: ThreadPoolExecutor, item: Item, files: dict[str, ckpt.PlaneFile]) -> list:
        """The piece's bytes in every plane, in chunks: elements [lo, hi) of its tile, with the tile's padding
        when it is the unit's last piece (so the chunks cover the whole file)."""
        lo_b, hi_b = self._bytes(item)
        out = []
        for part in ckpt.PLANES:
            raw, first = self.store.state_bytes(part, item.unit)  # its tile, or its spare slot (ipc.spare_slots)
            for off, n in ckpt.chunks(lo_b, hi_b):
                out.append((part, pool.submit(files[part].write, raw[off - first : off - first + n], off)))
        return out

    def _bytes(self, item: Item) -> tuple[int, int]:
        """Where the piece lies in the files, in bytes: at its place in the host's slice, the slice's last piece
        extended over the padding up to the next unit's slice (one host: the unit's tile's padding), so that
        the chunks cover the whole file and end aligned (direct I/O stays on)."""
        spec = self.store.spec
        unit, offsets = item.unit, spec.slice_offsets
        lo, hi = spec.owned(unit)
        start = offsets[unit] - lo
        end = start + item.hi
        if item.hi >= hi:
            end = offsets[unit + 1] if unit + 1 < len(offsets) else spec.plane_elems
        return 4 * (start + item.lo), 4 * end

    def _retire(self, entry: tuple[Item, list[tuple[str, Future]]], step: int, segments: dict[str, list]) -> None:
        item, futures = entry
        for part, f in futures:
            segments[part].append(f.result())
        written(self.store, item, step)


def _held(shared: Path, skip: str) -> int:
    """The bytes the files in `shared` (the step's directory of every host's part) take on the disk, this host's
    own part (`skip`: its name, and its temporary one) aside."""
    held = 0
    for top in shared.iterdir() if shared.is_dir() else []:
        if top.name == skip or top.name.startswith(f"{skip}.tmp-"):
            continue
        for path in [top] if top.is_file() else top.rglob("*"):
            try:
                held += path.stat().st_blocks * 512 if path.is_file() else 0
            except OSError:  # removed meanwhile (an interrupted save's, cleared by its host)
                continue
    return held
