"""Children for tests that spawn processes: this module imports nothing heavy, since each child imports it."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def killed_rank(rank: int, out: str) -> None:
    """Rank 1 is killed as the OOM killer would; the others write a result."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    Path(out, f"rank{rank}.json").write_text('{"status": "ok"}')


def pipeline(argv: list[str]) -> int:
    """A terminal's shell running `CMD 2>&1 | tee LOG` (ERR "2>&1"), or `CMD 2>ERR | tee LOG`, in the foreground:
    argv is [LOG, ERR, "--", *CMD]. A Ctrl-C reaches the whole group: tee dies of it, this shell does not (a
    handler, not SIG_IGN, which its children would inherit); it exits with CMD's status, as $? would say."""
    import subprocess

    log, err, cmd = argv[0], argv[1], argv[3:]
    signal.signal(signal.SIGINT, lambda *_: None)
    read, write = os.pipe()
    errors = write if err == "2>&1" else os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        launched = subprocess.Popen(cmd, stdout=write, stderr=errors)
        try:
            tee = subprocess.Popen(["tee", log], stdin=read, stdout=subprocess.DEVNULL)
        except OSError:
            launched.kill()
            launched.wait()
            raise
    finally:
        for fd in {read, write, errors}:
            os.close(fd)
    code = launched.wait()
    print(f"tee exit {tee.wait()}", flush=True)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    import sys

    sys.exit(pipeline(sys.argv[1:]))
