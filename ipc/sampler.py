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
import tempfile
import time
from pathlib import Path
from typing import IO

RATE = 250  # samples per second
# py-spy says this on stdout once it has attached (found the interpreter in the target's memory) and its sampling
# loop runs; before that nothing is sampled. Attaching reads the target's maps and symbols: a fraction of a second
# on an idle node, longer on a busy one, so start() waits for these words, not for a set time.
SAMPLING = "Sampling process"
START_S = 120.0  # only a py-spy that neither samples nor exits is given up on
POLL_S = 0.01
# py-spy writes its file on SIGINT. A Ray actor's call threads block SIGINT, and the signal mask (like
# an ignored disposition) survives fork and exec, so py-spy would never see it: it is started through
# this trampoline, which unblocks and restores SIGINT first (a preexec_fn would run Python in the child
# of a threaded process).
_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, []); "
    "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


class Sampler:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.path: Path | None = None
        # py-spy's output (stdout and stderr): a file, not a pipe, so that no reader thread of ours runs in the
        # process being sampled and py-spy never blocks on a full pipe
        self.output: IO[str] | None = None
        self.said = ""  # what it printed, kept once it has exited

    def start(self, path: str) -> str:
        """Sample this process into `path` until stop(); '' once py-spy samples, else why not."""
        # Also beside this interpreter: a virtual environment's scripts are there even when it is not on PATH.
        exe = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
        if exe is None:
            return "py-spy is not installed on this node (pip install py-spy)"
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            exe,
            "record",
            "--pid",
            str(os.getpid()),
            "--format",
            "speedscope",
            "--output",
            str(self.path),
            "--rate",
            str(RATE),
            "--nonblocking",
        ]
        self.output = tempfile.TemporaryFile("w+", errors="replace")  # noqa: SIM115 - open until py-spy has exited
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _DEFAULT_SIGINT, *cmd], stdout=self.output, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + START_S
        while SAMPLING not in self._said() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if SAMPLING in self._said():
            return ""
        stuck = self.proc.poll() is None
        if stuck:
            self.proc.kill()
        self._end()
        return (
            f"py-spy did not start sampling in {START_S:g} s"
            if stuck
            else f"py-spy exited at once: {self._complaint()}"
        )

    def stop(self, timeout: float = 60.0) -> str:
        """Stop sampling and write the file; '' when it was written, else py-spy's complaint."""
        proc = self.proc
        if proc is None:
            return "no sampler was running"
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        self._end(timeout)
        if self.path is not None and self.path.is_file() and self.path.stat().st_size > 0:
            return ""
        return f"py-spy wrote nothing (exit {proc.returncode}): {self._complaint()}"

    def _said(self) -> str:
        if self.output is None:
            return self.said
        # pread, not seek+read: py-spy writes through the same open file (one shared offset), and a seek here
        # would move its next write back over what it had said
        fd = self.output.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def _complaint(self) -> str:
        """py-spy's error line (it prints 'Error: ...' and maybe a backtrace under it), else its last line."""
        text = [line.strip() for line in self._said().splitlines() if line.strip()]
        errors = [line for line in text if line.startswith("Error")]
        return (errors or text or ["no message"])[-1]

    def _end(self, timeout: float = 60.0) -> None:
        """Wait for py-spy to exit, SIGKILLed after `timeout`."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self.output is not None:
            self.said = self._said()
            self.output.close()
            self.output = None
