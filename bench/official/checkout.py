"""Where the official MegaTrain code (github DLYuanGod/MegaTrain) is: a checkout outside this repository.

The repository holds only our glue (bench_official.py, make_model.py, run_official.sh); their code is
found, in this order, at --official-src PATH (bench/run.py) or --src PATH (bench_official.py), at
$MEGATRAIN_OFFICIAL_SRC, or at ../shared/peers/official/src beside the repository root when that exists.
Standard library only: bench_official.py imports it in the official code's environment.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ENV = "MEGATRAIN_OFFICIAL_SRC"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT.parent / "shared" / "peers" / "official" / "src"
# What bench_official.py takes from their tree: the trainer it calls, the model it wraps, the config it starts from.
NEEDED = ("examples/sft/train.py", "infinity/model/cpu_master.py", "examples/sft/configs/qwen_7b_1gpu.yaml")
WHAT = "a checkout of github.com/DLYuanGod/MegaTrain (the directory that holds infinity/ and examples/)"


class MissingCheckout(ValueError):
    """No usable checkout of the official code; the message says what to set."""


def official_src(given: str | None = None, flag: str | None = "--official-src") -> Path:
    """The checkout to run: `given` (the caller's command-line `flag`), else $MEGATRAIN_OFFICIAL_SRC, else
    DEFAULT when it exists. MissingCheckout names what was tried and what to set."""
    how = f"set {flag} PATH or {ENV} to {WHAT}" if flag else f"set {ENV} to {WHAT}"
    if given:
        return _checked(Path(given).expanduser(), f"{flag} {given}", how)
    if os.environ.get(ENV):
        return _checked(Path(os.environ[ENV]).expanduser(), f"{ENV}={os.environ[ENV]}", how)
    if DEFAULT.is_dir():
        return _checked(DEFAULT, f"the default {DEFAULT}", how)
    raise MissingCheckout(
        f"the official MegaTrain code is not in this repository and its default place {DEFAULT} does not exist: {how}"
    )


def _checked(path: Path, named: str, how: str) -> Path:
    if not path.is_dir():
        raise MissingCheckout(f"{named}: no such directory; {how}")
    missing = [rel for rel in NEEDED if not (path / rel).is_file()]
    if missing:
        raise MissingCheckout(f"{named}: not a checkout of the official code (no {', '.join(missing)}); {how}")
    return path.resolve()


def commit_of(src: Path) -> str:
    """The checkout's commit, short: from the SOURCE.txt of an extracted copy ('REPO COMMIT ...'), else from
    git; 'unknown commit' when neither says."""
    source = src / "SOURCE.txt"
    if source.is_file():
        words = source.read_text().split()
        if len(words) > 1:
            return words[1][:7]
    try:
        out = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown commit"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown commit"
