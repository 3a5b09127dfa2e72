"""A run over several hosts through real Ray: a cluster of several nodes simulated on this machine (raylets of
their own, ray.cluster_utils.Cluster), each host of the run placed on a node of its own by one placement group.
The run follows one host's (every actor of either host killed mid-run: tests/test_hosts_kills.py); a cluster
with fewer nodes than hosts asked is one line before anything starts."""

from __future__ import annotations

import secrets

import pytest
import torch

from megatrain.ipc.shared.shm import host_run_id
from megatrain.launch.config.tree import load_config
from megatrain.launch.run.driver import Trainer
from tests.harness import NO_AUTH, NODES, ROOT, SMALL, Cli, final_weights, losses, run_leftovers
from tests.update_fixtures import rows

pytestmark = pytest.mark.slow


def test_two_hosts_of_a_ray_cluster_follow_one_host(cluster, tmp_path, monkeypatch) -> None:
    """Six steps over two nodes of the cluster, each host's executor updating its slice of the first two units,
    equal six in one process on one host (to fp32 rounding: the gradients' sums are ordered otherwise), the
    losses and the final weights exported from the hosts' slices.
    The launcher's machine has a Ray token and no RAY_AUTH_MODE, the cluster no authentication: it joins
    without the token (sent, its actors died before they started)."""
    monkeypatch.delenv("RAY_AUTH_MODE")
    (tmp_path / "home").mkdir()
    token = {"HOME": str(tmp_path / "home"), "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    over = ["engine.device=cpu", "train.save_every=0", "train.save_final=true", "train.final_eval=false"]
    # each host's executor holds its slice of the first two units' optimizer, through real processes
    two = ["actors.num_hosts=2", "engine.gpu_optimizer=2", *over]
    cli = Cli(tmp_path / "two", *two, "--address", cluster.address, steps=6, env=token)
    assert cli.finish(timeout=300) == 0, cli.text()
    cli.assert_clean()
    assert run_leftovers(host_run_id(cli.run_id, 1)) == []
    one = [*SMALL, "train.steps=6", f"train.output_dir={tmp_path / 'one'}", "launch.runner=inprocess", *over]
    Trainer(load_config(ROOT / "examples" / "default.yaml", one)).run()
    two_losses, one_losses = (losses(d) for d in (cli.out, tmp_path / "one"))
    assert sorted(two_losses) == list(range(1, 7))
    assert {r["gpu_units"] for r in rows(cli.out)} == {2}
    for s in one_losses:
        assert abs(two_losses[s] - one_losses[s]) <= 1e-5 * abs(one_losses[s]), s
    two_w, one_w = final_weights(cli.out), final_weights(tmp_path / "one")
    for name, w in one_w.items():
        assert torch.allclose(two_w[name], w, rtol=1e-5, atol=1e-7), name


def test_more_hosts_than_nodes_is_one_line_before_anything_starts(cluster, tmp_path) -> None:
    hosts = [f"actors.num_hosts={NODES + 1}", f"data.batch_size={NODES + 1}"]
    cli = Cli(tmp_path, *hosts, "engine.device=cpu", "--address", cluster.address, env=NO_AUTH)
    assert cli.finish() == 2, cli.text()  # the value asks for more than the cluster has: a usage error
    said = f"command line 'actors.num_hosts={NODES + 1}': actors.num_hosts: {NODES + 1} hosts, but the Ray cluster"
    assert f"{said} has {NODES} nodes alive" in "".join(cli.stderr), cli.text()
    assert "actors: " not in "".join(cli.stdout)


def test_the_launchers_gloo_interface_reaches_every_host_and_one_it_cannot_use_is_named(cluster, tmp_path) -> None:
    """GLOO_SOCKET_IFNAME set where the launcher runs goes to the actors on every node (theirs is their raylet's
    environment); an interface gloo cannot listen on ends the run at start-up, named, with nothing left behind."""
    env = {**NO_AUTH, "GLOO_SOCKET_IFNAME": "no-such-if0"}
    cli = Cli(tmp_path, "actors.num_hosts=2", "engine.device=cpu", "--address", cluster.address, env=env)
    assert cli.finish(timeout=300) == 1, cli.text()
    err = "".join(cli.stderr)
    assert "gloo cannot listen on the interfaces GLOO_SOCKET_IFNAME names (no-such-if0)" in err, cli.text()
    cli.assert_clean()
