"""py-spy sampling one process of a run (train.profile.actor), started by that process on its own node.

py-spy runs as a child of the sampled process, which needs ptrace rights over its parent: root (or
CAP_SYS_PTRACE), or kernel.yama.ptrace_scope 0. It samples without stopping the target (--nonblocking)
and writes a speedscope file when it gets SIGINT. If the target dies first, py-spy exits with it (and
Ray ends a dead worker's children), so a failed run leaves no sampler behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

RATE = 250  # samples per second
ATTACH_S = 1.0
# py-spy writes its file on SIGINT. A Ray actor's call threads block SIGINT, and the signal mask (like
# an ignored disposition) survives fork and exec, so py-spy would never see it: it is started through
# this trampoline, which unblocks and restores SIGINT first (a preexec_fn would run Python in the child
# of a threaded process).
_DEFAULT_SIGINT = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, []); "
                   "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])")


class Sampler:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.path: Path | None = None

    def start(self, path: str) -> str:
        """Sample this process into `path` until stop(); '' when started, else why not."""
        # Also beside this interpreter: a virtual environment's scripts are there even when it is not on PATH.
        exe = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
        if exe is None:
            return "py-spy is not installed on this node (pip install py-spy)"
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [exe, "record", "--pid", str(os.getpid()), "--format", "speedscope", "--output", str(self.path),
               "--rate", str(RATE), "--nonblocking"]
        self.proc = subprocess.Popen([sys.executable, "-c", _DEFAULT_SIGINT, *cmd], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        try:  # py-spy takes a moment to attach: the step it is for must not start before it samples
            self.proc.wait(ATTACH_S)
        except subprocess.TimeoutExpired:
            return ""
        why, self.proc = self.proc.communicate()[1].strip(), None
        return f"py-spy exited at once: {why.splitlines()[-1] if why else 'no message'}"

    def stop(self, timeout: float = 60.0) -> str:
        """Stop sampling and write the file; '' when it was written, else py-spy's complaint."""
        proc, self.proc = self.proc, None
        if proc is None:
            return "no sampler was running"
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if self.path is not None and self.path.is_file() and self.path.stat().st_size > 0:
            return ""
        last = [line for line in (err or "").strip().splitlines() if line.strip()]
        return f"py-spy wrote nothing (exit {proc.returncode}): {last[-1] if last else 'no message'}"
