"""`megatrain-launch status`: a run read from its control segment alone (no StoreSpec, no attach)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from megatrain.ipc.protocol import Store
from megatrain.ipc.shared.shm import host_run_id
from megatrain.ipc.status import read_run
from megatrain.launch.cli.main import main
from tests.shm_fixtures import ALL_PARTS, DEAD_OWNER, SHM, child_env, make_spec, owned, release, remove_all


def test_status_reads_what_each_actor_does(rid: str, model_spec, capsys) -> None:
    spec = make_spec(rid, model_spec)
    with owned(Store.create(spec)) as store:
        store.write_about({"output_dir": "/runs/x", "steps": 10})
        worker = Store.attach(spec, ALL_PARTS, role="packer-1")
        try:
            store.versions[:] = 4
            store.versions[1] = 3  # one piece behind: 3 updates applied to all of them
            worker.call_started()
            worker._waiting("the update of unit 2 (version 4)", +1)
            run = read_run(rid)
            assert run is not None and run.run_id == rid and run.owner_pid == os.getpid()
            assert run.updates == 3 and run.about["steps"] == 10 and run.about["output_dir"] == "/runs/x"
            assert run.about["roles"] == spec.roles() and run.about["params"] == spec.layout.num_params
            (packer,) = run.actors
            assert (packer.role, packer.pid, packer.alive, packer.state) == ("packer-1", os.getpid(), True, "waiting")
            assert packer.waiting_on == "the update of unit 2 (version 4)" and 0 <= packer.for_s < 60
            assert main(["status", "--shm-dir", SHM]) == 0
            out = capsys.readouterr().out
            assert f"run {rid}: step 3 of 10 applied" in out and "/runs/x" in out
            assert "packer-1" in out and "waiting" in out and "the update of unit 2" in out
            worker._waiting("", -1)
            assert read_run(rid).actors[0].state == "working"
            worker.call_ended()
            assert read_run(rid).actors[0].state == "idle"
            store.abort("an actor failed")
            assert read_run(rid).aborted == "an actor failed"
        finally:
            worker.close()


def test_status_says_no_runs(tmp_path, capsys) -> None:
    assert main(["status", "--shm-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "no runs"


@pytest.mark.shm_alone  # a dead owner's run: another run's sweep must not take it (tests/conftest.py)
def test_a_run_whose_owner_died_is_not_listed_but_named_for_cleanup(rid: str, capsys) -> None:
    try:
        subprocess.run(
            [sys.executable, "-c", DEAD_OWNER, rid],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(),
        )
        assert read_run(rid) is None
        assert main(["status"]) == 0
        out = capsys.readouterr().out
        (line,) = [x for x in out.splitlines() if rid in x]
        assert line.startswith(f"shared memory of run {rid} (3 objects) is left over from a run whose store owner")
        assert line.endswith("`megatrain-launch --cleanup` removes it (so does the next launch on this node)")
    finally:
        remove_all(rid)


def test_a_run_over_two_hosts_is_one_run_with_each_hosts_roles_named(rid: str, model_spec, capsys) -> None:
    """Host 1's store (its own run id, as hosts on one machine have it) is shown as host 1 of the same run, its
    roles as the driver names them (ROLE@host1), not as a run of its own."""
    resident = {"staging_mode": "resident", "slab_params": 2048}
    specs = [
        dataclasses.replace(make_spec(host_run_id(rid, h), model_spec, **resident), hosts=2, host=h) for h in (0, 1)
    ]
    stores, workers = [], []
    try:
        for spec in specs:
            stores.append(Store.create(spec))
            stores[-1].write_about({"output_dir": "/runs/two", "steps": 10})
            workers.append(Store.attach(spec, ("params",), role="adam-updater"))
        assert main(["status", "--shm-dir", SHM]) == 0
        out = capsys.readouterr().out
        assert f"run {rid}h1" not in out, out
        (head,) = [line for line in out.splitlines() if line.startswith(f"run {rid}:")]
        assert "over 2 hosts, hosts 0, 1 on this node" in head, out
        lines = out.splitlines()
        start = lines.index(head)  # this run's block (other runs may be alive on the machine)
        block = lines[start + 1 : next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), None)]
        assert f"  host 1: store {rid}h1, owner pid {os.getpid()}, step 0 applied" in block, out
        rows = [line.split() for line in block if line.startswith("  adam-updater")]
        assert [r[0] for r in rows] == ["adam-updater", "adam-updater@host1"], out
    finally:
        for w in workers:
            w.close()
        release(stores, [host_run_id(rid, 1)])


@pytest.mark.parametrize("argv", [["status"], ["--cleanup"]])
def test_a_shm_dir_that_is_no_directory_is_a_usage_error_naming_it(tmp_path, capsys, argv: list[str]) -> None:
    for path, what in ((tmp_path / "shmm", "no such directory"), (tmp_path / "file", "not a directory")):
        if path.name == "file":
            path.write_text("")
        assert main([*argv, "--shm-dir", str(path)]) == 2
        err = capsys.readouterr().err
        assert err == f"megatrain-launch: error: --shm-dir {path}: {what}\n", err
