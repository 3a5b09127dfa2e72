"""One classification of a run id's shared memory (ipc/shared/segments.py) behind `status`, `--cleanup` and a launch
that names its run id: for every kind of segment the three agree, in the same words. Real files in a
temporary shm dir (POSIX shared memory is a file in /dev/shm, read and removed the same way), held by real
mappings and descriptors of this process; one launch through /dev/shm itself."""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import posix_ipc
import pytest

from megatrain.errors import ConfigError
from megatrain.ipc import procs
from megatrain.ipc.shared import segments
from megatrain.ipc.shared.shm import HEADER_BYTES, LAYOUT_VERSION, seg_name
from megatrain.launch.cli import main as cli
from tests.harness import ROOT
from tests.shm_fixtures import dead_pid, header, put


@contextmanager
def mapped(path: Path) -> Iterator[None]:
    """This process maps the file (its descriptor closed, as a store's owner and workers do)."""
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    try:
        yield
    finally:
        mm.close()


@contextmanager
def opened(path: Path) -> Iterator[None]:
    """This process has the file open, not mapped: a creator between shm_open and mmap."""
    with open(path, "rb"):
        yield


def say(capsys, *argv: str) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def agree(capsys, shm_dir: Path, rid: str) -> segments.Found:
    """status, --cleanup and a launch naming `rid` on the same segment: status says what it is and what to do,
    cleanup removes exactly what status called removable (and says the same line of what it keeps), and the
    launch is refused in the same words, or goes ahead, where cleanup would remove it."""
    before = sorted(p.name for p in shm_dir.iterdir())
    f = segments.classify(rid, before, str(shm_dir))
    status = say(capsys, "status", "--shm-dir", str(shm_dir))
    assert f.line() in status.splitlines() and f.state in f.line(), status
    assert ("--cleanup" in f.line()) == f.removable
    if f.removable:
        segments.check_run_id_free(rid, str(shm_dir))  # no conflict: the store owner's sweep removes it
    else:
        with pytest.raises(ConfigError) as refused:
            segments.check_run_id_free(rid, str(shm_dir))
        assert str(refused.value) == f.refusal() and f.state in str(refused.value)
    cleaned = say(capsys, "--cleanup", "--shm-dir", str(shm_dir))
    after = sorted(p.name for p in shm_dir.iterdir())
    if f.removable:
        assert after == [] and all(name in cleaned for name in before), cleaned
        assert say(capsys, "status", "--shm-dir", str(shm_dir)).strip() == "no runs"
    else:
        assert after == before and f"not removed: {f.line()}" in cleaned, cleaned
    return f


def test_a_dead_run_of_this_version_is_named_and_removed(tmp_path: Path, capsys) -> None:
    rid = "dead" + secrets.token_hex(3)
    pid = dead_pid()
    put(tmp_path, f"megatrain-{rid}-ctl", header(rid, pid=pid))
    put(tmp_path, f"megatrain-{rid}-params", header(rid, pid=pid))
    put(tmp_path, f"sem.megatrain-{rid}-sem-wfree0", b"")
    f = agree(capsys, tmp_path, rid)
    assert (f.kind, f.owner_pid, f.removable) == (segments.DEAD, pid, True)
    assert f"is left over from a run whose store owner (pid {pid}) is gone" in f.line()


def test_another_layout_version_goes_only_once_nothing_holds_it(tmp_path: Path, capsys) -> None:
    """A segment of another MegaTrain version: in use while a process maps it, or while the owner its
    header names lives; left over once neither is so."""
    rid = "other" + secrets.token_hex(3)
    ctl = put(tmp_path, f"megatrain-{rid}-ctl", header(rid, version=LAYOUT_VERSION + 7, pid=dead_pid()))
    with mapped(ctl):
        f = agree(capsys, tmp_path, rid)
    assert (f.kind, f.version, f.holders, f.removable) == (
        segments.OTHER_VERSION,
        LAYOUT_VERSION + 7,
        (os.getpid(),),
        False,
    )
    assert f"in use by a run of another MegaTrain version (layout version {LAYOUT_VERSION + 7}" in f.line()
    me = os.getpid()
    put(tmp_path, ctl.name, header(rid, version=1, pid=me, ticks=procs.start_ticks(me)))
    f = agree(capsys, tmp_path, rid)  # held by no mapping, but its owner is this live process
    assert (f.kind, f.holders, f.removable) == (segments.OTHER_VERSION, (me,), False)
    put(tmp_path, ctl.name, header(rid, version=1, pid=dead_pid()))
    f = agree(capsys, tmp_path, rid)
    assert (f.kind, f.removable) == (segments.OTHER_VERSION, True)
    assert "layout version 1; this one's is" in f.line() and "no process holds it" in f.line()


@pytest.mark.parametrize("hold", [None, mapped, opened], ids=["unheld", "mapped", "open"])
def test_an_unreadable_header_goes_at_once_unless_a_process_holds_it(tmp_path: Path, capsys, hold) -> None:
    """Fresh garbage where the header goes (no MegaTrain magic): nothing waits for it to age. Held (a store
    being created has it open, then mapped), it is in use for all three; unheld, it is removable for all."""
    rid = "junk" + secrets.token_hex(3)
    ctl = put(tmp_path, f"megatrain-{rid}-ctl", secrets.token_bytes(64))
    with ExitStack() as stack:
        if hold is not None:
            stack.enter_context(hold(ctl))
        f = agree(capsys, tmp_path, rid)
    assert (f.kind, f.problem) == (segments.UNREADABLE, "a control segment without MegaTrain's header")
    assert f.removable == (hold is None) and f.holders == (() if hold is None else (os.getpid(),))


def test_a_short_control_segment_and_one_missing(tmp_path: Path, capsys) -> None:
    rid = "short" + secrets.token_hex(3)
    (tmp_path / f"megatrain-{rid}-ctl").write_bytes(b"MEGATRN")
    f = agree(capsys, tmp_path, rid)
    assert (f.problem, f.removable) == ("a control segment shorter than its header", True)
    put(tmp_path, f"megatrain-{rid}-params", header(rid, pid=os.getpid(), ticks=procs.start_ticks(os.getpid())))
    f = agree(capsys, tmp_path, rid)  # a store part with no control segment: nothing says whose it is
    assert (f.problem, f.removable) == ("no control segment", True)


def test_a_live_runs_id_is_refused_at_once_before_anything_starts(
    tmp_path: Path, rid: str, capsys, monkeypatch
) -> None:
    """A launch that names a run id whose shared memory is in use exits 2 before Ray or an actor starts,
    with status's words; and its Store.create says the same where it gets that far."""
    from megatrain.launch.run import startup

    def spawned(*_a, **_k):
        raise AssertionError("the launch spawned actors before refusing the run id")

    monkeypatch.setattr(startup, "spawn_actors", spawned)
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    ctl = put(shm_dir, f"megatrain-{rid}-ctl", header(rid, version=LAYOUT_VERSION + 1, pid=dead_pid()))
    out = tmp_path / "out"
    argv = [str(ROOT / "examples/default.yaml"), f"train.run_id={rid}", f"ipc.shm_dir={shm_dir}"]
    with mapped(ctl):
        f = segments.classify(rid, [ctl.name], str(shm_dir))
        assert cli.main([*argv, f"train.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert f.refusal() in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.shm_alone  # a leftover in /dev/shm: another run's sweep would take it mid-test (tests/conftest.py)
def test_a_launch_goes_ahead_over_a_leftover_of_its_run_id_and_removes_it(tmp_path: Path, rid: str) -> None:
    """Garbage where the run's control segment goes, written a moment ago and held by nothing: the launch
    naming that run id is not refused, its store owner's sweep removes the leftover and the run trains."""
    from megatrain.launch.config.tree import load_config
    from megatrain.launch.run.driver import Trainer

    junk = posix_ipc.SharedMemory(seg_name(rid, "ctl"), posix_ipc.O_CREX, mode=0o600, size=HEADER_BYTES)
    with mmap.mmap(junk.fd, HEADER_BYTES) as mm:
        mm[:64] = secrets.token_bytes(64)
    junk.close_fd()
    assert segments.classify(rid, [f"megatrain-{rid}-ctl"]).removable
    cfg = load_config(
        str(ROOT / "examples/default.yaml"),
        [
            f"train.run_id={rid}",
            "train.steps=2",
            "train.eval_every=0",
            "data.batch_size=2",
            "data.seq_len=32",
            f"train.output_dir={tmp_path / 'out'}",
            "launch.runner=inprocess",
        ],
    )
    summary = Trainer(cfg).run()
    assert summary.run_id == rid and len(summary.metrics) == 2
