"""The on-disk checkpoint: one directory per step, complete or absent.

OUTPUT_DIR/checkpoints/step-NNNNNNN/ holds, for each fp32 plane of the store (params, exp_avg,
exp_avg_sq), one raw file with the plane exactly as it lies in shared memory (every unit's tile at its
8 KiB-aligned offset, padding zero), and manifest.json: the step, the layout hash, per unit its HF
tensor names, shapes and offsets, per file its bytes and a CRC-32 per written segment (at most 64 MiB:
the writer writes pieces in parallel and out of file order), the data position and seeds, and the
resolved config. It is written into step-NNNNNNN.tmp-PID, every file fsync'ed, renamed, the parent
fsync'ed, and only then `latest` (a one-line file, itself written by rename) points at it. A crash at
any moment leaves either the previous state or a *.tmp-* directory, which nothing reads and the next
save removes; a directory without a valid manifest is never taken for a checkpoint. verify() reads a
checkpoint whole against its checksums (a resume does, before anything starts); one found corrupt is renamed
corrupt-step-NNNNNNN, which nothing here takes for a checkpoint either.

Every checkpoint has one part per host (actors.num_hosts; one host is the case of one part): host-h/ holds
host h's planes (its slice of every unit, at the offsets every host shares: on one host each unit whole at
its tile's offset) and a manifest of its own that records the hosts, the host, and per unit its slice
[lo, hi) and where the slice starts in the file. Each host's writer writes its part into
step-NNNNNNN.tmp-hosts/host-h.tmp-PID and renames it to host-h (seal); once every host's part is there,
publish_hosts writes the step's manifest, which lists every part's files with their checksums (so verify()
and manifest_of() read every checkpoint alike) and every host's slices, and renames the directory into place.
One host writes a host-0/ part too, so that writing, resuming and exporting are one path for every host
count. A checkpoint of the earlier one-host format (its planes at the top of the step directory, no `hosts`
in its manifest) is read as the one part it is (part_files): it resumes and exports as before.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import json
import os
import shutil
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.errors import ConfigError, ProtocolError
from megatrain.model.layout import STATE_PLANES

FORMAT = 2  # 2: per-file checksums per written segment (format 1, one CRC per file, is still read)
PLANES = STATE_PLANES  # a checkpoint holds the store's fp32 state (megatrain/model/layout.py)
CHUNK = 64 * 2**20  # bytes per write and per checksum: a multiple of any block size direct I/O needs
READERS = 4  # threads reading a checkpoint back (each reads and checks whole segments)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:07d}"


def hosts_tmp(root: Path, step: int) -> Path:
    """Where the hosts' parts of the checkpoint of `step` are written until publish_hosts (a *.tmp-* name:
    nothing takes it for a checkpoint, and remove_torn clears one an interrupted save left)."""
    return root / f"step-{step:07d}.tmp-hosts"


def part_name(host: int) -> str:
    """The directory of host `host`'s part of a checkpoint."""
    return f"host-{host}"


def part_files(manifest: dict) -> list[tuple[dict[str, str], list[tuple[int, int, int]]]]:
    """Per host of a checkpoint (its manifest given): its planes' files, as the manifest names them, and per unit
    the slice [lo, hi) its files hold and the element where that slice starts in them. A checkpoint of the
    earlier one-host format (no `hosts`: its planes at the top of the step directory, each unit whole at its
    tile's offset) is its one part."""
    if "hosts" not in manifest:
        whole = [(0, int(u["numel"]), int(u["offset"])) for u in manifest["units"]]
        return [({plane: f"{plane}.bin" for plane in PLANES}, whole)]
    return [
        (
            {plane: f"{part_name(h)}/{plane}.bin" for plane in PLANES},
            [(int(lo), int(hi), int(at)) for lo, hi, at in manifest["slices"][h]],
        )
        for h in range(int(manifest["hosts"]))
    ]


class PlaneFile:
    """One plane's file, written in chunks at their own offsets, in any order, from any thread: with
    O_DIRECT where the filesystem allows it (the disk reads shared memory itself: no copy into the page
    cache, no second copy of the state in RAM), else buffered. Every chunk gets its CRC-32."""

    def __init__(self, path: Path, nbytes: int):
        self.path, self.nbytes = path, nbytes
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            self.fd, self.direct = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644), hasattr(os, "O_DIRECT")
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.fd, self.direct = os.open(path, flags, 0o644), False  # e.g. an older tmpfs
        self._lock = threading.Lock()
        os.ftruncate(self.fd, nbytes)  # bytes no chunk covers (none, for a whole plane) read as zeros

    def write(self, data: np.ndarray, offset: int) -> list[int]:
        """data: uint8 view of shared memory; returns [offset, length, crc32]."""
        crc = zlib.crc32(data)  # releases the GIL: threads checksum and write in parallel
        view, pos = memoryview(data), offset
        while view.nbytes:
            direct = self.direct  # as it was for this attempt: another thread may turn it off meanwhile
            try:
                n = os.pwrite(self.fd, view, pos)
            except OSError as exc:  # an unaligned chunk or a filesystem that refuses O_DIRECT writes
                if exc.errno != errno.EINVAL or not direct:
                    raise
                self._buffered()
                continue
            view, pos = view[n:], pos + n
        return [offset, int(data.size), crc]

    def _buffered(self) -> None:
        with self._lock:
            if self.direct:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False

    def close(self, sync: bool = True) -> None:
        if self.fd < 0:
            return
        try:
            if sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1


def chunks(lo: int, hi: int) -> list[tuple[int, int]]:
    """Byte range [lo, hi) as CHUNK-sized (offset, length) pieces."""
    return [(o, min(CHUNK, hi - o)) for o in range(lo, hi, CHUNK)]


def read_plane(path: Path, out: np.ndarray, expect: dict, where: Callable[[int], str] | None = None) -> None:
    """Read a plane file into `out` (a view of shared memory), verifying its size and checksums;
    `where(byte offset)` names what a corrupt segment holds."""
    raw = out.view(np.uint8)
    size = path.stat().st_size if path.exists() else -1
    if size != expect["bytes"] or size != raw.size:
        raise ConfigError(
            f"train.resume: {path} has {size} bytes; its manifest says {expect['bytes']} and the store needs {raw.size}"
        )
    segments = expect.get("segments") or [[0, raw.size, expect["crc32"]]]  # format 1: one CRC for the file

    def read(seg: list[int]) -> str | None:
        off, n, crc = seg
        got = 0
        with open(path, "rb", buffering=0) as f:
            f.seek(off)
            while got < n:
                part = memoryview(raw[off + got : off + n])
                k = f.readinto(part)
                if not k:
                    break
                got += k
        have = zlib.crc32(raw[off : off + n])
        if got == n and have == crc:
            return None
        return "train.resume: " + corrupt(path, seg, have, where)

    with ThreadPoolExecutor(READERS) as pool:
        bad = [msg for msg in pool.map(read, segments) if msg]
    if bad:
        raise ConfigError(bad[0])


def corrupt(path: Path, segment: list[int], have: int, where: Callable[[int], str] | None) -> str:
    """What is wrong with a segment [offset, length, crc32] of a file whose bytes have CRC-32 `have`."""
    off, n, crc = segment
    what = f" ({where(off)})" if where else ""
    return f"{path} is corrupt: bytes {off}-{off + n}{what} have CRC-32 {have:08x}, the manifest says {crc:08x}"


def check_size(path: Path, expect: dict) -> None:
    """A plane file of a checkpoint being read is there at its manifest's size (a ConfigError naming it if not)."""
    size = path.stat().st_size if path.is_file() else -1
    if size != expect["bytes"]:
        raise ConfigError(f"train.resume: {path} has {size} bytes; its manifest says {expect['bytes']}")


def read_range(path: Path, expect: dict, lo: int, hi: int, out: np.ndarray, where: Callable[[int], str]) -> int:
    """Bytes [lo, hi) of a plane file into `out` (hi - lo bytes), each checksummed segment they touch read
    whole and checked against its CRC-32 (a ConfigError naming the file and what the segment holds if not):
    how a resume on another host count reads the elements of its slices. The bytes read are returned."""
    segments = expect.get("segments")
    if not segments:  # format 1: one checksum for the whole file, which only a whole read can check
        raise ConfigError(
            f"train.resume: {path} has one checksum for the whole file (an older checkpoint format): it resumes "
            "only on the host count it was written on"
        )
    i, pos, nbytes = max(bisect.bisect_right([s[0] for s in segments], lo) - 1, 0), lo, 0
    with open(path, "rb", buffering=0) as f:
        while pos < hi:
            seg = segments[i] if i < len(segments) else [hi, 0, 0]
            if not seg[0] <= pos < seg[0] + seg[1]:
                raise ConfigError(
                    f"train.resume: {path}: bytes {pos}-{hi} ({where(pos)}) are in no segment of its manifest"
                )
            f.seek(seg[0])
            buf = f.read(seg[1])
            if len(buf) != seg[1] or zlib.crc32(buf) != seg[2]:
                raise ConfigError("train.resume: " + corrupt(path, seg, zlib.crc32(buf), where))
            end = min(hi, seg[0] + seg[1])
            out[pos - lo : end - lo] = np.frombuffer(buf, np.uint8, end - pos, pos - seg[0])
            pos, i, nbytes = end, i + 1, nbytes + seg[1]
    return nbytes


def verify(directory: Path, where: Callable[[int], str] | None = None) -> str:
    """'' when the checkpoint in `directory` is whole: a valid manifest, every file of it at its size and every
    segment at its CRC-32; else what is wrong, on one line. Reads every byte (READERS threads, VERIFY_BUFFER
    bytes each at a time), so a resume is refused before anything starts rather than by the store owner."""
    manifest = manifest_of(directory)
    if manifest is None:
        return f"{directory} is not a complete checkpoint (no valid manifest.json, or a file it lists is missing)"
    for name in manifest["files"]:
        problem = verify_file(directory, name, where, manifest)
        if problem:
            return problem
    return ""


def verify_file(
    directory: Path, name: str, where: Callable[[int], str] | None = None, manifest: dict | None = None
) -> str:
    """verify() for one file of the checkpoint (export checks the weights it reads, params.bin)."""
    manifest = manifest or manifest_of(directory)
    if manifest is None or name not in manifest["files"]:
        return f"{directory} is not a complete checkpoint (no valid manifest.json listing {name})"
    entry = manifest["files"][name]
    if "host" in entry:  # a host's part: its offsets are of that host's slices, not of the whole units
        where = part_where(manifest, int(entry["host"]))
    return _verify_file(directory / name, entry, where)


VERIFY_BUFFER = 8 * 2**20


def _verify_file(path: Path, expect: dict, where: Callable[[int], str] | None) -> str:
    size = path.stat().st_size
    if size != expect["bytes"]:
        return f"{path} has {size} bytes; its manifest says {expect['bytes']}"
    segments = expect.get("segments") or [[0, size, expect["crc32"]]]  # format 1: one CRC for the file
    local = threading.local()

    def check(seg: list[int]) -> str:
        off, n, crc = seg
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(VERIFY_BUFFER)
        have, done = 0, 0
        with open(path, "rb", buffering=0) as f:
            f.seek(off)
            while done < n:
                k = f.readinto(memoryview(buf)[: min(VERIFY_BUFFER, n - done)])
                if not k:
                    break
                have = zlib.crc32(memoryview(buf)[:k], have)  # releases the GIL: the threads check in parallel
                done += k
        if done == n and have == crc:
            return ""
        return corrupt(path, seg, have, where)

    with ThreadPoolExecutor(READERS) as pool:
        return next((msg for msg in pool.map(check, segments) if msg), "")


def set_aside(directory: Path) -> Path:
    """Move a corrupt checkpoint out of the way, kept for a look: renamed `corrupt-step-NNNNNNN`, a name that
    complete(), latest() and prune() never take for a checkpoint."""
    target = directory.with_name(f"corrupt-{directory.name}")
    n = 1
    while target.exists():
        n += 1
        target = directory.with_name(f"corrupt-{directory.name}.{n}")
    os.rename(directory, target)
    return target


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(tmp: Path, final: Path, manifest: dict) -> None:
    """A directory written into `tmp` made `final`: its manifest, fsyncs, the rename, the parent fsync'ed."""
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    with open(tmp / "manifest.json", "rb") as f:
        os.fsync(f.fileno())
    fsync_dir(tmp)
    if final.exists():  # the same step written again (a resumed run that got here before): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def publish(tmp: Path, final: Path, manifest: dict) -> None:
    """Finish a checkpoint written into `tmp`: the manifest, fsyncs, the rename, then `latest`."""
    seal(tmp, final, manifest)
    pointer = final.parent / f".latest.tmp-{os.getpid()}"
    pointer.write_text(final.name + "\n")
    os.rename(pointer, final.parent / "latest")
    fsync_dir(final.parent)


def publish_hosts(root: Path, step: int, hosts: int) -> Path:
    """Make the hosts' parts of the checkpoint of `step` (one host: its one part; each published by its host's
    writer into hosts_tmp(root, step)) the checkpoint: the step's manifest from theirs, then as publish(). A
    part missing, or one of another step, host count or model, is refused: it would not be the run's state."""
    tmp = hosts_tmp(root, step)
    parts = [manifest_of(tmp / part_name(h)) for h in range(hosts)]
    for h, m in enumerate(parts):
        have = (m or {}).get("step"), (m or {}).get("hosts"), (m or {}).get("host"), (m or {}).get("layout_hash")
        if m is None or have != (step, hosts, h, parts[0]["layout_hash"]):  # part 0 is checked first
            raise ProtocolError(
                f"the checkpoint of step {step} over {hosts} hosts: {tmp / part_name(h)} is not host {h}'s part "
                "of it (missing, incomplete, or of another step, host count or model)"
            )
    final = step_dir(root, step)
    publish(tmp, final, hosts_manifest(parts))
    return final


def hosts_manifest(parts: list[dict]) -> dict:
    """The manifest of a checkpoint, from its hosts' parts' (host order): every part's files under
    the part's directory, each with its host; the units as one host's manifest lists them; per host, per unit,
    its slice [lo, hi) and the element where it starts in that host's files."""
    first = {k: v for k, v in parts[0].items() if k not in ("host", "plane_elems", "files", "units")}
    files = {
        f"{part_name(h)}/{name}": {**entry, "host": h}
        for h, m in enumerate(parts)
        for name, entry in m["files"].items()
    }
    units = [{k: v for k, v in u.items() if k not in ("slice", "slice_offset")} for u in parts[0]["units"]]
    slices = [[[*u["slice"], u["slice_offset"]] for u in m["units"]] for m in parts]
    return {**first, "files": files, "units": units, "slices": slices}


def remove_torn(root: Path, pattern: str = "*.tmp-*", keep: Path | None = None) -> list[str]:
    """Remove what interrupted saves left (`pattern`'s entries: *.tmp-*), all but `keep`."""
    gone = []
    for p in root.glob(pattern) if root.is_dir() else []:
        if p == keep:
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        gone.append(p.name)
    return gone


def manifest_of(path: Path) -> dict | None:
    """The manifest of a complete checkpoint directory, or None."""
    try:
        m = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(m, dict) and m.get("format") == FORMAT and all((path / f).is_file() for f in m.get("files", {}))
    return m if ok else None


def complete(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under `root`, oldest first."""
    out = []
    for p in root.glob("step-*") if root.is_dir() else []:
        if ".tmp-" not in p.name and p.is_dir() and manifest_of(p) is not None:
            out.append((int(manifest_of(p)["step"]), p))
    return sorted(out)


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint: the one `latest` names if it is complete, else the newest found."""
    try:
        named = root / (root / "latest").read_text().strip()
        if manifest_of(named) is not None:
            return named
    except OSError:
        pass
    found = complete(root)
    return found[-1][1] if found else None


def prune(root: Path, keep: int) -> list[str]:
    """Keep the newest `keep` complete checkpoints (0: all)."""
    found = complete(root)
    if keep <= 0 or len(found) <= keep:
        return []
    gone = []
    for _, p in found[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p.name)
    return gone


def layout_difference(manifest: dict, units: list[dict], layout_hash: str) -> str:
    """'' if the checkpoint's layout is this run's, else what differs (first difference)."""
    if manifest.get("layout_hash") == layout_hash:
        return ""
    theirs = manifest.get("units", [])
    if len(theirs) != len(units):
        return f"{len(theirs)} units in the checkpoint, {len(units)} in this model"
    for a, b in zip(theirs, units):
        for name in sorted(set(a["tensors"]) | set(b["tensors"])):
            if a["tensors"].get(name) != b["tensors"].get(name):
                return (
                    f"tensor '{name}': {a['tensors'].get(name)} in the checkpoint, {b['tensors'].get(name)} "
                    "in this model"
                )
    return "the store layout differs (alignment or layout version)"


def unit_at(layout: Any, byte_offset: int) -> str:
    """What lies at a byte offset of a plane file: the unit and the tensor."""
    elem = byte_offset // 4
    for u in layout.units:
        if u.offset <= elem < u.offset + u.tile:
            inside = [s for s in layout.structure_of(u.index).slots if s.offset <= elem - u.offset]
            name = layout.hf_name(u.index, inside[-1].name) if inside else "?"
            return f"unit {u.index}, from tensor '{name}'"
    return "past the last unit"


def part_where(manifest: dict, host: int) -> Callable[[int], str]:
    """unit_at for host `host`'s files of a checkpoint, from its manifest alone."""
    slices = part_files(manifest)[host][1]

    def where(byte_offset: int) -> str:
        elem = byte_offset // 4
        for unit, (lo, hi, start) in zip(manifest["units"], slices, strict=True):
            if start <= elem < start + hi - lo:
                inside = [(o, n) for n, (_, o) in unit["tensors"].items() if o <= elem - start + lo]
                return f"unit {unit['unit']}, from tensor '{max(inside)[1] if inside else '?'}'"
        return "past the last unit's slice"

    return where


def unit_table(layout: Any) -> list[dict]:
    """Per unit: its tile's element offset in every plane, and its tensors' HF names, shapes and offsets
    within the tile (what a reader needs without this code)."""
    out = []
    for u in layout.units:
        st = layout.structure_of(u.index)
        out.append(
            {
                "unit": u.index,
                "offset": u.offset,
                "numel": st.numel,
                "tensors": {layout.hf_name(u.index, s.name): [list(s.shape), s.offset] for s in st.slots},
            }
        )
    return out
