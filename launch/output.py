"""The run's output directory: refuse to mix two runs' files, and make sure it can be written."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from megatrain import log
from megatrain.errors import ConfigError

# What a run writes at the top of its output directory (final/ is the saved model).
RUN_FILES = ("metrics.jsonl", "config.yaml", "config-full.yaml", "error.log", "timeline.json")


def prepare_output(out: Path, overwrite: bool) -> None:
    """Create `out`, or reuse it when it holds no other run's metrics (or train.overwrite says to replace
    them); an earlier run's files are removed so none is left beside the new metrics."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.output_dir: '{out}' exists and is not a directory")
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0 and not overwrite:
        steps = sum(1 for _ in metrics.open())
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(metrics.stat().st_mtime))
        raise ConfigError(f"train.output_dir: '{out}' holds another run's metrics ({steps} steps in metrics.jsonl, "
                          f"last written {when}); choose another train.output_dir (the default runs/{{run_id}} is "
                          f"new for every run), or set train.overwrite=true to replace that run's files")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".megatrain-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"train.output_dir: cannot write to '{out}': {exc.strerror or exc}") from None
    stale = [out / name for name in RUN_FILES if (out / name).exists()] + sorted(out.glob("profile-step-*.json"))
    if (out / "final" / "config.json").is_file():
        stale.append(out / "final")
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if stale:
        log(f"removed an earlier run's files from {out}: {', '.join(p.name for p in stale)}")
