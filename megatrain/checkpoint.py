"""The on-disk checkpoint: one directory per step, complete or absent.

OUTPUT_DIR/checkpoints/step-NNNNNNN/ holds, for each fp32 plane of the store (params, exp_avg,
exp_avg_sq), one raw file with the plane exactly as it lies in shared memory (every unit's tile at its
4 KiB-aligned offset, padding zero), and manifest.json: the step, the layout hash, per unit its HF
tensor names, shapes and offsets, per file its bytes and CRC-32, the data position and seeds, and the
resolved config. It is written into step-NNNNNNN.tmp-PID, every file fsync'ed, renamed, the parent
fsync'ed, and only then `latest` (a one-line file, itself written by rename) points at it. A crash at
any moment leaves either the previous state or a *.tmp-* directory, which nothing reads and the next
save removes; a directory without a valid manifest is never taken for a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.errors import ConfigError

FORMAT = 1
PLANES = ("params", "exp_avg", "exp_avg_sq")
CHUNK = 64 * 2**20  # bytes per write and per checksum update


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:07d}"


def write_plane(path: Path, plane: np.ndarray) -> dict:
    """Write a plane (a 1-D array view of shared memory) in chunks, fsync'ed; its bytes and CRC-32."""
    raw = plane.view(np.uint8)
    crc = 0
    with open(path, "wb", buffering=0) as f:
        for lo in range(0, raw.size, CHUNK):
            part = raw[lo: lo + CHUNK]
            crc = zlib.crc32(part, crc)
            f.write(memoryview(part))
        os.fsync(f.fileno())
    return {"bytes": int(raw.size), "crc32": crc}


def read_plane(path: Path, out: np.ndarray, expect: dict) -> None:
    """Read a plane file into `out` (a view of shared memory), verifying its size and CRC-32."""
    raw = out.view(np.uint8)
    size = path.stat().st_size if path.exists() else -1
    if size != expect["bytes"] or size != raw.size:
        raise ConfigError(f"train.resume: {path} has {size} bytes; its manifest says {expect['bytes']} and the "
                          f"store needs {raw.size}")
    crc = 0
    with open(path, "rb", buffering=0) as f:
        for lo in range(0, raw.size, CHUNK):
            n = f.readinto(memoryview(raw[lo: lo + CHUNK]))
            crc = zlib.crc32(raw[lo: lo + n], crc)
    if crc != expect["crc32"]:
        raise ConfigError(f"train.resume: {path} is corrupt (CRC-32 {crc:08x}, the manifest says "
                          f"{expect['crc32']:08x})")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path, manifest: dict) -> None:
    """Finish a checkpoint written into `tmp`: the manifest, fsyncs, the rename, then `latest`."""
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    with open(tmp / "manifest.json", "rb") as f:
        os.fsync(f.fileno())
    fsync_dir(tmp)
    if final.exists():  # the same step written again (a resumed run that got here before): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    pointer = final.parent / f".latest.tmp-{os.getpid()}"
    pointer.write_text(final.name + "\n")
    os.rename(pointer, final.parent / "latest")
    fsync_dir(final.parent)


def remove_torn(root: Path) -> list[str]:
    """Remove what interrupted saves left (*.tmp-* entries)."""
    gone = []
    for p in root.glob("*.tmp-*") if root.is_dir() else []:
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
                return (f"tensor '{name}': {a['tensors'].get(name)} in the checkpoint, {b['tensors'].get(name)} "
                        "in this model")
    return "the store layout differs (alignment or layout version)"


def unit_table(layout: Any) -> list[dict]:
    """Per unit: its tile's element offset in every plane, and its tensors' HF names, shapes and offsets
    within the tile (what a reader needs without this code)."""
    out = []
    for u in layout.units:
        st = layout.structure_of(u.index)
        out.append({"unit": u.index, "offset": u.offset, "numel": st.numel,
                    "tensors": {layout.hf_name(u.index, s.name): [list(s.shape), s.offset] for s in st.slots}})
    return out
