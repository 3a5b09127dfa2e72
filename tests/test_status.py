"""`megatrain-launch status`: a run read from its control segment alone (no StoreSpec, no attach)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatrain.ipc.protocol import Store
from megatrain.ipc.protocol.status import read_run
from megatrain.launch.cli.main import main
from tests.shm_fixtures import ALL_PARTS, SHM, make_spec, owned, remove_all
from tests.test_shm import DEAD_OWNER, child_env


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
