"""A run over several hosts through real Ray: a cluster of several nodes simulated on this machine (raylets of
their own, ray.cluster_utils.Cluster), each host of the run placed on a node of its own by one placement group.
The run equals the plain reference; an actor of host 1 killed mid-run ends the run on every host, named, with
nothing left behind; a cluster with fewer nodes than hosts asked is one line before anything starts."""

from __future__ import annotations

import os
import re
import signal

import pytest

from megatrain.ipc.shm import host_run_id
from megatrain.launch.cli.fidelity import compare
from tests.conftest import run_leftovers
from tests.test_equivalence import check, tiny_config
from tests.test_lifecycle import Cli

pytestmark = pytest.mark.slow

NODES = 2
NODE_CPUS = 3  # a CPU-device host's actors ask for 2 (its executor and Adam updater)


NO_AUTH = {"RAY_AUTH_MODE": "disabled"}  # the simulated cluster runs without Ray's token authentication


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    before = os.environ.get("RAY_AUTH_MODE")
    os.environ.update(NO_AUTH)  # for its nodes, and for the launcher that joins them in this process
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False})
    try:
        for _ in range(NODES - 1):
            nodes.add_node(num_cpus=NODE_CPUS)
        nodes.wait_for_nodes()
        yield nodes
    finally:
        import ray

        ray.shutdown()  # this process's connection (the in-process launcher's), before its nodes go
        nodes.shutdown()  # its own raylets and head, by pid
        if before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = before


def test_two_hosts_of_a_ray_cluster_match_one_model(cluster, tmp_path) -> None:
    extra = ["actors.num_hosts=2", "launch.runner=ray", f"launch.address={cluster.address}", "engine.device=cpu"]
    rep = compare(tiny_config("llama", False, 2, tmp_path, extra=extra), tmp_path)
    check(rep, tied=False)
    s = rep["summary"]
    assert s["hosts"] == 2 and "adam-updater@host1" in s["pids"]
    assert run_leftovers(host_run_id(s["run_id"], 1)) == []


def test_an_actor_killed_on_host_1_ends_the_run_on_every_host_named(cluster, tmp_path) -> None:
    cli = Cli(
        tmp_path,
        "actors.num_hosts=2",
        "engine.device=cpu",
        "train.save_every=0",
        "--address",
        cluster.address,
        steps=10_000,
        env=NO_AUTH,
    )
    line = cli.wait_for(r"actors: (.*)").group(1)
    pids = {name: int(pid) for name, pid in re.findall(r"([\w@-]+) pid (\d+)", line)}
    cli.tree |= set(pids.values())
    cli.wait_for(r"first step done")
    os.kill(pids["adam-updater@host1"], signal.SIGKILL)
    assert cli.finish() == 1, cli.text()
    assert "adam-updater@host1" in "".join(cli.stderr), cli.text()
    cli.assert_clean()
    assert run_leftovers(host_run_id(cli.run_id, 1)) == []


def test_more_hosts_than_nodes_is_one_line_before_anything_starts(cluster, tmp_path) -> None:
    hosts = [f"actors.num_hosts={NODES + 1}", f"data.batch_size={NODES + 1}"]
    cli = Cli(tmp_path, *hosts, "engine.device=cpu", "--address", cluster.address, env=NO_AUTH)
    assert cli.finish() == 1, cli.text()
    assert f"actors.num_hosts {NODES + 1}: the Ray cluster has {NODES} nodes alive" in "".join(cli.stderr), cli.text()
    assert "actors: " not in "".join(cli.stdout)
