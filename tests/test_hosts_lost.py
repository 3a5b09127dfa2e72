"""What a run over several hosts leaves when a part of it is lost, through real Ray on a cluster of two nodes
simulated on this machine (as tests/test_hosts_cluster.py makes one): a node whose raylet dies, the launcher
killed, a checkpoint write cut short. Nothing of the run may outlive it: no process of either host, no shared
memory of either host's store, no unfinished checkpoint directory."""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

from megatrain.ipc.shared.shm import host_run_id
from tests.harness import NO_AUTH, NODE_CPUS, Cli, run_leftovers

pytestmark = pytest.mark.slow

TWO_HOSTS = ("actors.num_hosts=2", "engine.device=cpu")


def _started(cli: Cli) -> dict[str, int]:
    """Every actor's pid, once the first step is done (each host's store is made and attached by then)."""
    line = cli.wait_for(r"actors: (.*)", timeout=300).group(1)
    pids = {name: int(pid) for name, pid in re.findall(r"([\w@-]+) pid (\d+)", line)}
    cli.tree |= set(pids.values())
    cli.wait_for(r"first step done", timeout=300)
    cli.snapshot()  # the stores' reapers too
    return pids


def _nothing_left(cli: Cli) -> None:
    cli.assert_clean(timeout=120)
    assert run_leftovers(host_run_id(cli.run_id, 1)) == []


def test_a_lost_node_ends_the_run_and_releases_its_hosts_store(cluster, tmp_path) -> None:  # noqa: F811
    """A node's raylet killed mid-run: the host on it ends its own part (its actors, its store; a Ray worker
    outlived its raylet), the run ends at once, naming the lost node, and nothing of either host is left. The
    cluster gets a fresh node in its place for the tests after this one."""
    node = cluster.list_all_nodes()[1]  # not the head: the cluster's GCS lives there
    cli = Cli(tmp_path, *TWO_HOSTS, "train.save_every=0", "--address", cluster.address, steps=10_000, env=NO_AUTH)
    try:
        _started(cli)
        os.kill(node.all_processes["raylet"][0].process.pid, signal.SIGKILL)
        assert cli.finish(timeout=300) == 1, cli.text()
        err = "".join(cli.stderr)
        assert "its Ray node was lost (the node's raylet, pid" in err, cli.text()
        _nothing_left(cli)
    finally:
        if cli.proc.poll() is None:
            os.killpg(cli.proc.pid, signal.SIGKILL)
        cluster.remove_node(node, allow_graceful=False)  # its other processes, by pid (and the raylet reaped)
        cluster.add_node(num_cpus=NODE_CPUS)
        cluster.wait_for_nodes()


def test_a_killed_launcher_releases_every_hosts_store(cluster, tmp_path) -> None:  # noqa: F811
    """The launcher SIGKILLed mid-run (nothing of its own runs): Ray ends the job's actors on every node, and each
    host's reaper unlinks its store."""
    cli = Cli(tmp_path, *TWO_HOSTS, "train.save_every=0", "--address", cluster.address, steps=10_000, env=NO_AUTH)
    _started(cli)
    os.killpg(cli.proc.pid, signal.SIGKILL)
    cli.finish()
    _nothing_left(cli)


def test_a_checkpoint_write_cut_short_over_two_hosts_leaves_no_unfinished_directory(cluster, tmp_path) -> None:  # noqa: F811
    """Host 1's writer stopped, then killed, while the hosts write a checkpoint: the run fails, and its end removes
    the step's unfinished directory (every host's part is written into it until the checkpoint is whole)."""
    cli = Cli(tmp_path, *TWO_HOSTS, "train.save_every=1", "--address", cluster.address, steps=10_000, env=NO_AUTH)
    pids = _started(cli)
    writer = pids["checkpoint-writer@host1"]
    os.kill(writer, signal.SIGSTOP)  # its part cannot be written: the checkpoint stays unfinished
    root = cli.out / "checkpoints"
    deadline = time.monotonic() + 300
    while not list(root.glob("step-*.tmp-hosts")) and time.monotonic() < deadline and cli.proc.poll() is None:
        time.sleep(0.05)
    unfinished = list(root.glob("step-*.tmp-hosts"))
    assert unfinished, cli.text()
    os.kill(writer, signal.SIGKILL)
    assert cli.finish(timeout=300) == 1, cli.text()
    assert not any(p.exists() for p in unfinished) and not list(root.glob("*.tmp-*")), list(root.iterdir())
    assert f"removed {unfinished[0].name} from {root}: this run's checkpoint write" in "".join(cli.stdout), cli.text()
    _nothing_left(cli)
    assert not psutil.pid_exists(writer) or psutil.Process(writer).status() == psutil.STATUS_ZOMBIE
