"""The token cache: each data file tokenized once, in parallel, into memory-mapped arrays.

An entry is keyed by the file's contents (a BLAKE2 hash), the tokenizer's files and the format
options, so an edited file, another tokenizer or another text_field never reuse a stale entry. It
is built in byte ranges that start at line boundaries, each range written to its own array file and
then copied into the entry: a 2 GB JSONL file is never in RAM whole. Chat and prompt/completion
records (template rendering and per-record calls: Python-bound) are encoded by one process per
core; text documents in this process, in batches the Rust tokenizer spreads over all cores.
Entries are written to a temporary directory and renamed, so a crash or a second run building the
same entry at the same time never leaves a half-written one.

Entry layout: ids.npy (uint16/uint32 tokens of all records back to back), mask.npy (uint8, 1 where
a token carries a label; absent for text, where every token does), offsets.npy (int64, records+1
record boundaries), meta.json.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain import log
from megatrain.config.data import DataConfig
from megatrain.data.records import Encoder, RecordError, jsonl_records, load_tokenizer, split_ranges
from megatrain.errors import DataError

FORMAT = 1  # bump when the encoding rules change: old entries are not reused
CHUNK_BYTES = 16 << 20  # the largest byte range one tokenizer process takes at a time
MIN_CHUNK_BYTES = 256 << 10
# Below this a file is tokenized in this process: starting the pool (its server imports transformers,
# hence torch) took ~10 s on the GPU machine, as long as one process takes for ~25 MB of chat JSONL.
POOL_MIN_BYTES = 32 << 20
DATASET_ROWS = 50_000  # rows of a save_to_disk dataset encoded into one part
STALE_S = 24 * 3600  # a temporary build directory this old was left by a killed build
_DATASET_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")  # what save_to_disk writes
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


@dataclass
class TokenFile:
    """One data file's tokens (memory-mapped): records back to back, with their label masks."""

    source: str
    ids: np.ndarray
    mask: np.ndarray | None  # None: every token carries a label
    offsets: np.ndarray | None  # record boundaries; None for a raw token file

    @property
    def records(self) -> int:
        return 0 if self.offsets is None else len(self.offsets) - 1


def cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("MEGATRAIN_CACHE") or str(Path.home() / ".cache" / "megatrain")
    return Path(root).expanduser() / "tokens"


def file_digest(path: str | Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def tokenizer_digest(directory: str) -> str:
    """The tokenizer's files (not the model's weights): another vocabulary or template is another key."""
    h = hashlib.blake2b(digest_size=16)
    for p in sorted(Path(directory).iterdir()):
        if p.is_file() and not p.name.endswith(_WEIGHTS) and not p.name.endswith(".index.json"):
            h.update(p.name.encode() + b"\0")
            h.update(p.read_bytes())
    return h.hexdigest()


def entry_key(source_digest: str, tok_digest: str, cfg: DataConfig) -> str:
    opts = {"format": FORMAT, "kind": cfg.kind, "tokenizer": tok_digest, "source": source_digest}
    opts.update(
        {"text": cfg.text_field}
        if cfg.kind == "text"
        else {"messages": cfg.messages_field}
        if cfg.kind == "chat"
        else {"prompt": cfg.prompt_field, "completion": cfg.completion_field}
    )
    return hashlib.blake2b(json.dumps(opts, sort_keys=True).encode(), digest_size=16).hexdigest()


def load_entry(directory: Path, source: str) -> TokenFile:
    mask = directory / "mask.npy"
    return TokenFile(
        source,
        np.load(directory / "ids.npy", mmap_mode="r"),
        np.load(mask, mmap_mode="r") if mask.exists() else None,
        np.load(directory / "offsets.npy", mmap_mode="r"),
    )


# ---- encoding (runs in the tokenizer processes, or in this one for small inputs) ---------------
_WORKER: dict[str, Any] = {}


def _init_worker(cfg: DataConfig, tok_dir: str, tok_key: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER["encoder"] = Encoder(cfg, load_tokenizer(tok_dir, tok_key))


def _encode(encoder: Encoder, records: Iterable[tuple[int, dict | None]], out: str, dtype: str) -> dict:
    """Encode records into the array file `out`; {'tokens', 'records'} or {'error': (index, message)}."""
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lens: list[int] = []
    at = -1
    group: list[tuple[int, dict]] = []

    def flush() -> None:
        for tokens, mask in encoder.encode_many(group):
            ids.append(np.asarray(tokens, dtype=dtype))
            if mask is not None:
                masks.append(np.asarray(mask, dtype=np.uint8))
            lens.append(len(tokens))
        group.clear()

    try:
        for at, rec in records:
            if rec is not None:
                group.append((at, rec))
            if len(group) == 256:  # one tokenizer call per group: most of the time is per call
                flush()
        flush()
    except RecordError as exc:
        return {"error": (exc.args[1], exc.args[0])}
    cat = np.concatenate(ids) if ids else np.zeros(0, dtype)
    np.savez(
        out, ids=cat, mask=np.concatenate(masks) if masks else np.zeros(0, np.uint8), lens=np.asarray(lens, np.int64)
    )
    return {"tokens": int(cat.size), "records": len(lens)}


def _encode_range(task: tuple[str, int, int, str, str]) -> dict:
    path, start, end, out, dtype = task
    return _encode(_WORKER["encoder"], jsonl_records(path, start, end), out, dtype)


# ---- building an entry ------------------------------------------------------------------------
class Builder:
    """Builds (or finds) the cache entry of each data file for one tokenizer and format."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, tok_dir: str, tok_key: str):
        self.cfg, self.tok, self.tok_dir, self.tok_key = cfg, tokenizer, tok_dir, tok_key
        self.tok_digest = tokenizer_digest(tok_dir)
        self.dtype = "uint16" if len(tokenizer) <= 1 << 16 else "uint32"
        self.encoder = Encoder(cfg, tokenizer)  # checks the tokenizer suits the kind before any work

    def get(self, source: str, key: str = "data.path") -> TokenFile:
        """The entry of one data file (or save_to_disk directory) named by config key `key`."""
        p = Path(source)
        if p.is_dir() and not any((p / m).is_file() for m in _DATASET_MARKERS):
            raise DataError(
                f"{key}: '{source}' is a directory, neither a JSONL file nor a directory written by "
                "datasets.save_to_disk (one split)"
            )
        digest = _dataset_digest(p) if p.is_dir() else file_digest(p)
        entry = cache_root(self.cfg) / entry_key(digest, self.tok_digest, self.cfg)
        if (entry / "meta.json").exists():
            return load_entry(entry, source)
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale(entry)
            tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
        except OSError as exc:
            raise DataError(f"data.cache_dir: cannot write the token cache in '{entry.parent}': {exc}") from None
        try:
            t0 = time.perf_counter()
            parts = self._parts_of_dataset(p, tmp, key) if p.is_dir() else self._parts_of_jsonl(p, tmp)
            meta = _assemble(parts, tmp, self.dtype, self.cfg.kind != "text")
            if meta["records"] == 0:
                raise DataError(f"{source}: no records (the file is empty)")
            dt = time.perf_counter() - t0
            meta.update(source=str(p.resolve()), kind=self.cfg.kind, seconds=dt, tokens_per_s=meta["tokens"] / dt)
            (tmp / "meta.json").write_text(json.dumps(meta))
            log(
                f"tokenized {source}: {meta['records']} records, {meta['tokens']} tokens in {dt:.1f}s "
                f"({meta['tokens'] / dt:,.0f} tokens/s); cached in {entry}"
            )
            try:
                tmp.rename(entry)
            except OSError:  # another run built the same entry meanwhile: keep theirs
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return load_entry(entry, source)

    def _parts_of_jsonl(self, path: Path, tmp: Path) -> list[Path]:
        size = path.stat().st_size
        workers = self.cfg.num_workers or len(os.sched_getaffinity(0))  # the cores this process may use
        # About four ranges per process, so that all of them stay busy to the end.
        chunk = min(CHUNK_BYTES, max(MIN_CHUNK_BYTES, -(-size // (4 * workers))))
        ranges = split_ranges(str(path), size, chunk)
        tasks = [(str(path), lo, hi, str(tmp / f"part-{i:06d}.npz"), self.dtype) for i, (lo, hi) in enumerate(ranges)]
        workers = min(workers, len(tasks)) if size >= POOL_MIN_BYTES else 1
        if self.cfg.kind == "text" and not self.cfg.num_workers:
            # Text is one batched tokenizer call per 256 documents, which the Rust tokenizer spreads over
            # all cores itself: on the 16-core GPU machine 2.4M tokens/s here against 1.4M in 16 processes.
            workers = 1
        if workers <= 1:
            return self._collect(path, tasks, self._here(tasks))
        # A process pool, not multiprocessing.Pool: a worker that dies (killed, out of memory) breaks the
        # pool with an error instead of being replaced forever while the caller waits.
        ctx = _context()
        try:
            with cf.ProcessPoolExecutor(workers, ctx, _init_worker, (self.cfg, self.tok_dir, self.tok_key)) as pool:
                try:
                    return self._collect(path, tasks, pool.map(_encode_range, tasks))
                except BaseException:  # a bad line (or Ctrl-C): do not tokenize the rest of the file first
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
        except BrokenProcessPool as exc:  # e.g. a __main__ that spawn cannot re-import (python - < script)
            log(f"tokenizer processes failed ({exc}); tokenizing {path} in this process")
            return self._collect(path, tasks, self._here(tasks))

    def _here(self, tasks: list) -> Iterator[dict]:
        """The byte ranges encoded one after the other in this process."""
        return (_encode(self.encoder, jsonl_records(*t[:3]), t[3], t[4]) for t in tasks)

    def _collect(self, path: Path, tasks: list, results: Iterator[dict]) -> list[Path]:
        parts, done, t0, shown = [], 0, time.perf_counter(), time.perf_counter()
        for task, res in zip(tasks, results):
            if "error" in res:
                line = _lines_before(str(path), task[1]) + res["error"][0] + 1
                raise DataError(f"{path}:{line}: {res['error'][1]}")
            parts.append(Path(task[3]))
            done += res["tokens"]
            if time.perf_counter() - shown > 5:
                shown = time.perf_counter()
                log(
                    f"tokenizing {path}: {task[2] / path.stat().st_size:.0%}, {done:,} tokens, "
                    f"{done / (shown - t0):,.0f} tokens/s"
                )
        return parts

    def _parts_of_dataset(self, path: Path, tmp: Path, key: str) -> list[Path]:
        """A datasets.save_to_disk directory, read row by row in this process ('line' = row number)."""
        try:
            import datasets
        except ImportError:
            raise DataError(
                f"{key} '{path}' is a directory: reading a datasets.save_to_disk directory needs "
                "the 'datasets' package (pip install datasets)"
            ) from None
        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as exc:
            raise DataError(f"{key} '{path}': not a datasets.save_to_disk directory: {exc}") from None
        if isinstance(ds, datasets.DatasetDict):
            raise DataError(f"{key} '{path}' holds several splits ({', '.join(ds)}); point at one split's directory")
        rows, parts = enumerate(ds), []
        for i in range(0, max(len(ds), 1), DATASET_ROWS):  # one part at a time in memory, as for JSONL
            parts.append(tmp / f"part-{i // DATASET_ROWS:06d}.npz")
            res = _encode(self.encoder, itertools.islice(rows, DATASET_ROWS), str(parts[-1]), self.dtype)
            if "error" in res:
                raise DataError(f"{path}: row {res['error'][0]}: {res['error'][1]}")
        return parts


def _remove_stale(entry: Path) -> None:
    """Temporary directories of this entry left by builds that were killed (SIGKILL, power loss)."""
    for old in entry.parent.glob(entry.name + ".tmp-*"):
        try:
            if time.time() - old.stat().st_mtime > STALE_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            continue


def _context() -> Any:
    """forkserver, with the tokenizer code preloaded in the server: the driver has threads (and maybe
    CUDA), so it must never fork itself, and spawning 16 workers that each import torch (transformers
    does) took longer than the tokenizing on the GPU machine; the server imports once, then forks."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["megatrain.data.cache", "transformers.models.auto.tokenization_auto"])
    return ctx


def stop_workers() -> None:
    """End the forkserver once the cache is built: it would otherwise idle beside the driver for the
    whole run (it also ends by itself when the driver exits, however that happens)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # CPython 3.8+: the one way to end it early
    if stop is not None:
        stop()


def _dataset_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode() + b"\0" + file_digest(p).encode())
    return h.hexdigest()


def _lines_before(path: str, offset: int) -> int:
    n = 0
    with open(path, "rb") as f:
        left = offset
        while left > 0 and (block := f.read(min(8 << 20, left))):
            n += block.count(b"\n")
            left -= len(block)
    return n


def _assemble(parts: list[Path], tmp: Path, dtype: str, masked: bool) -> dict:
    """Concatenate the parts into the entry's arrays, one part in memory at a time."""
    sizes = []
    for p in parts:
        with np.load(p) as z:
            sizes.append((int(z["ids"].size), int(z["lens"].size)))
    tokens, records = sum(s[0] for s in sizes), sum(s[1] for s in sizes)
    ids = np.lib.format.open_memmap(tmp / "ids.npy", "w+", dtype, (tokens,))
    mask = np.lib.format.open_memmap(tmp / "mask.npy", "w+", np.uint8, (tokens,)) if masked else None
    offsets = np.lib.format.open_memmap(tmp / "offsets.npy", "w+", np.int64, (records + 1,))
    offsets[0] = 0
    t = r = 0
    for p, (nt, nr) in zip(parts, sizes):
        with np.load(p) as z:
            ids[t : t + nt] = z["ids"]
            if mask is not None:
                mask[t : t + nt] = z["mask"]
            offsets[r + 1 : r + 1 + nr] = t + np.cumsum(z["lens"])
        p.unlink()
        t, r = t + nt, r + nr
    for arr in (ids, mask, offsets):
        if arr is not None:
            arr.flush()
    return {"tokens": tokens, "records": records}
