"""A full disk is one line naming the directory, the bytes needed and free; a partial checkpoint is removed, an
earlier one stays intact, metrics.jsonl never ends in a partial row, and where error.log cannot be written the
console still gets the message.

On a real small filesystem where the machine allows it (a tmpfs mounted in a user namespace of the test's own:
`unshare -rm`; skipped where it is not allowed), and everywhere with the kernel's own partial write (a file
size limit) and an ENOSPC injected into the checkpoint writer in the middle of a write."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.errors import ConfigError, human_bytes
from megatrain.formats import checkpoint as ckpt
from megatrain.launch.cli import main as cli
from megatrain.launch.config.tree import load_config
from megatrain.launch.prepare.outdir import prepare_output
from megatrain.launch.report.metrics import MetricsFile
from megatrain.memory.hosts import host_plane_elems
from megatrain.model.spec import build_spec
from tests.harness import ROOT, TINY_DEFAULT

SMALL = [
    *TINY_DEFAULT,
    "train.eval_every=0",
    "train.final_eval=false",
    "train.log_every=1",
    "launch.runner=inprocess",
]


def whole_rows(metrics: Path) -> list[int]:
    """The steps of metrics.jsonl, after checking that every line of it is a whole row."""
    text = metrics.read_text()
    assert text.endswith("\n"), text[-200:]
    return [json.loads(line)["step"] for line in text.splitlines()]


# ---- a real small filesystem ----------------------------------------------------------------------------
# Runs as root of a user namespace of its own: mounts a tmpfs of SIZE bytes on MNT, runs the launcher with its
# output there, fills the rest of the tmpfs once metrics.jsonl holds FILL_AFTER rows (0: never), and copies what
# the run left (the filler aside) to COPY, with the exit code and output in COPY.json. NODES above 0: the
# launcher joins a Ray cluster of that many nodes simulated inside the namespace (they see the tmpfs too),
# shut down by pid at the end.
INNER = r"""
import json, os, shutil, subprocess, sys, time
mnt, size, fill_after, copy, nodes, *argv = sys.argv[1:]
subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt], check=True)
cluster = None
try:
    if int(nodes):
        os.environ["RAY_AUTH_MODE"] = "disabled"
        from ray.cluster_utils import Cluster
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
        for _ in range(int(nodes) - 1):
            cluster.add_node(num_cpus=3)
        cluster.wait_for_nodes()
        argv = [*argv, "--address", cluster.address]
    logs = {k: open(f"{copy}.{k}", "w+") for k in ("stdout", "stderr")}
    proc = subprocess.Popen([sys.executable, "-m", "megatrain.launch.cli.main", *argv], stdout=logs["stdout"],
                            stderr=logs["stderr"])
    metrics = os.path.join(mnt, "run", "metrics.jsonl")
    while int(fill_after) and proc.poll() is None:
        if os.path.exists(metrics) and open(metrics).read().count("\n") >= int(fill_after):
            with open(os.path.join(mnt, "filler"), "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError:
                    pass
            break
        time.sleep(0.01)
    try:  # the bound only ends a hang: a run over a cluster on a busy machine takes minutes
        rc = proc.wait(300 + 600 * bool(int(nodes)))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.copytree(mnt, copy, ignore=shutil.ignore_patterns("filler"))
    json.dump({"rc": rc, **{k: open(f"{copy}.{k}").read() for k in logs}}, open(copy + ".json", "w"))
finally:
    if cluster is not None:
        cluster.shutdown()
    subprocess.run(["umount", "-l", mnt])
"""


def _namespaces() -> bool:
    if not shutil.which("unshare") or not shutil.which("mount"):
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


small_fs = pytest.mark.skipif(not _namespaces(), reason="no user namespaces here (unshare -rm) for a small tmpfs")


def on_small_fs(tmp_path: Path, size: int, fill_after: int, *argv: str, nodes: int = 0) -> tuple[dict, Path]:
    mnt, copy = tmp_path / "mnt", tmp_path / "left"
    mnt.mkdir()
    subprocess.run(
        [
            "unshare",
            "-rm",
            sys.executable,
            "-c",
            INNER,
            str(mnt),
            str(size),
            str(fill_after),
            str(copy),
            str(nodes),
            *argv,
            f"train.output_dir={mnt / 'run'}",
        ],
        cwd=ROOT,
        check=True,
        timeout=500 + 600 * bool(nodes),
    )
    return json.loads(Path(f"{copy}.json").read_text()), copy / "run"


def checkpoint_bytes(*overrides: str) -> int:
    cfg = load_config(SMALL[0], [*SMALL[1:], *overrides])
    return build_spec(cfg.model, cfg.optim.no_decay_1d).layout.total * 4 * len(ckpt.PLANES)


def host_part_bytes(hosts: int) -> int:
    """One host's part of a checkpoint over `hosts` hosts: its slice of every unit, on the offsets all share."""
    cfg = load_config(SMALL[0], SMALL[1:])
    return host_plane_elems(build_spec(cfg.model, cfg.optim.no_decay_1d).layout, hosts) * 4 * len(ckpt.PLANES)


@small_fs
def test_a_checkpoint_that_does_not_fit_is_one_line_and_leaves_the_earlier_one(tmp_path: Path) -> None:
    """Room for one checkpoint and a half: the second is refused before a byte of it is written."""
    need = checkpoint_bytes()
    size = (int(need * 1.5) + (64 << 10)) // 4096 * 4096
    res, run = on_small_fs(tmp_path, size, 0, *SMALL, "train.steps=6", "train.save_every=2")
    err = res["stderr"]
    assert res["rc"] == 1, res
    line = [ln for ln in err.splitlines() if ln.strip()]
    assert len(line) == 1 and "Traceback" not in err and "OSError" not in err and "DiskFull" not in err, err
    assert (
        f"no space left on the disk of {tmp_path / 'mnt' / 'run' / 'checkpoints'}: the checkpoint of step 4 needs "
        in err
        and " free there (nothing of step 4 was left behind; the newest complete checkpoint, step-0000002, is intact"
        in err
    ), err
    assert [s for s, _ in ckpt.complete(run / "checkpoints")] == [2]
    assert not ckpt.verify(ckpt.step_dir(run / "checkpoints", 2))
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]
    assert whole_rows(run / "metrics.jsonl")[:2] == [1, 2]
    assert "no space left on the disk" in (run / "error.log").read_text()  # there was room for it


def _two_hosts_refused(tmp_path: Path, *argv: str, nodes: int = 0) -> tuple[str, Path]:
    """Two hosts write their parts of each checkpoint into one directory, with room for one part and not for
    both: the first checkpoint is refused before a byte of it is written, counting both parts."""
    part = host_part_bytes(2)
    size = (int(part * 1.5) + (16 << 10)) // 4096 * 4096
    res, run = on_small_fs(
        tmp_path, size, 0, *SMALL, *argv, "actors.num_hosts=2", "train.steps=4", "train.save_every=2", nodes=nodes
    )
    err = res["stderr"]
    assert res["rc"] == 1, res
    assert (
        f"no space left on the disk of {tmp_path / 'mnt' / 'run' / 'checkpoints'}: the checkpoint of step 2 needs "
        f"{human_bytes(2 * part)} (its 2 hosts' parts of {human_bytes(part)} each, all written into this "
        "directory); " in err
    ), err
    assert " free there (nothing of step 2 was left behind; no earlier checkpoint; " in err, err
    assert ckpt.complete(run / "checkpoints") == [], list((run / "checkpoints").iterdir())
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]
    steps = whole_rows(run / "metrics.jsonl")
    assert steps == list(range(1, len(steps) + 1)) and steps, steps
    return err, run


@small_fs
@pytest.mark.skip(
    reason="open: on a loaded machine its two hosts held in one process (the in-process runner) ran past the "
    "300 s bound twice (a hang before the refusal, not seen on an idle machine nor through Ray); the same "
    "refusal through two Ray nodes is tested below"
)
def test_every_host_s_part_is_counted_where_the_hosts_share_the_directory(tmp_path: Path) -> None:
    """Hosts simulated in one process, as hosts on one machine share its disk: each writer would find room for
    its own part, and the parts together would fill the disk part-way through."""
    err, _ = _two_hosts_refused(tmp_path)
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1 and "Traceback" not in err, err


@small_fs
@pytest.mark.slow
def test_a_full_disk_over_two_hosts_of_a_ray_cluster_is_one_line_on_the_terminal(tmp_path: Path) -> None:
    """The same over two nodes of a Ray cluster: both hosts' writers refuse the checkpoint, and the terminal shows
    the run's one line, no traceback of either writer or of the calls the failure ended (error.log has them)."""
    err, run = _two_hosts_refused(tmp_path, "launch.runner=ray", "engine.device=cpu", nodes=2)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("megatrain-launch: error: "), err
    assert "Traceback" not in err and "Unhandled error" not in err and "INFO worker.py" not in err, err
    assert "no space left on the disk of " in (run / "error.log").read_text()


@small_fs
def test_a_disk_filled_during_the_run_cuts_no_row(tmp_path: Path) -> None:
    """Another process fills the disk while the run writes metrics.jsonl: the row that does not fit is taken
    back whole and the run ends with one line. error.log gets the page the run's lock note gave back (or, when
    the filler took it first, is not written, and the line says so: test_error_log_that_cannot_be_written)."""
    res, run = on_small_fs(tmp_path, 1 << 20, 2, *SMALL, "train.steps=100000")
    err = res["stderr"]
    assert res["rc"] == 1, res
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1 and "Traceback" not in err, err
    assert f"no space left on the disk of {tmp_path / 'mnt' / 'run'}: step " in err, err
    assert "row of metrics.jsonl needs " in err and "B free there (the rows before it are whole)" in err, err
    steps = whole_rows(run / "metrics.jsonl")
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
    if "details in" in err:
        assert (run / "error.log").read_text().startswith("no space left on the disk of ")
    else:
        assert "error.log could not be written: No space left on device" in err and not (run / "error.log").exists()


def test_error_log_that_cannot_be_written_still_gives_the_line(tmp_path: Path, capsys) -> None:
    """A run's failure where error.log cannot be written (here: a directory of the kernel's, which takes no
    files): the console line comes all the same, and says why there are no details."""
    from types import SimpleNamespace

    from megatrain.errors import DiskFull

    code = cli._report(
        DiskFull("no space left on the disk of /x"),
        "no space left on the disk of /x",
        SimpleNamespace(log_dir=Path("/proc")),
    )
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(
        "megatrain-launch: error: no space left on the disk of /x (/proc/error.log could not be written: "
    ), err
    assert len(err.strip().splitlines()) == 1


# ---- everywhere --------------------------------------------------------------------------------------------
PARTIAL = r"""
import json, resource, signal, sys
from pathlib import Path
from megatrain.launch.report.metrics import MetricsFile
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write is cut short, then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
f = MetricsFile(Path(sys.argv[1]))
try:
    for step in range(1, 100):
        f.write_row({"step": step, "loss": 1.0, "pad": "x" * 150})
except OSError as exc:
    print(exc.errno)
"""


def test_a_row_cut_short_by_the_kernel_is_taken_back(tmp_path: Path) -> None:
    """The kernel writes the part of a row that fits under the file size limit, then refuses the rest: the file
    is cut back to the rows before it (the same path a full disk takes, with EFBIG for ENOSPC)."""
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run([sys.executable, "-c", PARTIAL, str(metrics)], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == str(errno.EFBIG), proc.stdout + proc.stderr
    assert whole_rows(metrics) == list(range(1, len(whole_rows(metrics)) + 1))
    assert 0 < metrics.stat().st_size < 1000


def test_an_enospc_in_the_middle_of_a_checkpoint_write_removes_it(tmp_path: Path, capsys, monkeypatch) -> None:
    """The disk fills while the writer is inside the checkpoint of step 4 (its first pieces are written):
    one line with the directory and the numbers, the partial checkpoint gone, step 2's intact."""
    real, calls = ckpt.PlaneFile.write, []

    def write(self, data, offset):  # noqa: ANN001
        calls.append(self.path)
        if "step-0000004" in str(self.path) and len([c for c in calls if "step-0000004" in str(c)]) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data, offset)

    monkeypatch.setattr(ckpt.PlaneFile, "write", write)
    out = tmp_path / "run"
    assert cli.main([*SMALL, "train.steps=6", "train.save_every=2", f"train.output_dir={out}"]) == 1
    err = capsys.readouterr().err
    said = (
        f"failed: no space left on the disk of {out / 'checkpoints'}: the checkpoint of step 4 needs "
        f"{human_bytes(checkpoint_bytes())};"
    )
    assert re.search(r"actor 'checkpoint-writer'( \(pid \d+\))? " + re.escape(said), err), err
    assert (
        "free there (nothing of step 4 was left behind; the newest complete checkpoint, step-0000002, is intact" in err
        and len(err.strip().splitlines()) == 1
    ), err
    assert [s for s, _ in ckpt.complete(out / "checkpoints")] == [2]
    assert not ckpt.verify(ckpt.step_dir(out / "checkpoints", 2))
    assert not [p for p in (out / "checkpoints").iterdir() if ".tmp-" in p.name]
    assert whole_rows(out / "metrics.jsonl")[:2] == [1, 2]
    assert "details in" in err and (out / "error.log").is_file()


def test_a_resume_drops_a_cut_off_last_row_and_names_a_bad_one_before_it(tmp_path: Path) -> None:
    """metrics.jsonl of an older run killed in the middle of a row: the row goes; a bad line inside the file is
    an error naming its file and line."""
    out = tmp_path / "run"
    out.mkdir()
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in range(1, 8)]
    (out / "metrics.jsonl").write_text("\n".join(rows) + "\n" + rows[0][:9])
    prepare_output(out, overwrite=False, resume_step=5)
    assert whole_rows(out / "metrics.jsonl") == [1, 2, 3, 4, 5]
    (out / "metrics.jsonl").write_text(rows[0] + '\n{"st\n' + rows[1] + "\n")
    with pytest.raises(ConfigError, match=rf"{out / 'metrics.jsonl'}:2: not a metrics row"):
        prepare_output(out, overwrite=False, resume_step=5)


def test_metrics_file_appends_whole_rows(tmp_path: Path) -> None:
    f = MetricsFile(tmp_path / "m.jsonl")
    try:
        f.write_row({"step": 1})
        f.write_row({"step": 2})
    finally:
        f.close()
    assert whole_rows(tmp_path / "m.jsonl") == [1, 2]


def test_plan_warns_when_the_checkpoints_do_not_fit(tmp_path: Path, capsys) -> None:
    """`megatrain-launch plan`: checkpoint size x (train.keep_last + one being written) against the output
    directory's free space; a warning when it is short (the verdict stays the memory's)."""
    each = checkpoint_bytes()
    out = tmp_path / "run"
    assert cli.main(["plan", *SMALL[:-1], "train.save_every=10", "train.keep_last=2", f"train.output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert (
        f"disk: {human_bytes(3 * each)} needed in {out}: checkpoints {human_bytes(3 * each)} (train.keep_last 2 + "
        f"one being written, {human_bytes(each)} each); " in printed
    ), printed
    assert "WARNING" not in printed
    many = shutil.disk_usage(tmp_path).free // each + 10  # more checkpoints, all kept, than the disk holds
    assert cli.main(["plan", *SMALL[:-1], "train.save_every=1", f"train.steps={many}", f"train.output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert f"checkpoints {human_bytes(many * each)} ({many}, all kept (train.keep_last 0)" in printed, printed
    assert "  WARNING: " in printed and " short: the run would stop when a checkpoint does not fit" in printed


def test_plan_counts_every_host_s_part_of_a_checkpoint(tmp_path: Path, capsys) -> None:
    """`plan --hosts 2`: every host's part of a checkpoint lands in the one output directory, so each checkpoint
    counts both parts (a host's own part alone would promise room the run does not have)."""
    part, out = host_part_bytes(2), tmp_path / "run"
    argv = ["plan", *SMALL[:-1], "train.save_every=10", "train.keep_last=2", f"train.output_dir={out}", "--hosts", "2"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        f"disk: {human_bytes(3 * 2 * part)} needed in {out}: checkpoints {human_bytes(3 * 2 * part)} (train.keep_last "
        f"2 + one being written, {human_bytes(2 * part)} each); " in printed
    ), printed
    assert f"  each checkpoint: the 2 hosts' parts of {human_bytes(part)} each, all in this directory" in printed
