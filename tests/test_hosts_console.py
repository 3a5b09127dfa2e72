"""What the terminal of a run over several hosts shows, on a Ray cluster of several nodes simulated on this machine
(tests/test_hosts_cluster.py's): the run's own lines, and none of Ray's (its deduplication notices, the
autoscaler's events, its INFO lines on joining), which stay in Ray's log files. A placement that waits says for
what in one line; a train.run_id too long for the hosts `auto` finds is a usage error naming the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import NO_AUTH, NODE_CPUS, NODES, ROOT, TINY_DEFAULT, Cli

pytestmark = pytest.mark.slow

RAYS_OWN = ("Ray deduplicates logs", "repeated ", "(autoscaler", "Tip: use `ray status`", "INFO worker.py")


def test_a_run_id_too_long_for_the_hosts_of_auto_is_refused_by_name(cluster, tmp_path) -> None:  # noqa: F811
    """`actors.num_hosts: auto` takes the cluster's two nodes: a 31-character run id has no room for host 1's store
    name, refused once the nodes are counted, before anything is placed: exit 2, naming train.run_id."""
    run_id = "r" * 31
    cmd = [
        sys.executable,
        "-m",
        "megatrain.launch.cli.main",
        *TINY_DEFAULT,
        "engine.device=cpu",
        "actors.num_hosts=auto",
        f"train.run_id={run_id}",
        f"train.output_dir={tmp_path / 'out'}",
        "--address",
        cluster.address,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **NO_AUTH})
    err = proc.stderr
    assert proc.returncode == 2, proc.stdout + err
    said = f"command line 'train.run_id={run_id}': train.run_id: run id '{run_id}'"
    assert f"{said} is too long for host 1's store" in err, err
    assert f"(actors.num_hosts auto: {NODES} hosts, one per node alive)" in err, err
    assert len(err.strip().splitlines()) == 1 and "internal error" not in err, err
    assert "actors: " not in proc.stdout and not (tmp_path / "out" / "config.yaml").exists()


def test_a_placement_that_waits_says_for_what_in_one_line_of_its_own(cluster, tmp_path) -> None:  # noqa: F811
    """Each host asks for more CPUs than a node has (three executors and an Adam updater on the CPU device): the run
    says what it waits for, and for how long, then gives up in one line; none of Ray's lines reach the terminal."""
    cli = Cli(
        tmp_path,
        "actors.num_hosts=2",
        "actors.num_gpus=3",
        "data.batch_size=6",
        "engine.device=cpu",
        "launch.placement_timeout_s=8",
        "--address",
        cluster.address,
        env=NO_AUTH,
    )
    assert cli.finish(timeout=300) == 1, cli.text()
    out, err = "".join(cli.stdout), "".join(cli.stderr)
    assert (
        "[megatrain] waiting up to 8 s (launch.placement_timeout_s) for the placement of hosts 0-1: each a node of "
        f"its own with 4 CPUs free; the cluster has {NODES} nodes alive ("
        + "; ".join([f"{NODE_CPUS} CPUs"] * NODES)
        + ")"
    ) in out, cli.text()
    assert "cannot place the store's actors on each of 2 nodes: they need 4 CPUs on one node" in err, cli.text()
    assert "(waited 8s)" in err and len(err.strip().splitlines()) == 1, cli.text()
    assert not [s for s in RAYS_OWN if s in out + err], cli.text()
    cli.assert_clean()


# Joins the cluster as the launcher does (launch/control/cluster.py), has three actors print one line alike,
# and reports what reached this process's terminal once all three copies have (or a minute has passed), and what
# the driver would print of an autoscaler event.
ECHO = r"""
import json, sys, time
import ray
from megatrain.launch.control import cluster

class Seen:
    def __init__(self, real):
        self.real, self.text = real, ""
    def write(self, s):
        self.text += s
        return self.real.write(s)
    def flush(self):
        self.real.flush()
    def __getattr__(self, name):  # fileno and the rest: the real stream's
        return getattr(self.real, name)

out, err = Seen(sys.stdout), Seen(sys.stderr)
sys.stdout, sys.stderr = out, err
conn = cluster.connect(ray, address=sys.argv[1], num_cpus=0, object_store_mb=0, cpus_needed=0)
try:
    @ray.remote(num_cpus=0)
    class Echo:
        def say(self):
            print("the same line from every actor", flush=True)

    echoes = [Echo.remote() for _ in range(3)]
    ray.get([e.say.remote() for e in echoes])
    deadline = time.monotonic() + 60
    while out.text.count("the same line from every actor") < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    from ray._private.worker import filter_autoscaler_events
    events = list(filter_autoscaler_events([":event_summary:Adding 1 node(s) of type worker."]))
finally:
    cluster.disconnect(ray, conn)
sys.__stdout__.write(json.dumps({"out": out.text, "err": err.text, "events": events}) + "\n")
"""


def test_ray_neither_deduplicates_the_actors_lines_nor_prints_its_own(cluster) -> None:  # noqa: F811
    """Three actors on the cluster print one line alike: each copy reaches the terminal as it came (Ray would hold
    the later ones back and print '[repeated 2x across cluster]' and a notice about it), without colour codes in a
    pipe, and an autoscaler event is not printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_DEDUP_LOGS", "RAY_SCHEDULER_EVENTS")}
    proc = subprocess.run(
        [sys.executable, "-c", ECHO, cluster.address],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, **NO_AUTH},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith('{"out": ')))
    assert seen["out"].count("the same line from every actor") == 3, seen
    assert "\x1b[" not in seen["out"], seen  # into a pipe: without Ray's colour codes
    assert not [s for s in RAYS_OWN if s in seen["out"] + seen["err"]], seen
    assert seen["events"] == [], seen
