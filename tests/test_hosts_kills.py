"""Every actor of a two-host run SIGKILLed in turn, through real Ray on a simulated cluster of two nodes: the
run ends on every host, the one-line error and error.log name the actor that died first (`ROLE@hostH`, its
pid and node) whatever the order in which the other watchers' words reach the driver, its consequences go to
error.log, and the terminal shows no traceback (Ray's `Unhandled error` blocks of the other actors' failed
calls included). Nothing of the run is left behind."""

from __future__ import annotations

import os
import re
import signal
import socket

import pytest

from megatrain.ipc.shared.shm import host_run_id
from tests.harness import NO_AUTH, START_S, Cli, run_leftovers

pytestmark = pytest.mark.slow

# A two-host run on the CPU: its roles on every host (packers and accumulators need a GPU's slabs). The
# checkpoint writer is spawned with the run when checkpoints are due: one is, far beyond the steps run.
ROLES = ("store-owner", "gpu-executor", "adam-updater", "checkpoint-writer")
# Each host's executor holds its slice of the first two units' optimizer too (engine.gpu_optimizer).
RUN = ["actors.num_hosts=2", "engine.device=cpu", "train.save_every=100000", "train.final_eval=false"]
RUN += ["engine.gpu_optimizer=2"]


def actors(cli: Cli) -> dict[str, int]:
    """Every actor of the run by the name the run gives it in its messages (host 0's with `@host0`), with its pid."""
    line = cli.wait_for(r"actors: (.*)", timeout=START_S).group(1)
    pids = {name: int(pid) for name, pid in re.findall(r"([\w@-]+) pid (\d+)", line)}
    cli.tree |= set(pids.values())
    return {(name if "@host" in name else f"{name}@host0"): pid for name, pid in pids.items()}


@pytest.mark.parametrize("host", [0, 1])
@pytest.mark.parametrize("role", ROLES)
def test_a_killed_actor_is_named_with_its_host_pid_and_node_and_nothing_else_reaches_the_terminal(
    cluster,  # noqa: F811
    tmp_path,
    role: str,
    host: int,
) -> None:
    cli = Cli(tmp_path, *RUN, "--address", cluster.address, steps=100_000, env=NO_AUTH)
    pids = actors(cli)
    assert {f"{r}@host{h}" for r in ROLES for h in (0, 1)} <= set(pids), pids
    cli.wait_for(r"first step done", timeout=START_S)
    cli.snapshot()
    victim = f"{role}@host{host}"
    os.kill(pids[victim], signal.SIGKILL)
    assert cli.finish(timeout=180) == 1, cli.text()
    err, out = "".join(cli.stderr), "".join(cli.stdout)
    # the death itself, with its host, pid and node: on the terminal and in error.log alike
    named = f"actor '{victim}' (pid {pids[victim]}, node {socket.gethostname()})"
    last = [line for line in cli.stderr if line.startswith("megatrain-launch: error: ")]
    assert len(last) == 1 and named in last[0] and "died" in last[0], cli.text()
    log = (cli.out / "error.log").read_text()
    assert log.splitlines()[0] in last[0] and named in log.splitlines()[0], log
    # the other actors' failures are in error.log, as consequences; nothing of them on the terminal
    assert "consequences" in log, log
    for said in (err, out):
        assert "Traceback" not in said and "Unhandled error" not in said, cli.text()
    cli.assert_clean()
    assert run_leftovers(host_run_id(cli.run_id, 1)) == []
