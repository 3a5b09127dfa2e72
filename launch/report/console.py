"""The console is best-effort; the run's files (checkpoints, metrics.jsonl, error.log) are not.

A Ctrl-C reaches the whole foreground process group: in `megatrain-launch CONFIG 2>&1 | tee run.log` the tee
dies at once, and every later write of the launcher meets a closed pipe (EPIPE); a closed terminal after SIGHUP
gives EIO, a full disk under `> run.log` ENOSPC. None of them may cost the run its stop's checkpoint. The
launcher's sys.stdout and sys.stderr are wrapped: a write that finds its stream gone turns the stream's file
descriptor into /dev/null (so the interpreter's exit flush finds nothing to complain about) and drops that
stream's output from then on, silently. Once a stop is requested, any OSError of the console is dropped so.

Where a stream is not a terminal (a file, a pipe, `ray job submit`), terminal escape codes (Ray's coloured
actor prefixes, a forced bar's cursor moves) are taken out of what is written; on a terminal, with NO_COLOR
set (no-color.org), the colours alone.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

# The stream's reader or device is gone, or its disk is full: nothing later written there can arrive.
GONE = frozenset({errno.EPIPE, errno.EIO, errno.ENOSPC, errno.EDQUOT})
# ECMA-48 control sequences (colours, cursor moves) and the two-byte escapes (charset selection and the like).
ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
COLOURS = re.compile(r"\x1b\[[0-9;:]*m")  # select graphic rendition: colours, bold, reset

_stopping = False  # a stop was requested: the console is best-effort whatever its error


class GuardedStream:
    """A text stream whose loss never raises: write and flush drop their text once the stream is gone."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.gone = False
        # no escape codes into a file or a pipe; no colours where the user's NO_COLOR asks for none
        self.plain = not _isatty(stream)
        self.strip = ESCAPES if self.plain else COLOURS if os.environ.get("NO_COLOR") else None

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                self.stream.write(self.strip.sub("", text) if self.strip else text)
            except OSError as exc:
                self._lost(exc)
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except OSError as exc:
                self._lost(exc)

    def say_now(self, text: str) -> None:
        """`text` straight to the file descriptor, past the stream's buffer and its lock: safe in a signal
        handler that may have interrupted a write of this same stream (the buffer would refuse to be re-entered)."""
        if self.gone:
            return
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError, AttributeError):  # no descriptor (a captured stream): the buffered way
            self.write(text)
            return
        try:
            data = text.encode(getattr(self.stream, "encoding", None) or "utf-8", "replace")
            while data:
                data = data[os.write(fd, data) :]
        except OSError as exc:
            self._lost(exc)

    def _lost(self, exc: OSError) -> None:
        if exc.errno not in GONE and not _stopping:
            raise exc
        self.gone = True
        _to_devnull(self.stream)

    def __getattr__(self, name: str) -> object:  # fileno, isatty, encoding, buffer...: the stream's own
        return getattr(self.stream, name)


def _to_devnull(stream: TextIO) -> None:
    """The stream's descriptor now writes to /dev/null, and what its buffer still holds goes there: the
    interpreter's flush at exit would otherwise print 'Exception ignored ... BrokenPipeError'."""
    try:
        fd = stream.fileno()
        os.fstat(fd)  # still open: a descriptor closed under the stream may be another file's by now
    except (OSError, ValueError, AttributeError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)
    try:
        stream.flush()
    except (OSError, ValueError):
        pass


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError, AttributeError):
        return False


@contextmanager
def guarded(restore: bool = True) -> Iterator[None]:
    """sys.stdout and sys.stderr wrapped while the block runs. `restore` False: left wrapped for the rest of the
    process (the launcher's own process: Ray's shutdown and the interpreter's exit write after the block)."""
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (_wrap(s) for s in old)
    try:
        yield
    finally:
        if restore:
            sys.stdout, sys.stderr = old


def _wrap(stream: TextIO | None) -> TextIO | None:
    return stream if stream is None or isinstance(stream, GuardedStream) else GuardedStream(stream)


def best_effort(on: bool = True) -> None:
    """A stop was requested: from now on no console error of any kind may end the run before its checkpoint
    (False: the request is over, for callers that run the launcher in-process)."""
    global _stopping
    _stopping = on


def say(text: str, err: bool = True) -> None:
    """One line to stderr (or stdout) from a signal handler: never raises, never re-enters a stream's buffer."""
    stream = sys.stderr if err else sys.stdout
    if isinstance(stream, GuardedStream):
        stream.say_now(text + "\n")
        return
    try:
        print(text, file=stream, flush=True)
    except (OSError, ValueError, RuntimeError):  # RuntimeError: a buffer this handler interrupted
        pass
