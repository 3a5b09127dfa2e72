"""The run's output directory: one live run in it at a time (its lock), and no mixing of two runs' files (a
fresh run refuses another run's metrics, a resumed one keeps its own up to its checkpoint's step)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

import yaml

from megatrain import log
from megatrain.errors import ConfigError
from megatrain.formats import checkpoint as ckpt
from megatrain.ipc.procs import pid_alive

# What a run writes at the top of its output directory (final/ is the saved model).
RUN_FILES = ("metrics.jsonl", "config.yaml", "error.log", "timeline.json", "exit.log", "RESUME")
LIVE_FILE = ".megatrain-live.json"  # who holds the directory: written by the live run, removed when it ends


class OutputLock:
    """One live run per output directory: an exclusive flock on the directory itself, taken before anything
    in it is read or changed and held for the run's life. The kernel drops it when the process ends,
    however it ends, so a killed run never leaves a stale lock. The holder says who it is in LIVE_FILE,
    which is what a refused launch reports, and removes it when it lets go (a killed run's stays, naming a
    dead pid, which is then not reported)."""

    def __init__(self, out: Path, run_id: str):
        if out.exists() and not out.is_dir():
            raise ConfigError(f"train.output_dir: '{out}' exists and is not a directory")
        self.out, self.run_id, self.announced = out, run_id, False
        # The directories this launch makes: removed again when it lets go and they are still empty (a launch
        # refused for its input creates nothing).
        self.made = [p for p in (out, *out.parents) if not p.exists()]
        for _ in range(5):
            self.fd = self._lock()
            if self._same_directory():
                break
            os.close(self.fd)  # locked a directory that its last holder removed (empty) meanwhile: again
            self.fd = -1
        else:
            raise ConfigError(f"train.output_dir: '{out}' was removed again and again while this launch locked it")
        self._announce()

    def _lock(self) -> int:
        out = self.out
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise ConfigError(f"train.output_dir: cannot write to '{out}': {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"train.output_dir: '{out}' is in use by a live run ({self._holder()}); wait for it "
                "to end, or choose another train.output_dir"
            ) from None
        return fd

    def _same_directory(self) -> bool:
        try:
            return os.path.samestat(os.fstat(self.fd), os.stat(self.out))
        except OSError:
            return False

    def _announce(self) -> None:
        """Say who holds the directory (removed again by release: a launch refused later, for another reason,
        leaves the directory as it was)."""
        me = {"pid": os.getpid(), "run_id": self.run_id, "host": socket.gethostname(), "since": time.time()}
        tmp = self.out / (LIVE_FILE + ".tmp")
        tmp.write_text(json.dumps(me))
        os.replace(tmp, self.out / LIVE_FILE)
        self.announced = True

    def _holder(self) -> str:
        try:
            who = json.loads((self.out / LIVE_FILE).read_text())
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who["since"]))
            if who["host"] == socket.gethostname() and not pid_alive(int(who["pid"])):
                raise ValueError("a killed run's note")
            return f"pid {who['pid']} on {who['host']}, run {who['run_id']}, since {since}"
        except (OSError, ValueError, KeyError, TypeError):
            return "it is still starting: it has not said who it is yet"

    def release(self) -> None:
        """Idempotent; the process's end releases the lock too (LIVE_FILE then stays, naming a dead pid)."""
        if self.fd >= 0:
            if self.announced:
                (self.out / LIVE_FILE).unlink(missing_ok=True)
            for made in self.made:  # deepest first; still locked, so no launch is inside it
                try:
                    made.rmdir()
                except OSError:  # not empty: the run wrote something (or another launch made it too)
                    break
            os.close(self.fd)
            self.fd = -1


def resolve_output(template: str, run_id: str) -> Path:
    """train.output_dir as an absolute path. A relative one is relative to the working directory, except
    under `ray job submit`, whose working directory is Ray's package cache (shared by every job with the
    same files, and deleted with the cluster): there it is relative to $MEGATRAIN_OUTPUT_ROOT, else
    ~/megatrain, on the node that runs the driver."""
    path = Path(template.replace("{run_id}", run_id)).expanduser()
    if path.is_absolute():
        return path
    if in_ray_job():
        return Path(os.environ.get("MEGATRAIN_OUTPUT_ROOT") or Path.home() / "megatrain").expanduser().resolve() / path
    return path.resolve()


def in_ray_job() -> bool:
    """This process is a `ray job submit` entrypoint (Ray sets this variable for it and its children)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def check_free(out: Path, overwrite: bool) -> None:
    """Refuse, before anything starts, an output directory that prepare_output would refuse for a run starting
    afresh in it: not a directory, or holding another run's metrics (without train.overwrite)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.output_dir: '{out}' exists and is not a directory")
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0 and not overwrite:
        raise ConfigError(_occupied(out, metrics))


def prepare_output(out: Path, overwrite: bool, resume_step: int | None = None) -> None:
    """Create `out`, or reuse it: to continue its own run from a checkpoint at `resume_step` (metrics.jsonl
    kept up to that step), or when it holds no other run's metrics, or when train.overwrite says to
    replace them; an earlier run's other files are removed so none is left beside the new metrics."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.output_dir: '{out}' exists and is not a directory")
    metrics = out / "metrics.jsonl"
    if resume_step is not None and metrics.is_file():
        _keep_rows_up_to(metrics, resume_step)
    elif metrics.is_file() and metrics.stat().st_size > 0 and not overwrite:
        raise ConfigError(_occupied(out, metrics))
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".megatrain-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"train.output_dir: cannot write to '{out}': {exc.strerror or exc}") from None
    keep = {"metrics.jsonl"} if resume_step is not None else set()
    stale = [out / name for name in RUN_FILES if (out / name).exists() and name not in keep]
    stale += sorted(out.glob("profile-step-*.json"))
    if (out / "final" / "config.json").is_file():
        stale.append(out / "final")
    if resume_step is None and overwrite and (out / "checkpoints").is_dir():
        stale.append(out / "checkpoints")
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if resume_step is not None:  # the same run going on: its metrics continue, the rest is written anew
        log(
            f"continuing the run in {out}: metrics.jsonl kept through step {resume_step} (the steps after it are "
            f"redone)"
            + (
                f"; {', '.join(p.name for p in stale)} from before the stop removed (this run writes its own)"
                if stale
                else ""
            )
        )
    elif stale:
        log(f"removed an earlier run's files from {out}: {', '.join(p.name for p in stale)}")


def _occupied(out: Path, metrics: Path) -> str:
    """Why a fresh run may not start in `out`, which holds another run's metrics, and what to do instead."""
    steps = sum(1 for _ in metrics.open())
    early = None if ckpt.latest(out / "checkpoints") is not None else _ended_early(out, _last_step(metrics))
    if early:
        return (
            f"train.output_dir: '{out}' holds a run that {early}, before its first checkpoint: there is nothing to "
            "resume (metrics.jsonl, no checkpoint); train.overwrite=true starts over in it, replacing its files, "
            "or choose another train.output_dir"
        )
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(metrics.stat().st_mtime))
    return (
        f"train.output_dir: '{out}' holds another run's metrics ({steps} steps in metrics.jsonl, "
        f"last written {when}); choose another train.output_dir (the default runs/{{run_id}} is "
        f"new for every run), or set train.overwrite=true to replace that run's files"
    )


def _ended_early(out: Path, last: int) -> str | None:
    """How the run of `out` ended before its last step, from what it left (its error.log, its config.yaml's
    train.steps against its last metrics row), or None: it ended at its last step, or it cannot be told."""
    if (out / "error.log").is_file():
        return f"failed after step {last} (its error.log says why)"
    try:
        saved = yaml.safe_load((out / "config.yaml").read_text()) or {}
        planned = int(saved["train"]["steps"]) if not (saved.get("data") or {}).get("epochs") else None
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None
    return f"stopped after step {last} of {planned}" if planned is not None and last < planned else None


def _last_step(metrics: Path) -> int:
    """The step of the last whole row of metrics.jsonl (0 when there is none)."""
    for line in reversed(metrics.read_text().splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def _keep_rows_up_to(metrics: Path, step: int) -> None:
    """A resumed run redoes the steps after its checkpoint: their old rows go (written atomically). A cut-off
    last line (a run killed, or its disk full, in the middle of a row) goes too; a bad line before it is an
    error naming it."""
    lines = metrics.read_text().splitlines(keepends=True)
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines):
                log(f"{metrics}:{i}: a cut-off last row (the run was stopped while writing it) is dropped")
                continue
            raise ConfigError(
                f"{metrics}:{i}: not a metrics row (JSON); remove or repair that line to resume this run"
            ) from None
        if row.get("step", 0) <= step:
            rows.append(line if line.endswith("\n") else line + "\n")
    tmp = metrics.with_suffix(".jsonl.tmp")
    try:
        tmp.write_text("".join(rows))
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk: metrics.jsonl stays as it was
        raise
    os.replace(tmp, metrics)
